"""Evaluation of graded pairs and triplets, as sentence-transformers' embedding-similarity and triplet evaluators:
Spearman and Pearson correlation of each pair's cosine with its gold score, and the share of triplets whose positive
is closer (by cosine) to the query than its hard negative.

Reported for a split whose every record has a number in the score column (`similarity/...`) and, where every record
has a hard negative, for its first negative (`triplet/...`); nothing otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from accelerate import Accelerator

    from vembed.data.records import Example
    from vembed.models.base import EmbeddingAdapter

SIMILARITY_METRICS = ("similarity/spearman_cosine", "similarity/pearson_cosine")
TRIPLET_METRICS = ("triplet/cosine_accuracy",)


def _average_ranks(values: np.ndarray) -> np.ndarray:
    """Ranks from 1, ties given the mean of the ranks they span (what Spearman's correlation takes)."""
    order = np.argsort(values, kind="mergesort")
    ordered = values[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    ends = np.r_[starts[1:], len(values)]
    ranks = np.empty(len(values), dtype=np.float64)
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    return ranks


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    x, y = x - x.mean(), y - y.mean()
    denominator = np.sqrt((x * x).sum() * (y * y).sum())
    return float((x * y).sum() / denominator) if denominator > 0 else float("nan")


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    return pearson(_average_ranks(np.asarray(x, dtype=np.float64)), _average_ranks(np.asarray(y, dtype=np.float64)))


def similarity_metrics(first: torch.Tensor, second: torch.Tensor, gold: Sequence[float]) -> dict[str, float]:
    """Spearman and Pearson correlation between cos(first_i, second_i) and gold_i."""
    cosines = (F.normalize(first.double(), dim=-1) * F.normalize(second.double(), dim=-1)).sum(-1).cpu().numpy()
    gold = np.asarray(gold, dtype=np.float64)
    return {"similarity/spearman_cosine": spearman(cosines, gold), "similarity/pearson_cosine": pearson(cosines, gold)}


def triplet_accuracy(query: torch.Tensor, positive: torch.Tensor, negative: torch.Tensor) -> dict[str, float]:
    """The share of rows where the positive's cosine with the query is above the negative's."""
    q, p, n = (F.normalize(t.double(), dim=-1) for t in (query, positive, negative))
    return {"triplet/cosine_accuracy": ((q * p).sum(-1) > (q * n).sum(-1)).double().mean().item()}


def evaluate_scored(
    adapter: "EmbeddingAdapter",
    examples: Sequence["Example"],
    *,
    batch_size: int = 64,
    accelerator: "Accelerator | None" = None,
    forward: "Callable[[dict[str, Any]], torch.Tensor] | None" = None,
) -> dict[str, float]:
    """`similarity/spearman_cosine`, `similarity/pearson_cosine` where every record has a number in the score
    column; `triplet/cosine_accuracy` where every record has a hard negative (its first); {} otherwise."""
    from vembed.models.encoding import encode_sides

    scored = bool(examples) and all(isinstance(ex.score, (int, float)) for ex in examples)
    triplets = bool(examples) and all(ex.negatives for ex in examples)
    if not (scored or triplets):
        return {}
    kwargs: dict[str, Any] = dict(batch_size=batch_size, accelerator=accelerator, forward=forward)
    query = encode_sides(adapter, [ex.query for ex in examples], desc="queries", **kwargs)
    positive = encode_sides(adapter, [ex.positive for ex in examples], desc="pairs", **kwargs)
    metrics: dict[str, float] = {}
    if scored:
        metrics.update(similarity_metrics(query, positive, [float(ex.score) for ex in examples]))
    if triplets:
        negative = encode_sides(adapter, [ex.negatives[0] for ex in examples], desc="negatives", **kwargs)
        metrics.update(triplet_accuracy(query, positive, negative))
    return metrics


__all__ = ["SIMILARITY_METRICS", "TRIPLET_METRICS", "evaluate_scored", "pearson", "similarity_metrics", "spearman",
           "triplet_accuracy"]
