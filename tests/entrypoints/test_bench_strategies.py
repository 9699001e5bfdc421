"""`vembed bench strategies`: which launches a machine offers, and a real (short) run that writes table and plot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from vembed.strategy_bench import available_launches, format_table

ROOT = Path(__file__).resolve().parents[2]


def test_launches_offered_per_machine(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "deepspeed" else real(name))
    cpu = {launch.name: launch for launch in available_launches(0, batch_size=16, chunk=None)}
    assert list(cpu) == ["single", "single-batch-x2", "ddp", "ddp+gradcache", "fsdp", "zero2", "zero3"]
    assert cpu["single-batch-x2"].overrides == ["batch_size=32"] and cpu["single-batch-x2"].processes == 1
    assert cpu["ddp"].config == "ddp_cpu.yaml" and cpu["ddp"].processes == 2
    assert "gradient_cache_chunk_size=4" in cpu["ddp+gradcache"].overrides
    gpus = {launch.name: launch for launch in available_launches(8, batch_size=16, chunk=2)}
    assert gpus["ddp"].config == "ddp.yaml" and gpus["fsdp"].processes == 8
    assert gpus["single-batch-x8"].overrides == ["batch_size=128"]
    assert [launch.name for launch in available_launches(1, 16, None)] == ["single"]


def test_table_reports_failures_in_place():
    rows = [{"name": "single", "processes": 1, "ok": True, "samples_per_second": 512.4, "peak_memory_mb": 300.0,
             "final_loss": 1.23456, "wall_s": 10.0},
            {"name": "zero3", "processes": 2, "ok": False, "error": "launch error: boom", "wall_s": 3.0}]
    table = format_table(rows)
    assert "| single | 1 | 512 | 300 | 1.2346 | 10.0 |" in table
    assert "failed: launch error: boom" in table


def test_a_single_launch_runs_and_writes_table_json_and_plot(tiny_clip_recipe, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(dict(tiny_clip_recipe, batch_size=8)))
    out = tmp_path / "bench"
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    result = subprocess.run([sys.executable, "-m", "vembed", "bench", "strategies", str(recipe), "--steps", "3",
                             "--only", "single", "--out", str(out)], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads((out / "strategies.json").read_text())
    assert [row["name"] for row in rows] == ["single"] and rows[0]["ok"]
    assert rows[0]["samples_per_second"] > 0 and rows[0]["final_loss"] > 0
    assert (out / "strategies.png").stat().st_size > 0 and "| single | 1 |" in (out / "strategies.md").read_text()


def test_an_unavailable_launch_is_one_line(tiny_clip_recipe, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tiny_clip_recipe))
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    result = subprocess.run([sys.executable, "-m", "vembed", "bench", "strategies", str(recipe), "--only", "zero9"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "zero9 cannot run here" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
