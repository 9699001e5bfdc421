"""The image-retrieval metrics equal pytorch-metric-learning's AccuracyCalculator on the same embeddings."""

from __future__ import annotations

import numpy as np
import pytest

from vembed.classification.metric_evaluation import retrieval_metrics

pytest.importorskip("pytorch_metric_learning")


def _reference(embeddings: np.ndarray, labels: np.ndarray) -> dict:
    import torch
    from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator

    calculator = AccuracyCalculator(include=("precision_at_1", "r_precision", "mean_average_precision_at_r"),
                                    device=torch.device("cpu"))
    return calculator.get_accuracy(embeddings, labels)  # leave-one-out: the reference is the queries


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_metrics_equal_pytorch_metric_learning(seed):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 8, size=150)
    labels[-1] = 99  # a class of one image: no query of it counts, as in PML
    embeddings = (rng.normal(size=(150, 16)) + 1.2 * rng.normal(size=(100, 16))[labels % 100]).astype(np.float32)
    ours, theirs = retrieval_metrics(embeddings, labels), _reference(embeddings, labels)
    for key in ("precision_at_1", "r_precision", "mean_average_precision_at_r"):
        assert ours[key] == theirs[key], key  # exact: the same sums in the same order
    assert 0.1 < ours["mean_average_precision_at_r"] < 0.9  # neither chance nor solved: the ranks matter
    assert ours["num_queries"] == 149 and ours["num_samples"] == 150 and ours["num_classes"] == 9


def test_recall_at_k_is_the_share_of_queries_with_a_same_class_image_in_the_k_nearest():
    # 1-D points: the order of neighbours is plain to see.
    points = np.array([[0.0], [1.0], [2.5], [4.0], [10.0], [10.5]])
    labels = np.array([0, 1, 0, 1, 2, 2])
    metrics = retrieval_metrics(points, labels, ks=(1, 2))
    # nearest of each: 1(b) 0(a) 1(b) 2(a) 5(c) 4(c) -> hits for queries 4 and 5 only
    assert metrics["recall_at_1"] == metrics["precision_at_1"] == pytest.approx(2 / 6)
    # two nearest: q0 {1, 2} hit, q1 {0, 2} miss, q2 {1, 3} miss, q3 {2, 1} hit, q4, q5 hit
    assert metrics["recall_at_2"] == pytest.approx(4 / 6)
    # R = 1 for every query: MAP@R is precision@1
    assert metrics["mean_average_precision_at_r"] == pytest.approx(2 / 6)


def test_small_chunks_give_the_same_numbers(monkeypatch):
    import vembed.classification.metric_evaluation as module

    rng = np.random.default_rng(3)
    labels, embeddings = rng.integers(0, 5, size=40), rng.normal(size=(40, 4))
    whole = retrieval_metrics(embeddings, labels)
    monkeypatch.setattr(module, "_CHUNK_CELLS", 7 * 40)  # 7 queries a chunk
    assert retrieval_metrics(embeddings, labels) == whole


@pytest.mark.parametrize("seed", [0, 1])
def test_query_gallery_metrics_equal_pytorch_metric_learning_with_a_separate_reference(seed):
    """The In-Shop protocol: queries searched against a gallery they are not part of (PML's ref_includes_query=False);
    a query whose class the gallery lacks counts in no average, as in PML."""
    import torch
    from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator

    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(12, 16))
    query_labels, gallery_labels = rng.integers(0, 10, size=60), rng.integers(0, 10, size=140)
    query_labels[:3] = 11  # a class only the queries have
    queries = (rng.normal(size=(60, 16)) + 1.2 * centres[query_labels]).astype(np.float32)
    gallery = (rng.normal(size=(140, 16)) + 1.2 * centres[gallery_labels]).astype(np.float32)
    ours = retrieval_metrics(queries, query_labels, reference_embeddings=gallery, reference_labels=gallery_labels)
    calculator = AccuracyCalculator(include=("precision_at_1", "r_precision", "mean_average_precision_at_r"),
                                    device=torch.device("cpu"))
    theirs = calculator.get_accuracy(queries, query_labels, gallery, gallery_labels, ref_includes_query=False)
    for key in ("precision_at_1", "r_precision", "mean_average_precision_at_r"):
        assert ours[key] == pytest.approx(theirs[key], rel=1e-12, abs=1e-12), key
    assert 0.1 < ours["mean_average_precision_at_r"] < 0.9
    assert (ours["num_queries"], ours["num_gallery"], ours["num_gallery_classes"]) == (57, 140, 10)
    loo = retrieval_metrics(queries, query_labels)
    assert loo["precision_at_1"] != ours["precision_at_1"]  # the gallery, not the other queries, is searched
