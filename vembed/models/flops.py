"""How much arithmetic a forward pass costs: the model FLOPs behind the MFU the loop logs.

The rule is the dense-transformer estimate (Kaplan et al., 2020): a forward pass costs 2 FLOPs (a multiply and an
add) per weight per token, so `2 × N × T` for N weights used as matrices and T tokens. Embedding tables are looked
up, not multiplied, so they are left out of N; attention's `T²` term is left out too (a few per cent at the sequence
lengths embedding models train on). Training costs 3× a forward (the backward pass computes gradients for both
activations and weights: 2× the forward); activation checkpointing's and GradCache's recomputation are not counted,
as is usual for MFU ("model FLOPs", not hardware FLOPs).

Counts are returned as 0-d tensors on the batch's device whenever they depend on data (attention-mask sums), so the
loop can add them up every step without a host synchronisation and read them once per log line.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

FORWARD_FLOPS_PER_WEIGHT_TOKEN = 2
TRAINING_FLOPS_PER_FORWARD = 3  # forward + backward (2× forward)


def matmul_weights(module: nn.Module) -> int:
    """Parameters of `module` that multiply activations: everything but embedding tables (LoRA weights included;
    frozen ones too, since a frozen weight still costs its forward and activation-gradient FLOPs)."""
    lookup = {id(p) for m in module.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}
    return sum(p.numel() for p in module.parameters() if id(p) not in lookup)


class WeightCounts:
    """`matmul_weights` per module, counted once (a model's size does not change during training; LoRA is injected
    before the first step)."""

    def __init__(self) -> None:
        self._counts: dict[int, int] = {}

    def __call__(self, module: nn.Module) -> int:
        key = id(module)
        if key not in self._counts:
            self._counts[key] = matmul_weights(module)
        return self._counts[key]


def text_tokens(inputs: dict[str, Any]) -> torch.Tensor | int:
    """Real (unpadded) text tokens of a preprocessed batch: the attention mask's sum, else every input id, else 0."""
    mask = inputs.get("attention_mask")
    if isinstance(mask, torch.Tensor):
        return mask.sum()
    ids = inputs.get("input_ids")
    return ids.numel() if isinstance(ids, torch.Tensor) else 0


def vision_tokens_per_image(config: Any, height: int, width: int) -> int:
    """Positions a vision tower processes per image: patches plus a class token for ViT-style towers (`patch_size`
    in the config). Towers without one (ConvNeXt, Swin, ResNet) are counted at their final stride of 32, which
    undercounts their early high-resolution stages: MFU reads low for them."""
    patch = getattr(config, "patch_size", None) or 32
    patch = patch[0] if isinstance(patch, (list, tuple)) else patch
    return max(height // patch, 1) * max(width // patch, 1) + 1


def text_rows(inputs: dict[str, Any]) -> int:
    """Text rows (sides with text) of a preprocessed batch."""
    for key in ("attention_mask", "input_ids"):
        if isinstance(inputs.get(key), torch.Tensor):
            return int(inputs[key].shape[0])
    return 0


def text_flops(inputs: dict[str, Any], token_weights: int, row_weights: int = 0) -> torch.Tensor | int:
    """Forward FLOPs of a text tower whose `token_weights` see every token and `row_weights` (a projection or
    pooling head applied to the pooled state) one position per row."""
    per_row = FORWARD_FLOPS_PER_WEIGHT_TOKEN * row_weights * text_rows(inputs)
    return text_tokens(inputs) * (FORWARD_FLOPS_PER_WEIGHT_TOKEN * token_weights) + per_row


def vision_flops(config: Any, token_weights: int, row_weights: int, pixel_values: torch.Tensor) -> int:
    """Forward FLOPs of a vision tower on images `(n, C, H, W)`: `token_weights` see every patch, `row_weights` (a
    projection or pooling head) one position per image."""
    tokens = vision_tokens_per_image(config, int(pixel_values.shape[-2]), int(pixel_values.shape[-1]))
    per_image = token_weights * tokens + row_weights
    return FORWARD_FLOPS_PER_WEIGHT_TOKEN * per_image * int(pixel_values.shape[0])
