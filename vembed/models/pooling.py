"""Pooling token states into one vector per sequence."""

from __future__ import annotations

from typing import Any

import torch


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor | None, pooling: str) -> torch.Tensor:
    """Pool token states `(n, seq, d)` to `(n, d)`; correct under left and right padding.

    cls: the first attended token; mean: the mean over attended tokens; last: the last attended token.
    """
    if attention_mask is None:
        attention_mask = torch.ones(hidden.shape[:2], dtype=torch.long, device=hidden.device)
    attention_mask = attention_mask.long()  # argmax is not defined for bool masks on every device
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    if pooling == "mean":
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
    if pooling == "cls":
        return hidden[rows, attention_mask.argmax(1)]  # argmax returns the first maximum: the first real token
    if pooling == "last":
        last = hidden.shape[1] - 1 - attention_mask.flip(1).argmax(1)
        return hidden[rows, last]
    raise ValueError(f"unknown pooling {pooling!r}; use cls, mean or last")


def cls_or_pooler(output: Any) -> torch.Tensor:
    """A vision tower's image embedding: its pooler_output when it has one, else the first (CLS) token."""
    pooled = getattr(output, "pooler_output", None)
    return pooled if pooled is not None else output.last_hidden_state[:, 0]

