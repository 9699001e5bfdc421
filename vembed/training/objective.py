"""What the optimizer sees of a task's objective: AdamW parameter groups (the objective itself, model and loss in one
module, is the task's: `Task.build_objective`)."""

from __future__ import annotations

from typing import Any

from torch import nn


def parameter_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: no weight decay on biases, norms, embeddings' scalars or the loss's temperature/bias."""
    decay, no_decay = [], []
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        if param.ndim < 2 or name.startswith("loss.") or "norm" in name.lower():
            no_decay.append(param)
        else:
            decay.append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]
