"""`vembed bench strategies`: which launches a machine offers, and a real (short) run that writes table and plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from vembed.strategy_bench import available_launches, format_table

ROOT = Path(__file__).resolve().parents[2]


def test_launches_offered_per_machine(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "deepspeed" else real(name))
    cpu = {launch.name: launch for launch in available_launches(0, batch_size=16, chunk=None)}
    assert list(cpu) == ["single", "single-batch-x2", "ddp", "ddp+gradcache", "fsdp", "zero2", "zero3",
                         "zero3-offload"]
    assert cpu["zero3-offload"].config == "deepspeed_zero3_offload.yaml"
    assert cpu["single-batch-x2"].overrides == ["batch_size=32"] and cpu["single-batch-x2"].processes == 1
    assert cpu["ddp"].config == "ddp_cpu.yaml" and cpu["ddp"].processes == 2
    assert "gradient_cache_chunk_size=4" in cpu["ddp+gradcache"].overrides
    gpus = {launch.name: launch for launch in available_launches(8, batch_size=16, chunk=2)}
    assert gpus["ddp"].config == "ddp.yaml" and gpus["fsdp"].processes == 8
    assert gpus["single-batch-x8"].overrides == ["batch_size=128"]
    assert [launch.name for launch in available_launches(1, 16, None)] == ["single"]
    # a recipe that cannot run under GradCache (classification, metric learning) is not offered DDP + GradCache
    assert "ddp+gradcache" not in {launch.name for launch in available_launches(0, 16, None, gradient_cache=False)}


def test_gradient_cache_is_offered_only_where_the_recipe_can_run_under_it(tiny_clip_recipe, tmp_path):
    from vembed.components import recipe_from_dict
    from vembed.strategy_bench import gradient_cache_runs

    assert gradient_cache_runs(recipe_from_dict(tiny_clip_recipe))
    assert not gradient_cache_runs(recipe_from_dict(vit_recipe(tmp_path, tmp_path / "run")))


def test_a_failed_launch_keeps_its_last_error_line(tmp_path):
    from vembed.strategy_bench import Launch, result_row

    stderr = ("loading\n  RuntimeError: first\nwarming up\n[rank0]: ValueError: FSDP cannot wrap this\n"
              "  error_file: <N/A>\n  traceback : To enable traceback see: .../elastic/errors.html\n"
              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n")
    row = result_row(Launch("fsdp", "fsdp.yaml", 2), 3.0, 1, stderr, tmp_path)
    assert not row["ok"] and row["error"] == "[rank0]: ValueError: FSDP cannot wrap this"
    assert result_row(Launch("x", "x.yaml", 1), 1.0, 1, "a\nerror: bad key\nb\n", tmp_path)["error"] == "error: bad key"
    assert result_row(Launch("fsdp", "fsdp.yaml", 2), 3.0, 1, "killed\n", tmp_path)["error"] == "killed"


def test_table_reports_failures_in_place():
    rows = [{"name": "single", "processes": 1, "ok": True, "samples_per_second": 512.4, "peak_memory_mb": 300.0,
             "final_loss": 1.23456, "wall_s": 10.0},
            {"name": "zero3", "processes": 2, "ok": False, "error": "launch error: boom", "wall_s": 3.0}]
    table = format_table(rows)
    assert "| single | 1 | 512 | - | 300 | 1.2346 | 10.0 |" in table
    assert "| zero3 | 2 | failed: launch error: boom | | | | 3.0 |" in table
    rows[0].update(step_s=0.0625, metric="accuracy", metric_value=0.875)
    table = format_table(rows).splitlines()
    assert table[0].endswith("| final loss | final accuracy | wall (s) |")
    assert table[2] == "| single | 1 | 512 | 0.062 | 300 | 1.2346 | 0.8750 | 10.0 |"
    assert table[3] == "| zero3 | 2 | failed: launch error: boom | | | | | 3.0 |"


def _bench(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    """`vembed bench strategies ARGS` in this process (its launches are processes of their own): its exit code and
    stderr. A fresh interpreter for the command would add seconds of imports to each test."""
    from vembed.cli import main

    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the launches import this clone's vembed
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    capsys.readouterr()
    code = main(["bench", "strategies", *args])
    return code, capsys.readouterr().err


def test_a_single_launch_runs_and_writes_table_json_and_plot(tiny_clip_recipe, tmp_path, monkeypatch, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(dict(tiny_clip_recipe, batch_size=8)))
    out = tmp_path / "bench"
    code, err = _bench(monkeypatch, capsys, str(recipe), "--steps", "3", "--only", "single", "--out", str(out))
    assert code == 0, err[-2000:]
    rows = json.loads((out / "strategies.json").read_text())
    assert [row["name"] for row in rows] == ["single"] and rows[0]["ok"]
    assert rows[0]["samples_per_second"] > 0 and rows[0]["final_loss"] > 0
    assert (out / "strategies.png").stat().st_size > 0 and "| single | 1 |" in (out / "strategies.md").read_text()


def vit_recipe(root: Path, output_dir: Path) -> dict:
    """A tiny ViT classifying 3 digits (12 training and 6 validation images of each, as ImageFolder trees)."""
    from training_digits import VIT, write_digits

    if not (root / "train").is_dir():
        write_digits(root / "train")
        write_digits(root / "validation", per_class=6, offset=40)
    return {"model_type": "vision", "model_config": VIT, "loss_type": "cross_entropy",
            "data": {"train": str(root / "train"), "validation": str(root / "validation")},
            "metric_for_best_model": "accuracy", "output_dir": str(output_dir), "batch_size": 6, "seed": 0}


def test_a_classification_launch_reports_step_time_and_final_accuracy(tmp_path, monkeypatch, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(vit_recipe(tmp_path / "digits", tmp_path / "run")))
    out = tmp_path / "bench"
    code, err = _bench(monkeypatch, capsys, str(recipe), "--steps", "2", "--only", "single", "--out", str(out))
    assert code == 0, err[-2000:]
    [row] = json.loads((out / "strategies.json").read_text())
    assert row["ok"] and row["metric"] == "accuracy" and 0 <= row["metric_value"] <= 1
    # 6 images a step: the seconds per step are the samples/s they make
    assert row["step_s"] == pytest.approx(6 / row["samples_per_second"]) and row["peak_memory_mb"] > 0
    table = (out / "strategies.md").read_text()
    assert "final accuracy" in table and f"| {row['metric_value']:.4f} |" in table


def test_an_unavailable_launch_is_one_line(tiny_clip_recipe, tmp_path, monkeypatch, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tiny_clip_recipe))
    code, err = _bench(monkeypatch, capsys, str(recipe), "--only", "zero9")
    assert code == 2 and "zero9 cannot run here" in err
    assert len(err.strip().splitlines()) == 1
