"""PNG plots of a run: accuracy@k against Matryoshka dimension, and the training loss curve.

matplotlib is imported inside each function so importing vembed stays light. Figures are built with the object API
and drawn by the Agg canvas: no display needed, and pyplot's global backend and figure list are left alone.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

_DIM_KEY = re.compile(r"^(q2d|d2q)/dim(\d+)/accuracy@(\d+)$")
_DIRECTION_NAMES = {"q2d": "query → document", "d2q": "document → query"}


def _figure(ncols: int, figsize: tuple[float, float], **kwargs):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig, fig.subplots(1, ncols, squeeze=False, **kwargs)[0]


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def plot_accuracy_vs_dim(
    metrics: Mapping[str, float], path: str | Path, *, full_dim: int | None = None
) -> Path | None:
    """Plot accuracy@k against the Matryoshka dimension, one panel per direction, from `evaluate_retrieval` metrics.

    Reads the `{q2d,d2q}/dim{d}/accuracy@{k}` keys; with `full_dim`, the un-truncated `{q2d,d2q}/accuracy@{k}` values
    are drawn at that dimension too. Returns the PNG path, or None when the metrics have no per-dimension accuracy.
    """
    series: dict[str, dict[int, dict[int, float]]] = {}  # direction -> k -> dim -> accuracy
    for key, value in metrics.items():
        match = _DIM_KEY.match(key)
        if match:
            direction, dim, k = match.group(1), int(match.group(2)), int(match.group(3))
            series.setdefault(direction, {}).setdefault(k, {})[dim] = float(value)
    if not series:
        return None
    if full_dim is not None:
        for direction, by_k in series.items():
            for k, by_dim in by_k.items():
                full = metrics.get(f"{direction}/accuracy@{k}")
                if full is not None:
                    by_dim.setdefault(full_dim, float(full))

    directions = [d for d in ("q2d", "d2q") if d in series]
    fig, axes = _figure(len(directions), (5 * len(directions), 4), sharey=True)
    for ax, direction in zip(axes, directions):
        for k, by_dim in sorted(series[direction].items()):
            dims = sorted(by_dim)
            ax.plot(dims, [by_dim[d] for d in dims], marker="o", label=f"accuracy@{k}")
        ax.set_xscale("log", base=2)
        all_dims = sorted({d for by_dim in series[direction].values() for d in by_dim})
        ax.set_xticks(all_dims, [str(d) for d in all_dims])
        ax.minorticks_off()
        ax.set_xlabel("embedding dimension")
        ax.set_title(_DIRECTION_NAMES[direction])
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("accuracy (a relevant document in the top k)")
    return _save(fig, path)


def plot_loss_curve(
    history: Sequence[Mapping[str, Any]],
    path: str | Path,
    eval_history: Sequence[Mapping[str, Any]] | None = None,
    *,
    eval_metric: str | None = None,
) -> Path | None:
    """Plot training loss against step; with `lr` in the history, the learning rate on a second axis.

    `history` holds `{"step": int, "loss": float[, "lr": float]}` dicts. `eval_history` holds `{"step": int, <metric>:
    float, ...}` dicts (for example `evaluate_retrieval` results with their step); `eval_metric` (default: the first
    of `q2d/accuracy@1`, `eval_loss`, `loss` present) is drawn in a panel of its own. Returns the PNG path, or None when
    there is no loss to plot.
    """
    points = [(int(h["step"]), float(h["loss"])) for h in history if "step" in h and h.get("loss") is not None]
    if not points:
        return None
    evals: list[tuple[int, float]] = []
    if eval_history:
        if eval_metric is None:
            present = {key for entry in eval_history for key in entry}
            eval_metric = next((m for m in ("q2d/accuracy@1", "eval_loss", "loss") if m in present), None)
        if eval_metric is not None:
            evals = [
                (int(e["step"]), float(e[eval_metric]))
                for e in eval_history
                if "step" in e and e.get(eval_metric) is not None
            ]

    fig, axes = _figure(2 if evals else 1, (11 if evals else 6, 4))
    ax = axes[0]
    ax.plot([s for s, _ in points], [v for _, v in points], color="tab:blue")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    lrs = [(int(h["step"]), float(h["lr"])) for h in history if "step" in h and h.get("lr") is not None]
    if lrs:
        lr_ax = ax.twinx()
        lr_ax.plot([s for s, _ in lrs], [v for _, v in lrs], color="tab:gray", linestyle="--")
        lr_ax.set_ylabel("learning rate (dashed)")
        lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    ax.set_title("training loss")
    if evals:
        ax_eval = axes[1]
        ax_eval.plot([s for s, _ in evals], [v for _, v in evals], marker="o", color="tab:orange")
        ax_eval.set_xlabel("step")
        ax_eval.set_ylabel(eval_metric)
        ax_eval.set_title(f"validation {eval_metric}")
        ax_eval.grid(alpha=0.3)
    return _save(fig, path)
