"""Fusing runs with ranx (`ranx.fuse`): reciprocal rank fusion, weighted sums of normalised scores and the other
unsupervised methods the IR literature compares, so a dense, a late-interaction and a BM25 run become one.

A query missing from some runs is fused from the runs that hold it (an absent list adds nothing, as in ranx when the
query's list is empty); ranx itself refuses runs of different queries.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

from vembed.errors import ArgumentError
from vembed.evaluation.runs import Run

# Our names -> ranx's. Methods that learn from training qrels (probfuse, bayesfuse, ...) are not offered.
METHODS = {"rrf": "rrf", "weighted": "wsum", "sum": "sum", "mnz": "mnz", "max": "max", "min": "min", "med": "med",
           "anz": "anz", "isr": "isr", "bordafuse": "bordafuse", "condorcet": "condorcet"}
NORMS = ("min-max", "max", "sum", "zmuv", "rank", "borda", "none")
RRF_K = 60  # Cormack et al. 2009's k, ranx's default


def fuse_runs(runs: Sequence[Mapping[str, Mapping[str, float]]], method: str = "rrf", *,
              weights: Sequence[float] | None = None, k: int = RRF_K, norm: str = "min-max") -> Run:
    """One run from `runs` by `method` (a key of METHODS); `weights` (one per run) for "weighted"; `k` for "rrf";
    `norm`, how each run's scores are normalised per query before combining ("none": as they are)."""
    from ranx import Run as RanxRun
    from ranx import fuse

    check_fusion_arguments(runs, method, weights, k, norm)
    queries = sorted(set().union(*runs))
    filled = [RanxRun({query: dict(run.get(query, {})) for query in queries}) for run in runs]
    params = {"weights": list(weights)} if method == "weighted" else {"k": k} if method == "rrf" else {}
    with warnings.catch_warnings():  # numba's cast notes from inside ranx: nothing a user can act on
        warnings.simplefilter("ignore")
        fused = fuse(filled, norm=None if norm == "none" else norm, method=METHODS[method], params=params)
    return {query: {doc: float(score) for doc, score in hits.items()} for query, hits in fused.to_dict().items()}


def check_fusion_arguments(runs: Sequence[object], method: str, weights: Sequence[float] | None, k: int,
                           norm: str) -> None:
    """Each bad choice is one line naming its flag, before any run is read."""
    if len(runs) < 2:
        raise ArgumentError("runs", f"fusion needs at least 2 runs, got {len(runs)}")
    if method not in METHODS:
        raise ArgumentError("--method", f"{method!r} is not one of {', '.join(METHODS)}")
    if norm not in NORMS:
        raise ArgumentError("--norm", f"{norm!r} is not one of {', '.join(NORMS)}")
    if method == "weighted":
        if weights is None or len(weights) != len(runs):
            raise ArgumentError("--weights", f"weighted fusion takes one weight per run: {len(runs)} runs, "
                                           f"{0 if weights is None else len(weights)} weights")
        if any(w < 0 for w in weights) or not sum(weights) > 0:
            raise ArgumentError("--weights", f"weights must be >= 0 and not all 0, got {list(weights)}")
    elif weights is not None:
        raise ArgumentError("--weights", f"apply to --method weighted, not to {method}")
    if method == "rrf" and k < 1:
        raise ArgumentError("--rrf-k", f"must be at least 1, got {k}")


__all__ = ["METHODS", "NORMS", "RRF_K", "check_fusion_arguments", "fuse_runs"]
