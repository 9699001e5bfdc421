"""Matryoshka representation learning: wrap any embedding loss so that prefixes of the embedding work on their own."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from vembed.losses.base import EmbeddingLoss


def _truncate(embeddings: torch.Tensor, dim: int) -> torch.Tensor:
    # Upcast first: the norm of a bf16 prefix loses more than the inner loss's float32 logits would recover.
    prefix = embeddings[..., :dim]
    return F.normalize(prefix.to(torch.promote_types(prefix.dtype, torch.float32)), dim=-1)


class MatryoshkaLoss(EmbeddingLoss):
    """Apply `loss` to the first d dimensions of the embeddings for each d in `dims`, and sum with `weights`.

    For each ``d``, the query, positive and hard-negative embeddings are cut to their first ``d`` dimensions and
    L2-normalised again (a prefix of a unit vector is not a unit vector), then passed to the inner loss::

        loss = sum_i weights[i] * inner(norm(q[:, :d_i]), norm(p[:, :d_i]), norm(n[:, :, :d_i]))

    ``dims`` may include the full embedding size (the untruncated loss, renormalisation then changes nothing);
    a ``d`` larger than the embedding size is an error. The inner loss is one shared module called once per ``d``,
    so its parameters (a learnable temperature, SigLIP's bias) are shared across dimensions and receive the summed
    gradient of all of them. The inner loss does its own cross-rank gathering, once per ``d``; the per-rank scaling
    that makes DDP gradients exact is linear, so it carries over to the weighted sum.

    Args:
        loss: the inner `EmbeddingLoss`, e.g. `InfoNCELoss`.
        dims: prefix sizes, e.g. ``[768, 512, 256, 128, 64]``.
        weights: one weight per entry of ``dims``; unset: all 1.0 (a sum, as in sentence-transformers).

    Example::

        loss_fn = MatryoshkaLoss(InfoNCELoss(temperature=0.05), dims=[64, 32, 16], weights=[1.0, 0.5, 0.5])
        q = F.normalize(torch.randn(8, 64), dim=-1)
        p = F.normalize(torch.randn(8, 64), dim=-1)
        loss = loss_fn(q, p)  # scalar
    """

    def __init__(self, loss: EmbeddingLoss, dims: Sequence[int], weights: Sequence[float] | None = None):
        super().__init__()
        # What the inner loss needs of a batch, it needs through the wrapper too.
        for attribute in ("needs_scores", "needs_labels", "min_negatives", "uses_negatives",
                          "needs_guide", "needs_teacher", "gradient_cache_refusal"):
            setattr(self, attribute, getattr(loss, attribute))
        dims = [int(d) for d in dims]
        if not dims or any(d <= 0 for d in dims):
            raise ValueError(f"dims must be a non-empty list of positive sizes, got {dims}")
        if weights is None:
            weights = [1.0] * len(dims)
        if len(weights) != len(dims):
            raise ValueError(f"got {len(weights)} weights for {len(dims)} dims; give one weight per dimension")
        self.loss = loss
        self.dims = dims
        self.weights = [float(w) for w in weights]

    def begin_step(self, step: int, total_steps: int) -> None:
        self.loss.begin_step(step, total_steps)

    def forward(
        self, query: torch.Tensor, positive: torch.Tensor, negatives: torch.Tensor | None = None,
        labels: torch.Tensor | None = None, scores: torch.Tensor | None = None, **inputs: Any,
    ) -> torch.Tensor:
        size = query.shape[-1]
        too_big = [d for d in self.dims if d > size]
        if too_big:
            raise ValueError(f"Matryoshka dims {too_big} exceed the embedding size {size}")
        total = None
        for dim, weight in zip(self.dims, self.weights):
            term = weight * self.loss(
                _truncate(query, dim),
                _truncate(positive, dim),
                _truncate(negatives, dim) if negatives is not None else None,
                labels=labels,
                scores=scores,
                **inputs,  # a guide's embeddings (GISTEmbed) are another model's: not truncated
            )
            total = term if total is None else total + term
        return total

    @property
    def config(self) -> dict[str, Any]:
        return {"name": type(self).__name__, "dims": self.dims, "weights": self.weights, "loss": self.loss.config}


__all__ = ["MatryoshkaLoss"]
