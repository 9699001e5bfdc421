"""What the optimizer sees of a task's objective: AdamW parameter groups (the objective itself, model and loss in one
module, is the task's: `Task.build_objective`), with layer-wise learning-rate decay when the recipe asks for it."""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from vembed.errors import RecipeError

# A transformer block's index in a parameter name, as transformers (`encoder.layer.3.`, `layers.3.`, `h.3.`) and
# timm-style vision towers (`blocks.3.`) name them.
LAYER_INDEX = re.compile(r"(?:^|\.)(?:layer|layers|h|blocks)\.(\d+)\.")
# Parameters below the first block: token/patch/position embeddings and the tokens prepended to a sequence.
EMBEDDING_NAMES = re.compile(r"embed|cls_token|register_tokens|mask_token|pos_embed")


def layer_depths(names: list[str]) -> tuple[dict[str, int], int]:
    """Each parameter's depth (0: embeddings, i + 1: block i, num_blocks + 1: everything above the blocks, such as
    final norms, pooling, projection and heads, and the loss) and the top depth. Where several towers each number their
    blocks from 0 (a text and a vision tower), equal indices share a depth."""
    indices = {name: LAYER_INDEX.search(name) for name in names}
    num_blocks = 1 + max((int(m.group(1)) for m in indices.values() if m), default=-1)
    depths = {}
    for name, match in indices.items():
        if match:
            depths[name] = int(match.group(1)) + 1
        elif EMBEDDING_NAMES.search(name) and not name.startswith("loss."):
            depths[name] = 0
        else:
            depths[name] = num_blocks + 1
    return depths, num_blocks + 1


def parameter_groups(module: nn.Module, weight_decay: float,
                     layer_lr_decay: float | None = None) -> list[dict[str, Any]]:
    """AdamW groups: no weight decay on biases, norms, embeddings' scalars or the loss's temperature/bias. With
    `layer_lr_decay`, a group per (depth, decay) whose `lr_scale` is decay ** (top depth - depth); the top groups
    (scale 1, what the run logs as its learning rate) first."""
    named = [(name, param) for name, param in module.named_parameters() if param.requires_grad]
    depths, top = layer_depths([name for name, _ in named]) if layer_lr_decay is not None else ({}, 0)
    if layer_lr_decay is not None and top == 1:
        raise RecipeError("layer_lr_decay", "no trainable parameter name says which layer it is in (as "
                                            "'encoder.layer.3.' does); remove layer_lr_decay for this model")
    groups: dict[tuple[int, bool], dict[str, Any]] = {}
    for name, param in named:
        no_decay = param.ndim < 2 or name.startswith("loss.") or "norm" in name.lower()
        depth = depths.get(name, top)
        group = groups.setdefault((depth, no_decay), {"params": [], "weight_decay": 0.0 if no_decay else weight_decay})
        if layer_lr_decay is not None:
            group["lr_scale"] = layer_lr_decay ** (top - depth)
        group["params"].append(param)
    return [groups[key] for key in sorted(groups, key=lambda key: (-key[0], key[1]))]
