"""examples/hard_negatives.py --pipeline: the multi-seed summary (mean ± sd of first stage, reranked and their change)
and its bar chart; the pipeline itself takes minutes per seed and is measured in docs/benchmarks.md, not here."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hard_negatives.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("hard_negatives_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(seed, first, reranked):
    return {"seed": seed, "first_stage/ndcg@10": first, "reranked/ndcg@10": reranked,
            "first_stage/mrr@10": first - 0.1, "reranked/mrr@10": reranked - 0.2}


def test_summary_is_mean_and_sample_sd_over_seeds_with_the_change_per_seed(example):
    rows = [_row(0, 0.9, 0.2), _row(1, 0.8, 0.4), _row(2, 0.7, 0.3)]
    summary = example.summarize(rows)
    assert set(summary) == {f"{stage}/{name}" for stage in ("first_stage", "reranked", "change")
                            for name in ("ndcg@10", "mrr@10")}
    assert summary["first_stage/ndcg@10"] == pytest.approx({"mean": 0.8, "sd": 0.1, "seeds": 3})
    assert summary["reranked/ndcg@10"] == pytest.approx({"mean": 0.3, "sd": 0.1, "seeds": 3})
    # the change is taken per seed (-0.7, -0.4, -0.4), not as the difference of the means' sds
    assert summary["change/ndcg@10"] == pytest.approx({"mean": -0.5, "sd": 0.03 ** 0.5, "seeds": 3})
    assert summary["change/mrr@10"]["mean"] == pytest.approx(-0.6)
    json.dumps(summary)  # what pipeline.json holds


def test_one_seed_has_sd_zero(example):
    summary = example.summarize([_row(0, 0.95, 0.24)])
    assert summary["reranked/ndcg@10"] == {"mean": 0.24, "sd": 0.0, "seeds": 1}


def test_plot_writes_the_bar_chart(example, tmp_path):
    summary = example.summarize([_row(0, 0.9, 0.2), _row(1, 0.8, 0.4)])
    example.plot_pipeline(summary, 20, tmp_path / "pipeline.png")
    assert (tmp_path / "pipeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
