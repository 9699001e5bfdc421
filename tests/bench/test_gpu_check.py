"""The GPU check (bench/gpu_check.py, scripts/gpu_check.sh): its CPU dry run runs every step at toy size, so the
script cannot rot between lent GPU machines; a step that fails or overruns is recorded and the next one still runs."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from deadline import limit

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("bench_gpu_check", ROOT / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


# The one accepted skip of each peer step: its peer cannot be imported here
ACCEPTED_SKIPS = {"clip_speed": "OPEN_CLIP_UNAVAILABLE", "colbert_speed": "PYLATE_UNAVAILABLE"}


@pytest.mark.slow  # seven fresh processes (torch, transformers, a pytest run, PyLate's): 1-2 min of CPU on 2 cores
def test_cpu_dry_run_runs_every_step_and_writes_json_and_table(tmp_path):
    gpu_check = _load()
    done = subprocess.run(["bash", "scripts/gpu_check.sh", "--cpu-dry-run", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=limit(900))
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] and report["card"] == "cpu"
    assert list(report["steps"]) == ["environment", *gpu_check.STEPS]  # a GPU run's default leaves qwen_memory out
    assert set(gpu_check.DEFAULT_STEPS) == set(gpu_check.STEPS) - {"qwen_memory"}
    steps = report["steps"]
    for name, record in steps.items():
        if name in ACCEPTED_SKIPS and record["status"] == "skipped":
            assert record["reason"].startswith(getattr(gpu_check, ACCEPTED_SKIPS[name])), record
            continue
        assert record["status"] == "ok", (name, record)
    assert "needs CUDA" in steps["gpu_tests"]["results"]["summary"]  # every tests/gpu test ran its skip check
    assert steps["qwen_memory"]["results"]["planner_gib"] > 0 and steps["qwen_memory"]["results"]["peak_gib"] > 0
    text = steps["text_speed"]["results"]
    systems = ["vembed padded", "vembed length_chunks=4", "sentence-transformers"]
    if isinstance(text["vembed packed"], str):  # vembed without `packing` yet: the recipe error's line
        assert text["vembed packed"].startswith("not available: recipe error: packing"), text["vembed packed"]
    else:
        systems.append("vembed packed")
        assert text["ratios"]["packed / sentence-transformers"] > 0
    assert all(text["agreement"][name] >= gpu_check.BF16_COSINE for name in systems if name.startswith("vembed"))
    assert text["vembed padded"]["planner_gib"] > 0 and text["ratios"]["vembed padded / sentence-transformers"] > 0
    speeds = {"text_speed": systems, "cross_encoder_speed": ["vembed", "sentence-transformers"],
              "clip_speed": ["vembed", "open_clip"], "colbert_speed": ["vembed", "pylate"]}
    for name, names in speeds.items():
        if steps[name]["status"] == "ok":
            results = steps[name]["results"]
            assert results["training_flops_per_step"] > 0, name
            for system in names:  # MFU on the CPU: over its measured float32 ceiling
                assert results[system]["samples_per_second"] > 0 and 0 < results[system]["mfu"] < 2, (name, system)
                assert results[system]["peak_gib"] is None, (name, system)  # CUDA memory only
    table = (tmp_path / "gpu_check.md").read_text().splitlines()
    rows = [line for line in table if line.startswith("| ") and not line.startswith(("| step", "| ---"))]
    assert [row.split(" | ")[0][2:] for row in rows] == list(report["steps"])
    assert all(row.endswith("| cpu |") for row in rows)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_failing_step_is_recorded_with_its_error_line_and_the_next_step_runs(tmp_path, monkeypatch):
    """A step whose process dies (here: a step its worker does not know) and a step over its budget: both recorded as
    failed with one line saying why, in the JSON and the table; the run goes on and exits 1."""
    gpu_check = _load()
    monkeypatch.setattr(gpu_check, "STEPS", {
        "broken": gpu_check.Step(gpu_check.gpu_tests, budget_s=60, dry_budget_s=60),
        "gpu_tests": gpu_check.Step(gpu_check.gpu_tests, budget_s=1, dry_budget_s=1),  # a pytest run: over 1 s
    })
    monkeypatch.setattr(gpu_check, "_run_environment", lambda *_: {
        "status": "ok", "results": {"card": "test card", "summary": "-"}, "seconds": 0.0, "budget_s": 1})
    assert gpu_check.main(["--cpu-dry-run", "--out", str(tmp_path)]) == 1
    steps = json.loads((tmp_path / "gpu_check.json").read_text())["steps"]
    assert steps["broken"]["status"] == "failed" and steps["broken"]["error"] == "KeyError: 'broken'"
    assert steps["gpu_tests"]["status"] == "failed" and "over its 1 s budget" in steps["gpu_tests"]["error"]
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| broken | failed |" in table and "KeyError: 'broken'" in table and "| gpu_tests | failed |" in table
    assert (tmp_path / "logs" / "broken.txt").is_file()


def test_speed_rows_give_samples_per_second_mfu_and_memory_of_the_median_round(tmp_path, monkeypatch):
    gpu_check = _load()
    monkeypatch.setattr(gpu_check, "_peak_flops", lambda ctx: (1e12, "table"))
    measured = {"vembed": {"round_seconds": [0.5, 0.25, 0.3], "peak_bytes": 3 * 2**30},
                "peer": {"round_seconds": [1.0], "peak_bytes": None}}
    rows = gpu_check._speed_rows(measured, 100, 2e11, gpu_check.Context(dry_run=False, work=tmp_path, budget_s=1))
    assert rows["vembed"]["samples_per_second"] == pytest.approx(100 / 0.3, rel=1e-9)
    assert rows["vembed"]["mfu"] == pytest.approx(2e11 / 0.3 / 1e12, rel=1e-9)
    assert rows["vembed"]["peak_gib"] == pytest.approx(3.0) and rows["peer"]["peak_gib"] is None
    assert rows["peer"]["mfu"] == pytest.approx(0.2) and rows["peak_flops"] == {"flops_per_second": 1e12,
                                                                                 "source": "table"}
    assert gpu_check._ratio(rows, "vembed", "peer") == pytest.approx(100 / 0.3 / 100)
    assert gpu_check._rate_line(rows) == ("vembed 333 samples/s (MFU 66.7%, 3.00 GiB); "
                                          "peer 100 samples/s (MFU 20.0%)")


def test_packing_is_not_available_on_a_recipe_error_and_any_other_error_fails_the_step(tmp_path, monkeypatch):
    """The `packing` key is new: a vembed that rejects it gives the recipe error's first line (the step goes on); a
    vembed that has it but breaks while building fails the step."""
    gpu_check = _load()
    from vembed.errors import RecipeError

    ctx = gpu_check.Context(dry_run=True, work=tmp_path, budget_s=1)
    built = []

    def reject(raw):
        built.append(raw)
        raise RecipeError("packing", "unknown key; remove it")

    monkeypatch.setattr(gpu_check, "_trainer", reject)
    trainer, reason = gpu_check._packed_trainer({"model_type": "text"}, ctx)
    assert trainer is None and reason == str(RecipeError("packing", "unknown key; remove it")).splitlines()[0]
    assert reason.startswith("recipe error: packing") and built[0]["packing"] is True

    def crash(raw):
        raise RuntimeError("varlen kernel missing")

    monkeypatch.setattr(gpu_check, "_trainer", crash)
    with pytest.raises(RuntimeError, match="varlen kernel missing"):
        gpu_check._packed_trainer({"model_type": "text"}, ctx)


@pytest.mark.slow  # the text step at toy size, in this process: 20-40 s of CPU
def test_embeddings_off_the_unpadded_reference_fail_the_text_step_with_its_speeds_in_the_error(tmp_path, monkeypatch):
    gpu_check = _load()
    monkeypatch.setattr(gpu_check, "_check_unpadded", lambda runs, *_: {name: 0.5 for name in runs})
    with pytest.raises(RuntimeError, match=r"beyond bf16 tolerance: \{'vembed padded': 0.5.*\(speeds: vembed padded "
                                           r"[0-9]+ samples/s \(MFU .*sentence-transformers [0-9]+ samples/s"):
        gpu_check.text_speed(gpu_check.Context(dry_run=True, work=tmp_path, budget_s=180))


def test_the_colbert_step_is_skipped_only_without_any_pylate_stack(tmp_path, monkeypatch):
    gpu_check = _load()
    monkeypatch.setattr(gpu_check._bench_module("pylate_runner"), "STACK", tmp_path / "no-stack")
    ctx = gpu_check.Context(dry_run=True, work=tmp_path, budget_s=60, wheels=tmp_path / "no-wheels")
    with pytest.raises(gpu_check.Skipped, match="^" + re.escape(gpu_check.PYLATE_UNAVAILABLE) + ": no wheels in"):
        gpu_check.colbert_speed(ctx)
    (tmp_path / "no-stack" / "pylate").mkdir(parents=True)  # a development checkout's stack
    assert gpu_check._pylate_stack(ctx) == tmp_path / "no-stack"


@pytest.mark.parametrize("stderr, expected", [
    ("/usr/bin/python: No module named pytest\n", "pytest is not installed: pip install -e '.[dev]'"),
    ("ImportError: while loading conftest\n", "pytest wrote no report: ImportError: while loading conftest"),
])
def test_the_gpu_tests_step_says_why_pytest_wrote_no_report(tmp_path, monkeypatch, stderr, expected):
    gpu_check = _load()
    monkeypatch.setattr(gpu_check.subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a[0], 1, stdout="", stderr=stderr))
    with pytest.raises(RuntimeError, match="^" + re.escape(expected)):
        gpu_check.gpu_tests(gpu_check.Context(dry_run=True, work=tmp_path, budget_s=60))


def test_unknown_step_is_one_line_and_exit_2(tmp_path, capsys):
    assert _load().main(["--out", str(tmp_path), "--steps", "gpu_tests,nope"]) == 2
    assert capsys.readouterr().err.strip() == ("error: --steps: unknown step nope; choose from gpu_tests, clip_speed, "
                                               "text_speed, cross_encoder_speed, colbert_speed, levers, qwen_memory")


def test_only_missing_distributions_and_vembed_are_installed_from_the_wheel_folder(tmp_path):
    for name in ("pytest-9.0.0-py3-none-any.whl", "no_such_distribution_here-1.0-py3-none-any.whl",
                 "vembed-0.1.0-py3-none-any.whl", "Typing_Extensions-4.0-py3-none-any.whl"):
        (tmp_path / name).write_bytes(b"")
    assert [w.name for w in _load().missing_wheels(tmp_path)] == [
        "no_such_distribution_here-1.0-py3-none-any.whl", "vembed-0.1.0-py3-none-any.whl"]


def test_gpu_wheels_pins_pylates_stack_as_installed_here(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_wheels", ROOT / "scripts" / "gpu_wheels.py")
    gpu_wheels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_wheels)
    for name in ("pylate-1.6.0.dist-info", "sentence_transformers-5.3.0.dist-info", "Tokenizers-0.22.2.dist-info",
                 "pylate", "transformers"):
        (tmp_path / name).mkdir()
    assert gpu_wheels.pylate_stack_requirements(tmp_path) == ["pylate==1.6.0", "sentence-transformers==5.3.0",
                                                              "tokenizers==0.22.2"]
    with pytest.raises(SystemExit, match="no PyLate stack at .*scripts/setup.sh dev"):
        gpu_wheels.pylate_stack_requirements(tmp_path / "pylate")
