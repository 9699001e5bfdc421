"""The names of a reranker's evaluation metrics (`rerank_run`'s `first_stage/<metric>` and `reranked/<metric>`) and
their before/after rows: what the CLI's table and the model card show (one home, below both)."""

from __future__ import annotations

from collections.abc import Mapping

METRIC_ORDER = ("ndcg", "mrr", "recall", "map")  # the table's rows: the headline metrics first
STAGES = ("first_stage", "reranked")  # the prefixes of rerank_run's metric names


def is_rerank_metrics(metrics: Mapping[str, float]) -> bool:
    """Whether `metrics` are `rerank_run`'s (every name a stage's), not an embedder's."""
    return bool(metrics) and all(name.split("/", 1)[0] in STAGES for name in metrics)


def before_after(metrics: Mapping[str, float]) -> list[tuple[str, float, float]]:
    """(metric, first stage, reranked) per cut-off metric of `rerank_run`'s output, headline metrics first: the rows
    of the CLI's table and of the model card's."""
    names = [key[len("first_stage/"):] for key in metrics if key.startswith("first_stage/") and "@" in key
             and f"reranked/{key[len('first_stage/'):]}" in metrics]
    names.sort(key=lambda name: (METRIC_ORDER.index(name.split("@")[0]), int(name.split("@")[1])))
    return [(name, metrics[f"first_stage/{name}"], metrics[f"reranked/{name}"]) for name in names]
