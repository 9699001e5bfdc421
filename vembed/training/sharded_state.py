"""Whole weights from a sharded model (ZeRO-3, FSDP2), and parameter counts that see through the partitioning."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from accelerate import Accelerator


def gather_full_state_dict(accelerator: "Accelerator", model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """Collective (every rank of a sharded launch must call it): the unwrapped objective's full state dict, on CPU,
    on the main process; None on the others. The launch plan has checked that ZeRO-3 can gather 16-bit weights."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = accelerator.get_state_dict(model)
    return {k: v.detach().cpu() for k, v in state.items()} if accelerator.is_main_process else None


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total), counting ZeRO-3-partitioned parameters at their full size."""
    trainable = total = 0
    for param in model.parameters():
        size = int(getattr(param, "ds_numel", 0) or param.numel())
        total += size
        trainable += size if param.requires_grad else 0
    return trainable, total
