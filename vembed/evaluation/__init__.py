"""Evaluation of embedding models: retrieval metrics both ways, zero-shot classification, plots of a run."""

from vembed.evaluation.pairs import (
    GroupRelevance,
    encode_sides,
    evaluate_retrieval,
    retrieval_metrics,
    zero_shot_accuracy,
)

__all__ = ["GroupRelevance", "encode_sides", "evaluate_retrieval", "retrieval_metrics", "zero_shot_accuracy"]
