"""`vembed bench strategies RECIPE --steps N`: the same recipe for N steps under every launch this machine offers.

Single device, DDP, DDP + GradCache, FSDP2, ZeRO-2, ZeRO-3 and ZeRO-3 with CPU offload, each started the way a user
starts it (`accelerate launch` with the shipped config), each in its own output folder. Where there are several
processes, one more single launch runs the same global batch in one process (per-device batch x processes): every
row of that group computes the same thing, so their final losses agree, which the table makes visible. Reported per
launch: steady-state samples/s (the median of the logged windows after the first, which holds start-up) and seconds
per optimizer step, peak memory per process as logged by rank 0, the final loss, wall time and, when the recipe has a
validation split (evaluated once, after the last step), its metric_for_best_model: accuracy for classification, MAP@R
for metric learning. Writes strategies.json, strategies.md and strategies.png under `--out`. On CPU the
multi-process launches use 2 processes over gloo; on GPUs one process per GPU over NCCL. The launches offered, the
result rows, table and plot are vembed.strategy_bench; this module starts the launches.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vembed.entrypoints import run_cli
from vembed.resources import accelerate_configs
from vembed.strategy_bench import Launch, available_launches, format_table, gradient_cache_runs, plot, result_row

CONFIGS = accelerate_configs()
TRAIN_SCRIPT = Path(__file__).resolve().parent / "train.py"


def run_launch(launch: Launch, recipe: str, steps: int, out: Path, extra: list[str], cpu: bool) -> dict:
    from vembed.entrypoints.launch import _free_port, _with_absolute_deepspeed_file

    run_dir = out / launch.name
    overrides = [f"max_steps={steps}", f"output_dir={run_dir}", "save_steps=null", "eval_before_training=false",
                 f"logging_steps={max(steps // 5, 1)}", "eval_steps=null", "data.test=null", "report_to=none",
                 "resume_from=null", *extra, *launch.overrides]
    if cpu:
        overrides.append("mixed_precision=no")
    config = _with_absolute_deepspeed_file(CONFIGS / launch.config, out)  # out: the scratch folder, removed after
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
               "--num_processes", str(launch.processes)]
    if launch.processes > 1:
        command += ["--main_process_port", str(_free_port())]
    command += [str(TRAIN_SCRIPT), recipe, "--config_override", *overrides]
    env = dict(os.environ, VEMBED_EXPECTED_WORLD_SIZE=str(launch.processes))
    started = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    return result_row(launch, time.perf_counter() - started, result.returncode, result.stderr, run_dir)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe YAML to run under every launch")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per launch")
    parser.add_argument("--out", default="runs/bench_strategies", help="folder for the runs, table and plot")
    parser.add_argument("--only",
                        help="comma-separated subset: single,single-batch-x2,ddp,ddp+gradcache,fsdp,zero2,zero3,"
                             "zero3-offload")
    parser.add_argument("--config-override", "--config_override", nargs="*", default=[], metavar="KEY=VALUE",
                        help="recipe overrides applied to every launch")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")


def run(args: argparse.Namespace) -> int:
    def body() -> int:
        import torch
        from tqdm.auto import tqdm

        from vembed.components import load_recipe
        from vembed.errors import RecipeError
        from vembed.recipe_checks import check_recipe

        if args.steps < 1:
            raise RecipeError("--steps", f"must be at least 1, got {args.steps}")
        recipe = load_recipe(args.recipe, args.config_override)
        check_recipe(recipe)
        gpus = torch.cuda.device_count()
        launches = available_launches(gpus, recipe.batch_size, recipe.gradient_cache_chunk_size,
                                      gradient_cache_runs(recipe))
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
