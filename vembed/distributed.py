"""Cross-process helpers used by losses and evaluation: rank/world and an all-gather that keeps gradients.

Kept apart from accelerate so that losses work in any torch.distributed program, not only inside our loop.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank_and_world() -> tuple[int, int]:
    if is_distributed():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_with_grad(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate `tensor` (same shape on every rank) along dim 0, in rank order, with gradients flowing back.

    The backward of `torch.distributed.nn.all_gather` sums the gradient every rank computed for a slice and hands it
    to the rank that owns it, so a loss computed on the gathered batch gives each rank the gradient of the global
    objective with respect to its own embeddings.
    """
    if not is_distributed():
        return tensor
    from torch.distributed.nn.functional import all_gather

    return torch.cat(all_gather(tensor.contiguous()), dim=0)


def gather_no_grad(tensor: torch.Tensor) -> torch.Tensor:
    if not is_distributed():
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts, dim=0)
