"""The classification metrics equal scikit-learn's on the same predictions."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import confusion_matrix, precision_recall_fscore_support, top_k_accuracy_score

from vembed.classification.evaluation import classification_metrics, plot_confusion_matrix

NAMES = ["ant", "bee", "cat", "dog", "eel", "fox", "gnu"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_metrics_equal_scikit_learn(seed):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 6, size=200)  # class 6 (gnu) never occurs: it counts as 0 in the macro averages
    scores = rng.normal(size=(200, 7)) + 1.5 * np.eye(7)[labels]  # better than chance, far from perfect
    predictions = scores.argmax(1)
    metrics = classification_metrics(scores, labels, NAMES)
    classes = list(range(7))

    assert metrics["confusion_matrix"]["counts"] == confusion_matrix(labels, predictions, labels=classes).tolist()
    assert metrics["accuracy"] == top_k_accuracy_score(labels, scores, k=1, labels=classes)
    assert metrics["top5_accuracy"] == top_k_accuracy_score(labels, scores, k=5, labels=classes)
    p, r, f, support = precision_recall_fscore_support(labels, predictions, labels=classes, zero_division=0)
    for i, name in enumerate(NAMES):
        assert metrics["per_class"][name] == {"precision": p[i], "recall": r[i], "f1": f[i], "support": support[i]}
    for average in ("macro", "micro"):
        p, r, f, _ = precision_recall_fscore_support(labels, predictions, labels=classes, average=average,
                                                     zero_division=0)
        assert (metrics[f"{average}_precision"], metrics[f"{average}_recall"], metrics[f"{average}_f1"]) == (p, r, f)


def test_most_confused_pairs_are_the_largest_off_diagonal_cells(tmp_path):
    labels = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2])
    predicted = np.array([1, 1, 0, 0, 1, 0, 1, 1, 1])
    metrics = classification_metrics(np.eye(3)[predicted], labels, ["a", "b", "c"])
    assert metrics["most_confused"] == [{"true": "c", "predicted": "b", "count": 3},
                                        {"true": "a", "predicted": "b", "count": 2},
                                        {"true": "b", "predicted": "a", "count": 1},
                                        {"true": "c", "predicted": "a", "count": 1}]
    path = plot_confusion_matrix(metrics["confusion_matrix"], tmp_path / "confusion.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_calibration_equals_scikit_learns_log_loss_and_torchmetrics_ece(seed):
    import torch
    from sklearn.metrics import log_loss

    torchmetrics = pytest.importorskip("torchmetrics.functional.classification")
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 7, size=300)
    logits = 2.5 * rng.normal(size=(300, 7)) + 2.0 * np.eye(7)[labels]  # overconfident: the ECE is not small
    metrics = classification_metrics(logits, labels, NAMES)
    probabilities = np.exp(logits - logits.max(1, keepdims=True))
    probabilities /= probabilities.sum(1, keepdims=True)
    assert metrics["nll"] == pytest.approx(log_loss(labels, probabilities, labels=list(range(7))), rel=1e-12)
    reference = torchmetrics.multiclass_calibration_error(torch.tensor(probabilities), torch.tensor(labels),
                                                          num_classes=7, n_bins=15, norm="l1")
    assert metrics["ece"] == pytest.approx(float(reference), abs=1e-6)  # torchmetrics bins in float32
    assert metrics["ece"] > 0.05
    bins = metrics["calibration"]
    assert len(bins) == 15 and sum(b["count"] for b in bins) == 300
    assert sum(b["count"] * b["accuracy"] for b in bins) == pytest.approx(300 * metrics["accuracy"])


def test_a_confidence_on_a_bin_edge_falls_in_the_lower_bin():
    # Two classes; softmax([0, 0]) is exactly 0.5 (a bin edge with 4 bins: (0.25, 0.5]) and softmax([0, -inf]) exactly
    # 1.0: bins are (lower, upper], as torchmetrics' are. Exact values, so no CPU's rounding moves them.
    from vembed.classification.evaluation import calibration_metrics

    scores = np.array([[0.0, 0.0], [0.0, -np.inf], [0.0, 0.0], [0.0, -np.inf]])
    found = calibration_metrics(scores, np.array([0, 0, 1, 1]), bins=4)
    assert [b["count"] for b in found["calibration"]] == [0, 2, 0, 2]
    assert [b["accuracy"] for b in found["calibration"]] == [0.0, 0.5, 0.0, 0.5]
    assert found["ece"] == pytest.approx(0.5 * abs(0.5 - 0.5) + 0.5 * abs(0.5 - 1.0))
    assert found["nll"] > 100  # a true class given probability 0 is clipped, not an infinite or NaN mean


def test_the_reliability_diagram_is_written(tmp_path):
    from vembed.classification.evaluation import plot_reliability

    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, size=50)
    metrics = classification_metrics(rng.normal(size=(50, 3)) + np.eye(3)[labels], labels, ["a", "b", "c"])
    path = plot_reliability(metrics["calibration"], tmp_path / "reliability.png", title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
    assert plot_reliability([], tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()
