"""Classification metrics from class scores: top-1/top-k accuracy, the confusion matrix, per-class precision, recall and
F1 with their macro and micro averages, and the most-confused class pairs (as scikit-learn defines them, with 0 where a
ratio has no denominator; tests/classification/test_classification_metrics.py checks them against it); and calibration,
from the softmax of the scores: the negative log-likelihood (scikit-learn's log_loss) and the expected calibration error
over equal-width confidence bins (torchmetrics' L1 `multiclass_calibration_error`), with the bins a reliability diagram
draws."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

MOST_CONFUSED = 10  # class pairs reported
CALIBRATION_BINS = 15  # equal-width confidence bins of the ECE (the usual choice since Guo et al. 2017)


def confusion_matrix(labels: np.ndarray, predictions: np.ndarray, num_classes: int) -> np.ndarray:
    """counts[true, predicted] over classes 0..num_classes-1."""
    counts = np.zeros((num_classes, num_classes), dtype=np.int64)
    np.add.at(counts, (labels, predictions), 1)
    return counts


def top_k_accuracy(scores: np.ndarray, labels: np.ndarray, k: int) -> float:
    """Share of rows whose label is among the k highest scores."""
    top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return float((top == labels[:, None]).any(axis=1).mean()) if len(labels) else 0.0


def _ratio(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    numerator, denominator = np.asarray(numerator, dtype=np.float64), np.asarray(denominator, dtype=np.float64)
    return np.divide(numerator, denominator, out=np.zeros_like(numerator), where=denominator > 0)


def classification_metrics(scores: np.ndarray, labels: np.ndarray, names: list[str],
                           top_k: int = 5) -> dict[str, Any]:
    """Every metric of `scores` (n, C) against `labels` (n,) ids; `names`: the C class names."""
    scores, labels = np.asarray(scores, dtype=np.float64), np.asarray(labels, dtype=np.int64)
    num_classes = len(names)
    predictions = scores.argmax(axis=1)
    counts = confusion_matrix(labels, predictions, num_classes)
    tp = np.diag(counts)
    predicted, actual = counts.sum(axis=0), counts.sum(axis=1)
    precision, recall = _ratio(tp, predicted), _ratio(tp, actual)
    f1 = _ratio(2 * tp, predicted + actual)  # = 2PR/(P+R), 0 where a class is never predicted nor present
    k = min(top_k, num_classes)
    metrics: dict[str, Any] = {
        "accuracy": float((predictions == labels).mean()) if len(labels) else 0.0,
        "top5_accuracy": top_k_accuracy(scores, labels, k),  # top-k with k = min(5, classes)
        "macro_precision": float(precision.mean()), "macro_recall": float(recall.mean()),
        "macro_f1": float(f1.mean()),
        "micro_precision": float(_ratio(tp.sum(), predicted.sum())),
        "micro_recall": float(_ratio(tp.sum(), actual.sum())),
        "micro_f1": float(_ratio(2 * tp.sum(), predicted.sum() + actual.sum())),
        "num_samples": int(len(labels)),
    }
    metrics.update(calibration_metrics(scores, labels))
    metrics["per_class"] = {name: {"precision": float(precision[i]), "recall": float(recall[i]),
                                   "f1": float(f1[i]), "support": int(actual[i])} for i, name in enumerate(names)}
    metrics["confusion_matrix"] = {"labels": list(names), "counts": counts.tolist()}
    metrics["most_confused"] = most_confused(counts, names)
    return metrics


def softmax(scores: np.ndarray) -> np.ndarray:
    shifted = scores - scores.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=1, keepdims=True)


def calibration_metrics(scores: np.ndarray, labels: np.ndarray, bins: int = CALIBRATION_BINS) -> dict[str, Any]:
    """`nll`: mean -log p(true class); `ece`: sum over confidence bins of |accuracy - mean confidence| weighted by
    the bin's share of samples (confidence: the top class's probability; bins (lower, upper]); `calibration`: each
    bin's edges, count, accuracy and mean confidence (empty bins too, for the diagram)."""
    if not len(labels):
        return {"nll": float("nan"), "ece": float("nan"), "calibration": []}
    probabilities = softmax(scores)
    true = probabilities[np.arange(len(labels)), labels]
    nll = float(-np.log(np.clip(true, np.finfo(np.float64).tiny, None)).mean())
    confidence, correct = probabilities.max(axis=1), probabilities.argmax(axis=1) == labels
    edges = np.linspace(0.0, 1.0, bins + 1)
    which = np.clip(np.searchsorted(edges, confidence, side="left") - 1, 0, bins - 1)  # (lower, upper]
    table, ece = [], 0.0
    for b in range(bins):
        inside = which == b
        count = int(inside.sum())
        accuracy = float(correct[inside].mean()) if count else 0.0
        mean_confidence = float(confidence[inside].mean()) if count else 0.0
        ece += count / len(labels) * abs(accuracy - mean_confidence)
        table.append({"lower": float(edges[b]), "upper": float(edges[b + 1]), "count": count, "accuracy": accuracy,
                      "confidence": mean_confidence})
    return {"nll": nll, "ece": float(ece), "calibration": table}


def plot_reliability(calibration: list[dict[str, Any]], path: str | Path, title: str = "") -> Path | None:
    """A PNG reliability diagram: each confidence bin's accuracy against the diagonal of perfect calibration, with
    the share of samples per bin below."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from vembed.evaluation.plots import _save

    if not calibration or not sum(b["count"] for b in calibration):
        return None
    fig = Figure(figsize=(5, 6.5))
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, gridspec_kw={"height_ratios": (3, 1)})
    centres = [(b["lower"] + b["upper"]) / 2 for b in calibration]
    width = calibration[0]["upper"] - calibration[0]["lower"]
    top.bar(centres, [b["accuracy"] for b in calibration], width=width, edgecolor="black", label="accuracy")
    top.plot([0, 1], [0, 1], linestyle="--", color="grey", label="perfectly calibrated")
    top.set_xlim(0, 1)
    top.set_ylim(0, 1)
    top.set_ylabel("accuracy")
    top.legend(loc="upper left")
    top.set_title(title or "reliability")
    total = sum(b["count"] for b in calibration)
    bottom.bar(centres, [b["count"] / total for b in calibration], width=width, color="grey")
    bottom.set_xlim(0, 1)
    bottom.set_xlabel("confidence (top class's probability)")
    bottom.set_ylabel("share")
    return _save(fig, path)


def most_confused(counts: np.ndarray, names: list[str], limit: int = MOST_CONFUSED) -> list[dict[str, Any]]:
    """The off-diagonal cells with the most samples: (true class, predicted class, count), largest first."""
    off = counts.copy()
    np.fill_diagonal(off, 0)
    rows, cols = np.nonzero(off)
    order = sorted(zip(rows.tolist(), cols.tolist()), key=lambda rc: (-off[rc], rc))[:limit]
    return [{"true": names[r], "predicted": names[c], "count": int(off[r, c])} for r, c in order]


def plot_confusion_matrix(confusion: dict[str, Any], path: str | Path, title: str = "") -> Path | None:
    """A PNG of the confusion matrix (rows: true class, columns: predicted), counts written in the cells when few."""
    from vembed.evaluation.plots import _figure, _save

    counts, names = np.asarray(confusion["counts"]), confusion["labels"]
    if counts.size == 0:
        return None
    side = min(4 + 0.35 * len(names), 30)
    fig, (ax,) = _figure(1, (side, side))
    image = ax.imshow(counts, cmap="Blues")
    fig.colorbar(image, ax=ax, fraction=0.046)
    ticks = range(len(names))
    ax.set_xticks(ticks, names, rotation=90, fontsize=8)
    ax.set_yticks(ticks, names, fontsize=8)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    if len(names) <= 20:
        limit = counts.max() / 2 if counts.max() else 1
        for (r, c), value in np.ndenumerate(counts):
            ax.text(c, r, str(value), ha="center", va="center", fontsize=7,
                    color="white" if value > limit else "black")
    ax.set_title(title or "confusion matrix")
    return _save(fig, path)
