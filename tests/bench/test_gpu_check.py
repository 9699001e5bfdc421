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


@pytest.mark.slow  # five fresh processes (torch, transformers, a pytest run): 40-60 s of CPU on 2 cores
def test_cpu_dry_run_runs_every_step_and_writes_json_and_table(tmp_path):
    gpu_check = _load()
    done = subprocess.run(["bash", "scripts/gpu_check.sh", "--cpu-dry-run", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=limit(900))
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] and report["card"] == "cpu"
    assert list(report["steps"]) == ["environment", *gpu_check.STEPS]
    for name, record in report["steps"].items():
        if name == "clip_speed" and record["status"] == "skipped":  # the one accepted skip: no usable open_clip here
            assert record["reason"].startswith(gpu_check.OPEN_CLIP_UNAVAILABLE), record
            continue
        assert record["status"] == "ok", (name, record)
    steps = report["steps"]
    assert "needs CUDA" in steps["gpu_tests"]["results"]["summary"]  # every tests/gpu test ran its skip check
    assert steps["qwen_memory"]["results"]["planner_gib"] > 0 and steps["qwen_memory"]["results"]["peak_gib"] > 0
    length = steps["length_encoding"]["results"]
    assert length["padded"]["min_cosine_to_unpadded"] >= gpu_check.BF16_COSINE
    assert length["length_chunks=4"]["samples_per_second"] > 0
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
                                               "qwen_memory, length_encoding")


def test_only_missing_distributions_and_vembed_are_installed_from_the_wheel_folder(tmp_path):
    for name in ("pytest-9.0.0-py3-none-any.whl", "no_such_distribution_here-1.0-py3-none-any.whl",
                 "vembed-0.1.0-py3-none-any.whl", "Typing_Extensions-4.0-py3-none-any.whl"):
        (tmp_path / name).write_bytes(b"")
    assert [w.name for w in _load().missing_wheels(tmp_path)] == [
        "no_such_distribution_here-1.0-py3-none-any.whl", "vembed-0.1.0-py3-none-any.whl"]
