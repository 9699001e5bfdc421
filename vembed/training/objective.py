"""What the optimizer sees of a task's objective: AdamW parameter groups (the objective itself, model and loss in one
module, is the task's: `Task.build_objective`), with layer-wise learning-rate decay when the recipe asks for it."""

from __future__ import annotations

from typing import Any

from torch import nn

from vembed.errors import RecipeError
from vembed.models.depths import layer_depths


def parameter_groups(module: nn.Module, weight_decay: float, layer_lr_decay: float | None = None,
                     lr_scales: dict[nn.Parameter, float] | None = None) -> list[dict[str, Any]]:
    """AdamW groups: no weight decay on biases, norms, embeddings' scalars or the loss's temperature/bias. With
    `layer_lr_decay`, a group per (depth, decay) whose `lr_scale` is decay ** (top depth - depth); the top groups
    (scale 1, what the run logs as its learning rate) first. `lr_scales`: parameters with their own rate (a
    multiple of the learning rate, e.g. static_query_lr), each group apart, after the others."""
    lr_scales = lr_scales or {}
    named = [(name, param) for name, param in module.named_parameters() if param.requires_grad]
    depths, top = layer_depths([name for name, _ in named]) if layer_lr_decay is not None else ({}, 0)
    if layer_lr_decay is not None and top == 1:
        raise RecipeError("layer_lr_decay", "no trainable parameter name says which layer it is in (as "
                                            "'encoder.layer.3.' does); remove layer_lr_decay for this model")
    groups: dict[tuple[float | None, int, bool], dict[str, Any]] = {}
    for name, param in named:
        no_decay = param.ndim < 2 or name.startswith("loss.") or "norm" in name.lower()
        depth = depths.get(name, top)
        own = lr_scales.get(param)
        group = groups.setdefault((own, depth, no_decay),
                                  {"params": [], "weight_decay": 0.0 if no_decay else weight_decay})
        if own is not None:
            group["lr_scale"] = own
        elif layer_lr_decay is not None:
            group["lr_scale"] = layer_lr_decay ** (top - depth)
        group["params"].append(param)
    return [groups[key] for key in sorted(groups, key=lambda key: (key[0] is not None, key[0] or 0, -key[1], key[2]))]
