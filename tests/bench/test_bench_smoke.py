"""The benchmark scripts run (tiny models, one round); what they measure is for docs/benchmarks.md, not for tests."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # in-process, but it builds and trains with three frameworks (sentence-transformers' import alone)
def test_throughput_bench_smoke_compares_every_system(tmp_path):
    bench = _load("throughput")
    assert bench.main(["--smoke", "--scenario", "text", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "throughput_text.json").read_text())
    peers = {"sentence-transformers"} if bench.available("sentence-transformers") else set()
    expected = {"vembed", "minimal"} | peers
    assert set(summary["systems"]) == expected
    for result in summary["systems"].values():
        assert result["samples_per_second"] > 0 and result["peak_rss_mb"] > 0
    assert set(summary["vembed_ratio"]) == expected - {"vembed"}
    assert (tmp_path / "throughput_text.png").stat().st_size > 0


@pytest.mark.slow
def test_startup_bench_smoke_reaches_the_first_optimizer_step(tmp_path, capsys):
    assert _load("startup").main(["--smoke", "--out", str(tmp_path)]) == 0
    assert "to the first optimizer step" in capsys.readouterr().out


@pytest.mark.slow
def test_step_overhead_bench_smoke_splits_vembed_step_and_times_the_minimal_loop(tmp_path):
    assert _load("step_overhead").main(["--smoke", "--scenario", "clip", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "step_overhead_clip.json").read_text())
    assert result["data_ms"] > 0 and result["model_step_ms"] > 0 and result["minimal_step_ms"] > 0
    assert result["vembed_step_ms"] >= result["model_step_ms"]
