"""The trainable unit: an adapter and its loss in one module, so the strategy wraps (DDP, ...) both at once.

A learnable temperature or SigLIP bias lives in the loss; keeping the loss inside the wrapped module is what makes
DDP average its gradient like every other parameter.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vembed.losses.base import EmbeddingLoss
from vembed.models.base import EmbeddingAdapter


class ContrastiveObjective(nn.Module):
    def __init__(self, adapter: EmbeddingAdapter, loss: EmbeddingLoss):
        super().__init__()
        self.adapter = adapter
        self.loss = loss

    def embed(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Query, positive and (B, k, d) hard-negative embeddings of a collated batch."""
        query = self.adapter.encode(batch["query"])
        positive = self.adapter.encode(batch["positive"])
        negatives = None
        k = int(batch.get("num_negatives", 0) or 0)
        if k > 0:
            negatives = self.adapter.encode(batch["negative"]).view(query.shape[0], k, -1)
        return query, positive, negatives

    def forward(self, batch: dict[str, Any]) -> torch.Tensor:
        return self.loss(*self.embed(batch))


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
