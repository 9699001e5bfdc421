"""Which transformer block each parameter is in, read from its name: what layer-wise learning-rate decay
(vembed/training/objective.py) scales by, and what the recipe check of `layer_lr_decay` looks for."""

from __future__ import annotations

import re

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
