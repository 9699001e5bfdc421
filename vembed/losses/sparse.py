"""FLOPS regularisation of sparse (SPLADE, `embedding: sparse`) vectors around any embedding loss, as
sentence-transformers' SpladeLoss puts its FlopsLoss around a sparse loss (Paria et al., 2020; thresholds: Geng et
al., 2025):

    loss = inner(q, p, n) + query_weight * FLOPS(q) + document_weight * FLOPS([p ; n])
    FLOPS(w) = sum over the vocabulary v of (mean over the batch's rows i of w[i, v])^2

Vectors with at most `threshold` non-zero weights count as zero rows in the mean (FLOPS with l0 masking): the rows
are still counted. The mean is over the GLOBAL batch: under torch.distributed each rank's column sums are summed
over ranks with gradients (`vembed.distributed.all_reduce_with_grad`) and every rank returns the global FLOPS, so
DDP's averaging of gradients gives the gradient of one process on the concatenated batch.

With a warmup (`flops_warmup_ratio`), both weights rise from 0 over the first steps as sentence-transformers'
SpladeRegularizerWeightSchedulerCallback raises them (`warmup_factor`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from vembed.distributed import all_reduce_with_grad, is_distributed
from vembed.losses.base import EmbeddingLoss
from vembed.losses.contrastive import _full_precision, _upcast


def warmup_factor(step: int, total_steps: int, ratio: float | None, kind: str) -> float:
    """The share of the FLOPS weights at `step` (optimizer steps done) of `total_steps`: (step / warmup)^2 or
    step / warmup before the warmup's end, 1 after, with warmup = int(total_steps * ratio), at least 1 step
    (sentence-transformers' schedule); 1 throughout without a ratio."""
    if not ratio:
        return 1.0
    warmup = max(int(total_steps * ratio), 1)
    if step >= warmup:
        return 1.0
    return step / warmup if kind == "linear" else (step / warmup) ** 2


def flops(weights: torch.Tensor, threshold: int | None = None) -> torch.Tensor:
    """FLOPS of `weights` `(n, V)` (this rank's rows of the global batch): the sum over columns of the squared mean
    over every rank's rows, rows with at most `threshold` non-zero weights counting as zeros."""
    weights = _upcast(weights)
    if threshold is not None:
        active = weights.detach().ne(0).sum(dim=1) > threshold
        weights = weights * active.unsqueeze(1).to(weights.dtype)
    rows = torch.tensor(float(weights.shape[0]), dtype=weights.dtype, device=weights.device)
    if is_distributed():
        dist.all_reduce(rows, op=dist.ReduceOp.SUM)
    return ((all_reduce_with_grad(weights.sum(dim=0)) / rows) ** 2).sum()


class FlopsRegularizedLoss(EmbeddingLoss):
    """`loss` plus the FLOPS of the queries and of the documents (positives and hard negatives together), each
    weighted; a side whose weight is None or 0 adds nothing. What a batch must carry is the inner loss's.

    Inputs: as the inner loss's, with `(B, V)` sparse vectors (`(B, k, V)` hard negatives). Example::

        loss_fn = FlopsRegularizedLoss(InfoNCELoss(temperature=1.0, symmetric=False), query_weight=5e-5,
                                       document_weight=3e-5)
        q, p = torch.rand(8, 300), torch.rand(8, 300)
        loss = loss_fn(q, p)  # scalar
    """

    def __init__(self, loss: EmbeddingLoss, query_weight: float | None = None, document_weight: float | None = None,
                 query_threshold: int | None = None, document_threshold: int | None = None,
                 warmup_ratio: float | None = None, warmup: str = "quadratic"):
        super().__init__()
        for attribute in ("needs_scores", "needs_labels", "min_negatives", "uses_negatives", "needs_guide",
                          "needs_teacher", "gradient_cache_refusal", "token_vectors"):
            setattr(self, attribute, getattr(loss, attribute))
        for name, weight in (("query_weight", query_weight), ("document_weight", document_weight)):
            if weight is not None and weight < 0:
                raise ValueError(f"{name} must be >= 0, got {weight}")
        self.loss = loss
        self.query_weight, self.document_weight = query_weight, document_weight
        self.query_threshold, self.document_threshold = query_threshold, document_threshold
        self.warmup_ratio, self.warmup = warmup_ratio, warmup
        self.weight_factor = 1.0 if not warmup_ratio else 0.0  # set by `begin_step`; step 0 of a warmup: 0

    def begin_step(self, step: int, total_steps: int) -> None:
        self.weight_factor = warmup_factor(step, total_steps, self.warmup_ratio, self.warmup)
        self.loss.begin_step(step, total_steps)

    def forward(
        self, query: torch.Tensor, positive: torch.Tensor, negatives: torch.Tensor | None = None,
        labels: torch.Tensor | None = None, scores: torch.Tensor | None = None, **inputs: Any,
    ) -> torch.Tensor:
        total = self.loss(query, positive, negatives, labels=labels, scores=scores, **inputs)
        with _full_precision(query.device):
            if self.document_weight:
                documents = positive if negatives is None else torch.cat([positive, negatives.flatten(0, 1)])
                total = total + self.weight_factor * self.document_weight * flops(documents, self.document_threshold)
            if self.query_weight:
                total = total + self.weight_factor * self.query_weight * flops(query, self.query_threshold)
        return total

    @property
    def config(self) -> dict[str, Any]:
        return {"name": type(self).__name__, "query_weight": self.query_weight,
                "document_weight": self.document_weight, "query_threshold": self.query_threshold,
                "document_threshold": self.document_threshold, "warmup_ratio": self.warmup_ratio,
                "warmup": self.warmup, "loss": self.loss.config}


__all__ = ["FlopsRegularizedLoss", "flops", "warmup_factor"]
