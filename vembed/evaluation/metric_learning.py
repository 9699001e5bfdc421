"""Image-retrieval metrics of labelled embeddings (the metric_learning task), as pytorch-metric-learning's
`AccuracyCalculator` defines them (tests/evaluation/test_metric_learning_metrics.py checks them against it).

Each image of the split is a query against all the others (leave-one-out), ranked by Euclidean distance (PML's
default; on L2-normalised embeddings the same order as cosine). Its positives are the other images of its class;
R is their number. A query whose class has no other image has nothing to find and is left out of every average.

- precision_at_1: share of queries whose nearest image is of their class (PML's name; the field's Recall@1)
- recall_at_k: share of queries with an image of their class among the k nearest (metric learning's Recall@K,
  as CUB-200 / Cars-196 / SOP papers report it)
- r_precision: share of the R nearest that are of the query's class
- mean_average_precision_at_r: MAP@R (Musgrave et al. 2020), average precision over the R nearest, divided by R
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

RECALL_KS = (1, 2, 4, 8)
METRICS = ("precision_at_1", *(f"recall_at_{k}" for k in RECALL_KS), "r_precision", "mean_average_precision_at_r")
_CHUNK_CELLS = 1 << 24  # query × reference distances held at once (float64: 128 MiB)


def retrieval_metrics(embeddings: Any, labels: Any, ks: tuple[int, ...] = RECALL_KS) -> dict[str, Any]:
    """Every metric of `embeddings` (n, d) with class ids `labels` (n,)."""
    points = torch.as_tensor(np.asarray(embeddings), dtype=torch.float64)
    classes = torch.as_tensor(np.asarray(labels)).long()
    n = len(classes)
    if n != len(points):
        raise ValueError(f"{len(points)} embeddings but {n} labels")
    counts = torch.bincount(classes - classes.min()) if n else torch.zeros(0, dtype=torch.long)
    positives = counts[classes - classes.min()] - 1 if n else torch.zeros(0, dtype=torch.long)  # R per query
    keys = ["precision_at_1", *(f"recall_at_{k}" for k in ks), "r_precision", "mean_average_precision_at_r"]
    per_query: dict[str, list[torch.Tensor]] = {key: [] for key in keys}
    squared = (points * points).sum(1)
    step = max(1, _CHUNK_CELLS // max(n, 1))
    for start in range(0, n, step):
        rows = torch.arange(start, min(start + step, n))
        distance = squared[rows, None] + squared[None, :] - 2 * points[rows] @ points.T
        distance[torch.arange(len(rows)), rows] = float("inf")  # a query never retrieves itself
        order = torch.sort(distance, dim=1, stable=True).indices[:, : n - 1]
        relevant = classes[order] == classes[rows, None]  # (queries, n - 1), nearest first
        r = positives[rows]
        within_r = torch.arange(n - 1)[None, :] < r[:, None]
        hits = relevant & within_r
        precision_at = hits.cumsum(1).double() / torch.arange(1, n, dtype=torch.float64)
        keep = r > 0
        safe_r = r.clamp(min=1).double()
        per_query["precision_at_1"].append(relevant[keep, 0].double())
        per_query["r_precision"].append((hits.sum(1) / safe_r)[keep])
        per_query["mean_average_precision_at_r"].append(((precision_at * hits).sum(1) / safe_r)[keep])
        for k in ks:
            per_query[f"recall_at_{k}"].append(relevant[keep, :k].any(1).double())
    queries = int((positives > 0).sum()) if n else 0
    metrics: dict[str, Any] = {}
    for key in keys:
        values = torch.cat(per_query[key]) if per_query[key] else torch.zeros(0, dtype=torch.float64)
        metrics[key] = float(values.mean()) if len(values) else float("nan")
    metrics.update(num_samples=n, num_queries=queries, num_classes=int((counts > 0).sum()) if n else 0)
    return metrics


__all__ = ["METRICS", "RECALL_KS", "retrieval_metrics"]
