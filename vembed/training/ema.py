"""An exponential moving average of the trained weights (`ema_decay`), as timm's ModelEmaV3 keeps one: after every
optimizer step `average = decay × average + (1 − decay) × weight`, for each trainable parameter. Evaluations and
final/ use the average in place of the last step's weights; checkpoints hold it, so a resumed run goes on with the
same average.

Our own, not torch's `AveragedModel`: that deep-copies the whole module (frozen weights, a LoRA base model, the
tokenizer) where only the trained tensors change, and it has no way to lend the average to the live model, which the
evaluation's forward passes (through DDP's wrapper) and the saving code read. Kept in float32 whatever the weights'
dtype, so a decay of 0.9999 still moves it. Not under FSDP or DeepSpeed (they shard the weights; the recipe check
refuses it there).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


class WeightAverage:
    """The average of `module`'s trainable parameters (by name), updated by `update` after each optimizer step."""

    def __init__(self, module: nn.Module, decay: float):
        self.decay = decay
        self.updates = 0
        self.average = {name: parameter.detach().float().clone()
                        for name, parameter in module.named_parameters() if parameter.requires_grad}

    @torch.no_grad()
    def update(self, module: nn.Module) -> None:
        for name, parameter in module.named_parameters():
            if name in self.average:
                self.average[name].lerp_(parameter.detach().float(), 1.0 - self.decay)
        self.updates += 1

    @contextmanager
    def lent_to(self, module: nn.Module) -> Iterator[None]:
        """`module`'s trainable parameters hold the average inside the block, their own values again after it."""
        own = self.copy_into(module)
        try:
            yield
        finally:
            with torch.no_grad():
                for name, parameter in module.named_parameters():
                    if name in own:
                        parameter.copy_(own[name])

    @torch.no_grad()
    def copy_into(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Write the average into `module` (each in its parameter's dtype); returns the values it replaced."""
        replaced = {}
        for name, parameter in module.named_parameters():
            if name in self.average:
                replaced[name] = parameter.detach().clone()
                parameter.copy_(self.average[name].to(parameter.dtype))
        return replaced

    # What accelerate's save_state / load_state keep of a registered object (custom_checkpoint_N.pkl).
    def state_dict(self) -> dict[str, Any]:
        return {"updates": self.updates, "average": self.average}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state["average"]) != set(self.average):
            differing = ", ".join(sorted(set(self.average) ^ set(state["average"]))[:3])
            raise ValueError(f"the checkpoint's weight average and this model differ in parameters ({differing})")
        device = next(iter(self.average.values())).device if self.average else None
        self.average = {name: tensor.to(device) for name, tensor in state["average"].items()}
        self.updates = int(state["updates"])


__all__ = ["WeightAverage"]
