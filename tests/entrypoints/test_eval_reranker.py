"""`vembed eval RERANKER CORPUS --first-stage EMBEDDER|RUN_FILE`: the first stage's top k reranked, before/after with
trec_eval's definitions (checked against pytrec_eval on the same runs); mix-ups of reranker and embedder are one line,
exit 2, nothing written."""

from __future__ import annotations

import json

import pytest
from corpora import make_corpus_folder, text_model_keys
from rerank_lists import TINY_BERT, write_first_stage_run

from vembed.cli import main

pytrec_eval = pytest.importorskip("pytrec_eval")


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_tokenizer_dir):
    """A tiny random-init embedder and cross-encoder saved by vembed, and the corpus folder of tests/corpora.py."""
    from vembed.components import recipe_from_dict
    from vembed.models import MODELS
    from vembed.reranking import RERANKERS

    root = tmp_path_factory.mktemp("eval_reranker")
    MODELS.get("text").from_recipe(recipe_from_dict(text_model_keys(tiny_tokenizer_dir))).save(root / "embedder")
    recipe = recipe_from_dict({"model_type": "cross_encoder", "loss_type": "rerank_bce", "model_config": TINY_BERT,
                               "tokenizer_name": tiny_tokenizer_dir, "max_length": 32})
    RERANKERS.get("cross_encoder").from_recipe(recipe).save(root / "reranker")
    return root, make_corpus_folder(root / "corpus")


def _trec_means(qrels: dict, run: dict, top_k: int) -> dict[str, float]:
    """pytrec_eval's means over the queries with a relevant document (a query the run misses scores 0, as
    trec_eval -c); MRR@10 is recip_rank on the run cut to its top 10 (trec_eval's order)."""
    from vembed.evaluation.corpus import rankings_from_run

    judged = [q for q, grades in qrels.items() if any(g > 0 for g in grades.values())]
    measures = {"ndcg_cut.10", f"recall.1,10,{top_k}", f"map_cut.{top_k}"}
    found = pytrec_eval.RelevanceEvaluator(qrels, measures).evaluate(run)
    top10 = {q: {d: run[q][d] for d in ranking[:10]} for q, ranking in rankings_from_run(run).items()}
    mrr = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"}).evaluate(top10)
    names = {"ndcg@10": "ndcg_cut_10", "recall@1": "recall_1", "recall@10": "recall_10",
             f"recall@{top_k}": f"recall_{top_k}", f"map@{top_k}": f"map_cut_{top_k}"}
    means = {ours: sum(found.get(q, {}).get(theirs, 0.0) for q in judged) / len(judged)
             for ours, theirs in names.items()}
    means["mrr@10"] = sum(mrr.get(q, {}).get("recip_rank", 0.0) for q in judged) / len(judged)
    return means


def test_an_embedder_first_stage_reranked_equals_trec_eval_on_the_same_runs(models, tmp_path, capsys):
    from vembed.data.corpus import load_corpus_split
    from vembed.evaluation.corpus import corpus_metrics, evaluate_corpus
    from vembed.models.foreign import load_embedding_model
    from vembed.reranking import load_reranker
    from vembed.reranking.evaluation import embedder_run, rerank

    root, corpus = models
    out = tmp_path / "metrics.json"
    assert main(["eval", str(root / "reranker"), str(corpus), "--split", "dev", "--first-stage",
                 str(root / "embedder"), "--top-k", "8", "--batch-size", "5", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    metrics = json.loads(out.read_text())

    split = load_corpus_split(corpus, "dev")
    embedder = load_embedding_model(root / "embedder")
    first = embedder_run(embedder, split, 8)
    assert all(len(candidates) == 8 for candidates in first.values())
    # The first stage is the embedder alone: its whole-corpus run scores as `vembed eval EMBEDDER` does.
    alone = corpus_metrics(embedder_run(embedder, split, 100), split.qrels)
    assert {f"corpus/{k}": v for k, v in alone.items() if "@" in k} == pytest.approx(
        {k: v for k, v in evaluate_corpus(embedder, split).items() if "@" in k}, abs=1e-9)
    before, after = rerank(load_reranker(root / "reranker").score, split, first, depth=8)
    for stage, run in (("first_stage", before), ("reranked", after)):
        for name, value in _trec_means(split.qrels, run, 8).items():
            assert metrics[f"{stage}/{name}"] == pytest.approx(value, abs=1e-6), (stage, name)
    assert metrics["reranked/num_queries"] == 4 and metrics["reranked/num_queries_without_relevant"] == 1
    assert metrics["reranked/recall@8"] == metrics["first_stage/recall@8"]  # the same candidates, reordered
    assert before != after  # the reranker's scores are not the embedder's
    row = next(line for line in printed.splitlines() if line.startswith("ndcg@10"))
    change = metrics["reranked/ndcg@10"] - metrics["first_stage/ndcg@10"]
    assert row.split() == ["ndcg@10", f"{metrics['first_stage/ndcg@10']:.4f}",
                           f"{metrics['reranked/ndcg@10']:.4f}", f"{change:+.4f}"]
    assert [line.split()[0] for line in printed.splitlines()[1:7]] == [
        "ndcg@10", "mrr@10", "recall@1", "recall@8", "recall@10", "map@8"]


def test_a_run_file_first_stage_is_reranked_as_rerank_run_reranks_it(models, tmp_path, capsys):
    from vembed.data.corpus import load_corpus_split
    from vembed.reranking import load_reranker
    from vembed.evaluation.runs import read_run
    from vembed.reranking.evaluation import cutoffs_for, rerank_run

    root, corpus = models
    split = load_corpus_split(corpus, "test")
    run_file = write_first_stage_run(split, tmp_path / "first.trec")
    out = tmp_path / "metrics.json"
    assert main(["eval", str(root / "reranker"), str(corpus), "--first-stage", str(run_file), "--top-k", "10",
                 "--output", str(out)]) == 0
    expected = rerank_run(load_reranker(root / "reranker").score, split, read_run(run_file), depth=10,
                          cutoffs=cutoffs_for(10))
    got = json.loads(out.read_text())
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=1e-9), key
    assert got["first_stage/mrr@10"] == pytest.approx(0.25)  # the run puts the relevant document 4th
    assert "first stage" in capsys.readouterr().out

    # --max-samples: the first 2 judged queries only, the same as a run file holding only those.
    assert main(["eval", str(root / "reranker"), str(corpus), "--first-stage", str(run_file), "--top-k", "10",
                 "--max-samples", "2", "--output", str(tmp_path / "two.json")]) == 0
    two = json.loads((tmp_path / "two.json").read_text())
    assert two["reranked/num_queries"] == 2.0


@pytest.mark.parametrize("case, flag", [
    ("reranker-without-first-stage", "--first-stage"),
    ("embedder-as-reranker", "model_dir"),
    ("reranker-as-first-stage", "--first-stage"),
    ("missing-first-stage", "--first-stage"),
    ("reranker-on-pair-files", "data"),
    ("top-k-without-first-stage", "--top-k"),
    ("top-k-zero", "--top-k"),
    ("bad-run-line", "first.trec, row 2"),
])
def test_reranker_mix_ups_are_one_line_exit_2_and_nothing_written(models, tmp_path, capsys, case, flag):
    root, corpus = models
    reranker, embedder = str(root / "reranker"), str(root / "embedder")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"query": "a red square", "positive": "a red square on blue"}) + "\n")
    bad_run = tmp_path / "first.trec"
    bad_run.write_text("q2 Q0 d2 1 2.0 x\nq2 Q0 d3 2 high x\n")
    argv = {
        "reranker-without-first-stage": [reranker, str(corpus)],
        "embedder-as-reranker": [embedder, str(corpus), "--first-stage", embedder],
        "reranker-as-first-stage": [reranker, str(corpus), "--first-stage", reranker],
        "missing-first-stage": [reranker, str(corpus), "--first-stage", str(tmp_path / "nothing")],
        "reranker-on-pair-files": [reranker, str(pairs), "--first-stage", embedder],
        "top-k-without-first-stage": [embedder, str(corpus), "--top-k", "5"],
        "top-k-zero": [reranker, str(corpus), "--first-stage", embedder, "--top-k", "0"],
        "bad-run-line": [reranker, str(corpus), "--first-stage", str(bad_run)],
    }[case]
    out = tmp_path / "out" / "metrics.json"
    assert main(["eval", *argv, "--output", str(out)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0], captured.err
    assert not out.exists() and not out.parent.exists()


def test_a_reranker_handed_to_mine_is_one_line_and_nothing_written(models, tmp_path, capsys):
    root, corpus = models
    out = tmp_path / "negatives.jsonl"
    assert main(["mine", str(root / "reranker"), str(corpus), "--out", str(out), "--faiss", "no"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "reranker" in lines[0] and "model_dir" in lines[0], lines
    assert list(tmp_path.iterdir()) == []
