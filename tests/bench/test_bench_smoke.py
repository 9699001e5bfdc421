"""The benchmark scripts run (tiny models, one round); what they measure is for docs/benchmarks.md, not for tests.

Each smoke run is started as a user starts it, without `--out`: it must write into a temporary folder and leave the
committed results in bench/results/ byte for byte as they were."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import tempfile
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
RESULTS = BENCH / "results"


def _snapshot() -> dict[str, tuple[str, int]]:
    return {str(path.relative_to(RESULTS)): (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns)
            for path in sorted(RESULTS.rglob("*")) if path.is_file()}


@pytest.fixture
def smoke_dir(tmp_path, monkeypatch):
    """Where the smoke run's temporary folder is made (tempfile's default directory, pointed here); checks after the
    test that bench/results/ is untouched."""
    before = _snapshot()
    assert before, "bench/results/ holds the committed figures"
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    yield tmp_path
    assert _snapshot() == before, "a smoke run changed bench/results/"


def _written(smoke_dir: Path, name: str) -> Path:
    found = list(smoke_dir.glob(f"vembed-bench-smoke-*/{name}"))
    assert len(found) == 1, f"{name} not in a vembed-bench-smoke-* folder under {smoke_dir}"
    return found[0]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # in-process, but it builds and trains with three frameworks (sentence-transformers' import alone)
def test_throughput_bench_smoke_compares_every_system(smoke_dir):
    bench = _load("throughput")
    assert bench.main(["--smoke", "--scenario", "text"]) == 0
    summary = json.loads(_written(smoke_dir, "throughput_text.json").read_text())
    peers = {"sentence-transformers"} if bench.available("sentence-transformers") else set()
    expected = {"vembed", "minimal"} | peers
    assert set(summary["systems"]) == expected
    for result in summary["systems"].values():
        assert result["samples_per_second"] > 0 and result["peak_rss_mb"] > 0
    assert set(summary["vembed_ratio"]) == expected - {"vembed"}
    assert _written(smoke_dir, "throughput_text.png").stat().st_size > 0


@pytest.mark.slow
def test_throughput_bench_smoke_runs_the_vembed_train_door_and_reports_its_threads(smoke_dir):
    """The door users type (`vembed train`, accelerate's one-process launch) once trained on one thread: the bench
    measures it beside `python -m` and says how many threads each run had."""
    bench = _load("throughput")
    assert bench.main(["--smoke", "--scenario", "doors"]) == 0
    summary = json.loads(_written(smoke_dir, "throughput_doors.json").read_text())
    assert summary["reference"] == "vembed-train" and {"vembed-train", "vembed"} <= set(summary["systems"])
    for result in summary["systems"].values():
        assert result["samples_per_second"] > 0 and result["threads"] and min(result["threads"]) >= 1
    assert summary["systems"]["vembed-train"]["threads"] == summary["systems"]["vembed"]["threads"]


@pytest.mark.slow
def test_startup_bench_smoke_reaches_the_first_optimizer_step(smoke_dir, capsys):
    assert _load("startup").main(["--smoke"]) == 0
    assert "to the first optimizer step" in capsys.readouterr().out
    assert json.loads(_written(smoke_dir, "startup.json").read_text())["rounds"] == 1


@pytest.mark.slow
def test_step_overhead_bench_smoke_splits_vembed_step_and_times_the_minimal_loop(smoke_dir):
    assert _load("step_overhead").main(["--smoke", "--scenario", "clip"]) == 0
    result = json.loads(_written(smoke_dir, "step_overhead_clip.json").read_text())
    assert result["data_ms"] > 0 and result["model_step_ms"] > 0 and result["minimal_step_ms"] > 0
    assert result["vembed_step_ms"] >= result["model_step_ms"]


def test_only_smoke_runs_leave_bench_results(tmp_path, monkeypatch):
    """The rule itself, without running a bench: real runs write the committed folder, smoke runs a fresh one."""
    import sys

    monkeypatch.syspath_prepend(str(BENCH))
    from outputs import output_dir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert output_dir(None, smoke=False) == RESULTS
    smoke = output_dir(None, smoke=True)
    assert smoke.parent == tmp_path and smoke != output_dir(None, smoke=True)
    assert output_dir(str(tmp_path / "mine"), smoke=True) == tmp_path / "mine"
    sys.modules.pop("outputs", None)


@pytest.mark.slow  # two training child processes, one on PyLate's stack
def test_colbert_vs_pylate_smoke_trains_the_same_losses_in_both_tools(smoke_dir):
    bench = _load("colbert_vs_pylate")
    if not bench.pylate_available():
        pytest.skip("PyLate's stack is not installed (bash scripts/setup.sh dev)")
    assert bench.main(["--smoke"]) == 0
    summary = json.loads(_written(smoke_dir, "colbert_vs_pylate.json").read_text())
    assert summary["steps"] == 4 and len(summary["runs"]["pylate"]["losses"]) == 4
    assert set(summary["runs"]) == {"vembed", "vembed length_chunks=4", "pylate"} and summary["rounds"] == 1
    # the same start, batches, loss and optimizer: the same curve, with or without length chunks
    assert max(summary["max_loss_difference"].values()) < 1e-5
    # held-out nDCG@10 over the whole (smoke) corpus: the start once, each final model by its own tool's encoding
    assert set(summary["ndcg@10"]) == {"start", *summary["runs"]}
    assert all(0.0 <= value <= 1.0 for value in summary["ndcg@10"].values())
    queries = summary["runs"]["pylate"]["metrics"]["num_queries"]
    assert queries == summary["corpus"]["test_queries"] > 20 and summary["corpus"]["documents"] == 128
    # Nearly the same model (losses within 1e-5): only near-tied scores can rank differently. One swap of adjacent
    # ranks moves one query's nDCG@10 by at most 1 - 1/log2(3) = 0.37; allow that much over the mean (measured: 0).
    assert max(abs(d) for d in summary["ndcg_difference"].values()) <= 0.37 / queries
    for run in summary["runs"].values():
        assert run["samples_per_second"] > 0 and run["samples_per_cpu_second"] > 0 and run["peak_rss_mb"] > 0
    assert _written(smoke_dir, "colbert_vs_pylate.png").stat().st_size > 0


@pytest.mark.parametrize(("flags", "message"), [(["--documents", "12"], "--documents must be a multiple of 8"),
                                                (["--rounds", "0"], "--rounds must be at least 1")])
def test_colbert_vs_pylate_refuses_bad_flags_before_building_anything(flags, message, monkeypatch, capsys):
    """A partial family would leave a positive without a sibling to be its hard negative: one line, exit 2, before
    the corpus or a model is built."""
    bench = _load("colbert_vs_pylate")
    if not bench.pylate_available():
        pytest.skip("PyLate's stack is not installed (bash scripts/setup.sh dev)")

    def built(*_, **__):
        raise AssertionError("the job was built")

    monkeypatch.setattr(bench, "prepare", built)
    assert bench.main(flags) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow  # trains a tiny CLIP, then two classification runs
def test_class_name_head_bench_smoke_measures_both_heads(smoke_dir):
    assert _load("class_name_head").main(["--smoke"]) == 0
    results = json.loads(_written(smoke_dir, "class_name_head.json").read_text())
    for head_init in ("class_names", "random"):
        assert set(results["classification"][head_init]) == {"before", "after"}
        assert 0 <= results["classification"][head_init]["before"]["accuracy"] <= 1


@pytest.mark.slow  # in-process, but it trains three times, once through sentence-transformers' CrossEncoderTrainer
def test_rerank_vs_st_smoke_trains_the_same_job_in_both_tools(smoke_dir):
    """vembed's Trainer and sentence-transformers' CrossEncoderTrainer on the same start, lists and batches: the same
    BCE loss at every step, with and without vembed's length chunks (at step 0 the same model on the same batch; after
    it, the same optimizer), and each final model's reranking judged on the same held-out candidates."""
    bench = _load("rerank_vs_st")
    if not bench.available_peer():
        pytest.skip("sentence-transformers is not installed (pip install -e .[bench])")
    assert bench.main(["--smoke"]) == 0
    summary = json.loads(_written(smoke_dir, "rerank_vs_st.json").read_text())
    runs = summary["runs"]
    assert set(runs) == {"vembed", "sentence-transformers", "vembed length_chunks=2"} and summary["steps"] == 3
    assert all(len(run["losses"]) == 3 for run in runs.values())
    # the same model on the same first batch, then the same optimizer: one curve (length chunks change only rounding)
    assert summary["loss_difference_step0"] < 1e-5 and max(summary["max_loss_differences"].values()) < 1e-5
    for run in runs.values():
        assert run["samples_per_second"] > 0 and run["peak_rss_mb"] > 0
        assert 0.0 <= run["metrics"]["reranked/ndcg@10"] <= 1.0 and run["metrics"]["reranked/num_queries"] == 4
    assert _written(smoke_dir, "rerank_vs_st.png").stat().st_size > 0


@pytest.mark.slow  # the whole pipeline in-process: search, mine, two trainings, two rerankings, three evaluations
def test_rerank_pipeline_docstrings_smoke_runs_the_pipeline_and_the_reference_on_one_job(smoke_dir):
    """bench/rerank_pipeline_docstrings.py --smoke: a corpus folder of real docstrings, BM25's first stage, negatives
    mined, then vembed's recipe and sentence-transformers' CrossEncoderTrainer on the same lists and batches (tiny
    BERT, no dropout: one loss curve), each reranking the same first stage, judged by `vembed eval`."""
    bench = _load("rerank_pipeline_docstrings")
    if not bench.rerank_vs_st.available_peer():
        pytest.skip("sentence-transformers is not installed (pip install -e .[bench])")
    assert bench.main(["--smoke"]) == 0
    summary = json.loads(_written(smoke_dir, "rerank_pipeline_docstrings.json").read_text())
    counts = summary["corpus_counts"]
    assert counts["test_queries"] == 8 and counts["train_queries"] == 16 and counts["documents"] > 24
    assert summary["lists"] == 16 and summary["steps"] == 4 and summary["seeds"] == [0]
    runs = summary["per_seed"]["0"]
    assert set(runs) == {"vembed", "sentence-transformers"} and all(len(r["losses"]) == 4 for r in runs.values())
    # the same start, batches, schedule and loss: the same curve, to float32 rounding (measured: 0.0)
    assert summary["max_loss_difference"] < 1e-5
    assert 0.0 < summary["first_stage"]["ndcg@10"] <= 1.0 and summary["first_stage"]["recall@top_k"] == 1.0
    for tool in runs.values():
        assert 0.0 <= tool["ndcg@10"] <= 1.0 and tool["train_seconds"] > 0 and tool["rerank_seconds"] > 0
        # the reranked run is the first stage's top 20 reordered (the rest are not kept): what it finds at any depth
        # is what the top 20 held
        assert tool["recall@100"] == pytest.approx(summary["first_stage"]["recall@top_k"], abs=1e-9)
    assert summary["tools"]["vembed"]["change_ndcg@10"]["mean"] == pytest.approx(
        runs["vembed"]["ndcg@10"] - summary["first_stage"]["ndcg@10"], abs=1e-9)


def _losses_vs_st_smoke(smoke_dir: Path, losses: list[str]) -> dict:
    """bench/losses_vs_st.py --smoke on `losses`: each trained by vembed's door and by SentenceTransformerTrainer
    on the same start, rows and batches, dropout off; the summary it wrote."""
    bench = _load("losses_vs_st")
    if importlib.util.find_spec("sentence_transformers") is None:
        pytest.skip("sentence-transformers is not installed (pip install -e .[bench])")
    assert bench.main(["--smoke", "--losses", ",".join(losses)]) == 0
    summary = json.loads(_written(smoke_dir, "losses_vs_st.json").read_text())
    assert list(summary["losses"]) == losses and summary["steps"] == 3
    for loss in losses:
        off = summary["losses"][loss]["dropout_off"]
        ours, theirs = off["losses"]["vembed"], off["losses"]["sentence-transformers"]
        assert len(ours) == len(theirs) == 3
        # The same model, batches and optimizer: one trajectory, to float32 rounding of the different paddings and
        # summation orders (measured: at most 4e-6). Watched failing with vembed's file left in the rows' order, so
        # that its shuffle reorders them: step 1 then differs by 2e-3 (distill_kl) and 0.18 (gist)
        scale = max(1.0, max(abs(x) for x in theirs))
        assert off["max_difference"]["sentence-transformers"] <= 1e-4 * scale, (loss, ours, theirs)
    table = _written(smoke_dir, "losses_vs_st.md").read_text()
    assert all(f"## {loss}" in table for loss in losses)
    assert _written(smoke_dir, "losses_vs_st.png").stat().st_size > 0
    return summary


def test_losses_vs_st_smoke_follows_sentence_transformers_step_by_step(smoke_dir):
    """Two losses that take the bench's two extra inputs: a teacher's score lists over hard negatives (distill_kl)
    and GISTEmbed's guide model (gist)."""
    _losses_vs_st_smoke(smoke_dir, ["distill_kl", "gist"])


@pytest.mark.slow  # twelve trainings, in-process
def test_losses_vs_st_smoke_follows_sentence_transformers_for_every_loss(smoke_dir):
    bench = _load("losses_vs_st")
    _losses_vs_st_smoke(smoke_dir, list(bench.LOSSES))


def test_sparse_vs_bm25_smoke_measures_bm25_and_both_splade_models(smoke_dir):
    """bench/sparse_vs_bm25.py --smoke: BM25 and a tiny SPLADE, untrained and trained by `vembed train`, on a few
    modules' docstrings; the index ranks as dense blocks do (the script checks it) and its bytes are the CSR's."""
    pytest.importorskip("bm25s")
    bench = _load("sparse_vs_bm25")
    assert bench.main(["--smoke"]) == 0
    results = json.loads(_written(smoke_dir, "sparse_vs_bm25.json").read_text())
    assert 0.0 < results["bm25"]["ndcg@10"] <= 1.0 and results["train_seconds"] > 0
    for name in ("untrained_pruned", "trained", "trained_pruned"):
        found = results[name]
        assert 0.0 <= found["ndcg@10"] <= 1.0 and found["max_score_difference"] <= 1e-5
        # a float32 weight and an int32 term id per non-zero, an int32 offset per document and block
        nonzeros = found["corpus_active_dims"] * results["corpus"]["documents"]
        assert found["index_bytes_csr"] == pytest.approx(nonzeros * 8 + (results["corpus"]["documents"] + 1) * 4)
        assert found["index_bytes_dense"] == results["corpus"]["documents"] * results["vocabulary"] * 4
    assert results["untrained_pruned"]["corpus_active_dims"] == bench.PRUNED_DOCUMENT
