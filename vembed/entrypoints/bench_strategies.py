"""`vembed bench strategies RECIPE --steps N`: the same recipe for N steps under every launch this machine offers.

Single device, DDP, DDP + GradCache, FSDP2, ZeRO-2 and ZeRO-3, each started the way a user starts it (`accelerate
launch` with the shipped config), each in its own output folder. Where there are several processes, one more single
launch runs the same contrastive batch in one process (per-device batch x processes): every row of that group computes
the same thing, so their final losses agree, which the table makes visible. Reported per launch: steady-state
samples/s (the median of the logged windows after the first, which holds start-up), peak memory per process as logged
by rank 0, the final loss, and wall time. Writes strategies.json, strategies.md and strategies.png under `--out`. On
CPU the multi-process launches use 2 processes over gloo; on GPUs one process per GPU over NCCL.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vembed.entrypoints import run_cli
from vembed.resources import accelerate_configs

CONFIGS = accelerate_configs()
TRAIN_SCRIPT = Path(__file__).resolve().parent / "train.py"


@dataclass
class Launch:
    name: str
    config: str  # one of the shipped accelerate configs (vembed/accelerate_configs/)
    processes: int
    overrides: list[str] = field(default_factory=list)


def available_launches(gpus: int, batch_size: int, chunk: int | None) -> list[Launch]:
    """What this machine can run: multi-process launches need 2+ GPUs, or run 2 CPU processes when there is none."""
    processes = gpus if gpus > 1 else 2 if gpus == 0 else 1
    ddp = "ddp.yaml" if gpus > 1 else "ddp_cpu.yaml"
    gradcache = ["use_gradient_cache=true", f"gradient_cache_chunk_size={chunk or max(batch_size // 4, 1)}"]
    launches = [Launch("single", "single.yaml", 1)]
    if processes > 1:
        same_batch = f"single-batch-x{processes}"  # the contrastive batch of the multi-process launches, in one
        launches += [Launch(same_batch, "single.yaml", 1, [f"batch_size={batch_size * processes}"]),
                     Launch("ddp", ddp, processes), Launch("ddp+gradcache", ddp, processes, gradcache),
                     Launch("fsdp", "fsdp.yaml", processes)]
        if importlib.util.find_spec("deepspeed") is not None:
            launches += [Launch("zero2", "deepspeed_zero2.yaml", processes),
                         Launch("zero3", "deepspeed_zero3.yaml", processes)]
    return launches


def run_launch(launch: Launch, recipe: str, steps: int, out: Path, extra: list[str], cpu: bool) -> dict:
    from vembed.entrypoints.launch import _free_port, _with_absolute_deepspeed_file

    run_dir = out / launch.name
    overrides = [f"max_steps={steps}", f"output_dir={run_dir}", "save_steps=null", "eval_before_training=false",
                 f"logging_steps={max(steps // 5, 1)}", "data.validation=null", "data.test=null", "report_to=none",
                 "resume_from=null", *extra, *launch.overrides]
    if cpu:
        overrides.append("mixed_precision=no")
    config = _with_absolute_deepspeed_file(CONFIGS / launch.config)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
               "--num_processes", str(launch.processes)]
    if launch.processes > 1:
        command += ["--main_process_port", str(_free_port())]
    command += [str(TRAIN_SCRIPT), recipe, "--config_override", *overrides]
    env = dict(os.environ, VEMBED_EXPECTED_WORLD_SIZE=str(launch.processes))
    started = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    row = {**asdict(launch), "wall_s": round(wall, 1), "ok": result.returncode == 0}
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if "error" in line.lower()]
        row["error"] = (lines[-1] if lines else result.stderr.strip().splitlines()[-1:] or ["failed"])[0][:300]
        return row
    metrics = json.loads((run_dir / "metrics.json").read_text())
    history = metrics.get("loss_history", [])
    steady = history[1:] or history  # the first window holds start-up and warm-up
    row["samples_per_second"] = statistics.median(r["samples_per_second"] for r in steady) if steady else None
    peaks = [r["peak_memory_mb"] for r in history if r.get("peak_memory_mb") is not None]
    row["peak_memory_mb"] = max(peaks) if peaks else None
    row["final_loss"] = metrics["train"]["final_loss"]
    return row


def format_table(rows: list[dict]) -> str:
    lines = ["| launch | processes | samples/s | peak memory / process (MiB) | final loss | wall (s) |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        if not row["ok"]:
            failed = f"failed: {row.get('error', '')}"
            lines.append(f"| {row['name']} | {row['processes']} | {failed} | | | {row['wall_s']} |")
            continue

        def number(key: str, fmt: str) -> str:
            return format(row[key], fmt) if row.get(key) is not None else "-"

        lines.append(f"| {row['name']} | {row['processes']} | {number('samples_per_second', '.0f')} | "
                     f"{number('peak_memory_mb', '.0f')} | {number('final_loss', '.4f')} | {row['wall_s']} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["ok"]]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for axis, key, title in zip(axes, ("samples_per_second", "peak_memory_mb", "final_loss"),
                                ("samples/s", "peak memory per process (MiB)", "final loss")):
        values = [r.get(key) or 0 for r in ok]
        bars = axis.bar([r["name"] for r in ok], values, color="tab:blue")
        axis.bar_label(bars, labels=[f"{v:.4g}" for v in values], fontsize=8)
        axis.set_title(title)
        plt.setp(axis.get_xticklabels(), rotation=30, ha="right")
        axis.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe YAML to run under every launch")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per launch")
    parser.add_argument("--out", default="runs/bench_strategies", help="folder for the runs, table and plot")
    parser.add_argument("--only",
                        help="comma-separated subset: single,single-batch-x2,ddp,ddp+gradcache,fsdp,zero2,zero3")
    parser.add_argument("--config_override", "--config-override", nargs="*", default=[], metavar="KEY=VALUE",
                        help="recipe overrides applied to every launch")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")


def run(args: argparse.Namespace) -> int:
    def body() -> int:
        import torch
        from tqdm.auto import tqdm

        from vembed.errors import RecipeError
        from vembed.recipe import check_recipe, load_recipe

        recipe = load_recipe(args.recipe, args.config_override)
        check_recipe(recipe)
        gpus = torch.cuda.device_count()
        launches = available_launches(gpus, recipe.batch_size, recipe.gradient_cache_chunk_size)
        if args.only:
            wanted = [name.strip() for name in args.only.split(",")]
            unknown = sorted(set(wanted) - {launch.name for launch in launches})
            if unknown:
                names = ", ".join(launch.name for launch in launches)
                raise RecipeError("--only", f"{', '.join(unknown)} cannot run here; this machine offers: {names}")
            launches = [launch for launch in launches if launch.name in wanted]
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        recipe_path = str(Path(args.recipe).resolve())
        rows = []
        with tempfile.TemporaryDirectory(dir=out) as scratch:
            for launch in tqdm(launches, desc="launches", unit="launch"):
                rows.append(run_launch(launch, recipe_path, args.steps, Path(scratch), args.config_override,
                                       cpu=gpus == 0))
        table = format_table(rows)
        (out / "strategies.json").write_text(json.dumps(rows, indent=2))
        (out / "strategies.md").write_text(table + "\n")
        plot(rows, out / "strategies.png")
        print(table)
        print(f"written: {out / 'strategies.md'}, {out / 'strategies.png'}")
        return 0 if all(row["ok"] for row in rows) else 1

    return run_cli(body, args.debug)
