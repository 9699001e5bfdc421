"""The strategy benchmark (`vembed bench strategies`): which launches a machine offers, a launch's result row read
from its metrics.json, and the table and plot of the rows. vembed/entrypoints/bench_strategies.py starts the launches.
"""

from __future__ import annotations

import importlib.util
import json
import re
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vembed.recipe import Recipe


@dataclass
class Launch:
    name: str
    config: str  # file under accelerate_configs/
    processes: int
    overrides: list[str] = field(default_factory=list)


def available_launches(gpus: int, batch_size: int, chunk: int | None, gradient_cache: bool = True) -> list[Launch]:
    """What this machine can run: multi-process launches need 2+ GPUs, or run 2 CPU processes when there is none.
    `gradient_cache`: whether the recipe can run under GradCache (`gradient_cache_runs`); DDP + GradCache only then."""
    processes = gpus if gpus > 1 else 2 if gpus == 0 else 1
    ddp = "ddp.yaml" if gpus > 1 else "ddp_cpu.yaml"
    gradcache = ["use_gradient_cache=true", f"gradient_cache_chunk_size={chunk or max(batch_size // 4, 1)}"]
    launches = [Launch("single", "single.yaml", 1)]
    if processes > 1:
        same_batch = f"single-batch-x{processes}"  # the global batch of the multi-process launches, in one
        launches += [Launch(same_batch, "single.yaml", 1, [f"batch_size={batch_size * processes}"]),
                     Launch("ddp", ddp, processes)]
        if gradient_cache:
            launches.append(Launch("ddp+gradcache", ddp, processes, gradcache))
        launches.append(Launch("fsdp", "fsdp.yaml", processes))
        if importlib.util.find_spec("deepspeed") is not None:
            launches += [Launch("zero2", "deepspeed_zero2.yaml", processes),
                         Launch("zero3", "deepspeed_zero3.yaml", processes),
                         Launch("zero3-offload", "deepspeed_zero3_offload.yaml", processes)]
    return launches


def gradient_cache_runs(recipe: "Recipe") -> bool:
    """Whether a DDP launch of `recipe` may turn GradCache on: asked of `planning.choose_gradient_cache`, the rule's one
    home (a task without a batch-wide loss, classification and metric learning among them, or a loss that refuses it:
    no)."""
    from vembed.errors import RecipeError
    from vembed.planning import choose_gradient_cache

    try:
        return choose_gradient_cache(recipe.model_copy(update={"use_gradient_cache": True}), "ddp").enabled
    except RecipeError:
        return False


def result_row(launch: Launch, wall_seconds: float, returncode: int, stderr: str, run_dir: Path) -> dict[str, Any]:
    """One row of the table: the launch, its wall time and, when it succeeded, steady-state samples/s (the median of
    the logged windows after the first, which holds start-up) and the seconds per optimizer step they make, peak
    memory per process as logged by rank 0, the final loss and, when the recipe has a validation split, the final
    value of its metric_for_best_model (accuracy, MAP@R, ...), from `run_dir/metrics.json`; when it failed, the last
    error line of its stderr."""
    row = {**asdict(launch), "wall_s": round(wall_seconds, 1), "ok": returncode == 0}
    if returncode != 0:
        # The exception's own line ("[rank0]: RuntimeError: ..."), not the launcher's ChildFailedError summary.
        raised = [line for line in stderr.splitlines() if re.search(r"\w(Error|Exception): \S", line)]
        ranks = [line for line in raised if line.startswith("[rank")]
        lines = ranks or raised or [line for line in stderr.splitlines() if "error" in line.lower()]
        last = lines[-1:] or stderr.strip().splitlines()[-1:] or ["failed"]
        row["error"] = last[0].strip()[:300]
        return row
    metrics = json.loads((run_dir / "metrics.json").read_text())
    history = metrics.get("loss_history", [])
    steady = history[1:] or history  # the first window holds start-up and warm-up
    row["samples_per_second"] = statistics.median(r["samples_per_second"] for r in steady) if steady else None
    train = metrics["train"]
    per_step = train["samples_seen"] / max(train["steps"], 1)  # the global batch, accumulation included
    row["step_s"] = per_step / row["samples_per_second"] if row["samples_per_second"] else None
    peaks = [r["peak_memory_mb"] for r in history if r.get("peak_memory_mb") is not None]
    row["peak_memory_mb"] = max(peaks) if peaks else None
    row["final_loss"] = train["final_loss"]
    metric = metrics.get("best", {}).get("metric")
    if metric and metric in (metrics.get("validation") or {}):
        row["metric"], row["metric_value"] = metric, metrics["validation"][metric]
    return row


def format_table(rows: list[dict]) -> str:
    """A Markdown table of the rows; the validation metric's column only when some launch measured one."""
    metric = next((row["metric"] for row in rows if row.get("metric")), None)
    extra = [f"final {metric}"] if metric else []
    header = ["launch", "processes", "samples/s", "step (s)", "peak memory / process (MiB)", "final loss", *extra,
              "wall (s)"]
    lines = ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * (len(header) - 1)]
    for row in rows:
        if not row["ok"]:
            failed = f"failed: {row.get('error', '')}"
            lines.append(f"| {row['name']} | {row['processes']} | {failed} |" + " |" * (len(header) - 4)
                         + f" {row['wall_s']} |")
            continue

        def number(key: str, fmt: str) -> str:
            return format(row[key], fmt) if row.get(key) is not None else "-"

        cells = [row["name"], row["processes"], number("samples_per_second", ".0f"), number("step_s", ".3f"),
                 number("peak_memory_mb", ".0f"), number("final_loss", ".4f"),
                 *([number("metric_value", ".4f")] if metric else []), row["wall_s"]]
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Bars of step time, peak memory, final loss and (when measured) the final validation metric per successful
    launch, as a PNG. Drawn with matplotlib's object
    API (as vembed.evaluation.plots), so pyplot's global backend and figure list are left alone."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ok = [r for r in rows if r["ok"]]
    panels = [("step_s", "seconds per optimizer step"), ("peak_memory_mb", "peak memory per process (MiB)"),
              ("final_loss", "final loss")]
    metric = next((r["metric"] for r in ok if r.get("metric")), None)
    if metric:
        panels.append(("metric_value", f"final validation {metric}"))
    fig = Figure(figsize=(4.4 * len(panels), 3.8))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels))
    for axis, (key, title) in zip(axes, panels):
        values = [r.get(key) or 0 for r in ok]
        bars = axis.bar([r["name"] for r in ok], values, color="tab:blue")
        axis.bar_label(bars, labels=[f"{v:.4g}" for v in values], fontsize=8)
        axis.set_title(title)
        for label in axis.get_xticklabels():
            label.set_rotation(30)
            label.set_horizontalalignment("right")
        axis.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
