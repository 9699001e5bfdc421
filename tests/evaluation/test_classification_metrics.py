"""The classification metrics equal scikit-learn's on the same predictions."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import confusion_matrix, precision_recall_fscore_support, top_k_accuracy_score

from vembed.evaluation.classification import classification_metrics, plot_confusion_matrix

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
