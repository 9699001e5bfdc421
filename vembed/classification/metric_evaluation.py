"""Image-retrieval metrics of labelled embeddings (the metric_learning task), as pytorch-metric-learning's
`AccuracyCalculator` defines them (tests/classification/test_metric_learning_metrics.py checks them against it).

Each image of the split is a query against all the others (leave-one-out), or, where the split names a query set and
a gallery, each query against the gallery; ranked by Euclidean distance (PML's default; on L2-normalised embeddings
the same order as cosine). Its positives are the other images of its class;
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


def retrieval_metrics(embeddings: Any, labels: Any, ks: tuple[int, ...] = RECALL_KS, *,
                      reference_embeddings: Any = None, reference_labels: Any = None) -> dict[str, Any]:
    """Every metric of `embeddings` (n, d) with class ids `labels` (n,): each a query against the others
    (leave-one-out), or, given a gallery (`reference_embeddings`, `reference_labels`), each against the gallery (the
    query/gallery protocol of In-Shop-style benchmarks: PML's `ref_includes_query=False`)."""
    points = torch.as_tensor(np.asarray(embeddings), dtype=torch.float64)
    classes = torch.as_tensor(np.asarray(labels)).long()
    n = len(classes)
    if n != len(points):
        raise ValueError(f"{len(points)} embeddings but {n} labels")
    leave_one_out = reference_embeddings is None
    if leave_one_out:
        reference, reference_classes = points, classes
    else:
        reference = torch.as_tensor(np.asarray(reference_embeddings), dtype=torch.float64)
        reference_classes = torch.as_tensor(np.asarray(reference_labels)).long()
        if len(reference) != len(reference_classes):
            raise ValueError(f"{len(reference)} reference embeddings but {len(reference_classes)} labels")
    ranked = len(reference) - 1 if leave_one_out else len(reference)  # what one query is ranked against
    # R per query: the other images of its class (leave-one-out), or those in the gallery.
    low = int(torch.cat([classes, reference_classes]).min()) if n else 0
    in_reference = torch.bincount(reference_classes - low, minlength=int(classes.max()) - low + 1 if n else 0)
    positives = in_reference[classes - low] - (1 if leave_one_out else 0) if n else torch.zeros(0, dtype=torch.long)
    keys = ["precision_at_1", *(f"recall_at_{k}" for k in ks), "r_precision", "mean_average_precision_at_r"]
    per_query: dict[str, list[torch.Tensor]] = {key: [] for key in keys}
    squared, reference_squared = (points * points).sum(1), (reference * reference).sum(1)
    step = max(1, _CHUNK_CELLS // max(len(reference), 1))
    for start in range(0, n, step):
        rows = torch.arange(start, min(start + step, n))
        distance = squared[rows, None] + reference_squared[None, :] - 2 * points[rows] @ reference.T
        if leave_one_out:
            distance[torch.arange(len(rows)), rows] = float("inf")  # a query never retrieves itself
        order = torch.sort(distance, dim=1, stable=True).indices[:, :ranked]
        relevant = reference_classes[order] == classes[rows, None]  # (queries, ranked), nearest first
        r = positives[rows]
        within_r = torch.arange(ranked)[None, :] < r[:, None]
        hits = relevant & within_r
        precision_at = hits.cumsum(1).double() / torch.arange(1, ranked + 1, dtype=torch.float64)
        keep = r > 0
        safe_r = r.clamp(min=1).double()
        per_query["precision_at_1"].append(relevant[keep, 0].double())
        per_query["r_precision"].append((hits.sum(1) / safe_r)[keep])
        per_query["mean_average_precision_at_r"].append(((precision_at * hits).sum(1) / safe_r)[keep])
        for k in ks:
            per_query[f"recall_at_{k}"].append(relevant[keep, :k].any(1).double())
    metrics: dict[str, Any] = {}
    for key in keys:
        values = torch.cat(per_query[key]) if per_query[key] else torch.zeros(0, dtype=torch.float64)
        metrics[key] = float(values.mean()) if len(values) else float("nan")
    metrics.update(num_samples=n, num_queries=int((positives > 0).sum()),
                   num_classes=int(len(classes.unique())) if n else 0)
    if not leave_one_out:
        metrics.update(num_gallery=len(reference), num_gallery_classes=int(len(reference_classes.unique())))
    return metrics


__all__ = ["METRICS", "RECALL_KS", "retrieval_metrics"]
