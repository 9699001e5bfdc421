"""Reranking a first-stage run on a corpus split: before/after with the corpus evaluation's trec_eval metrics."""

from __future__ import annotations

import pytest
import torch

from vembed.errors import DataError


def _split_and_run(tmp_path):
    from corpora import make_corpus_folder

    from vembed.data.corpus import load_corpus_split

    split = load_corpus_split(make_corpus_folder(tmp_path / "corpus"), "test")
    # A poor first stage: 12 candidates per query, its relevant documents placed 4th and 9th from the top (one,
    # d12, left out for q6, so recall stays below 1 after reranking too).
    lines = []
    for query, judged in split.qrels.items():
        relevant = [d for d, grade in judged.items() if grade > 0]
        others = [d for d in split.corpus.ids if d not in judged][:12 - len(relevant)]
        ranked = others[:3] + relevant[:1] + others[3:7] + relevant[1:] + others[7:]
        if query == "q6":
            ranked = [d for d in ranked if d != "d12"]
        lines += [f"{query} Q0 {d} {rank} {100 - rank} first" for rank, d in enumerate(ranked, start=1)]
    path = tmp_path / "first_stage.trec"
    path.write_text("\n".join(lines) + "\n")
    return split, path


def test_an_oracle_reranker_lifts_ndcg_to_what_the_candidates_allow(tmp_path):
    from vembed.evaluation.corpus import corpus_metrics
    from vembed.reranking.evaluation import read_run_file, rerank_run

    split, path = _split_and_run(tmp_path)
    run = read_run_file(path)
    text_to_id = {side.text: doc for doc, side in zip(split.corpus.ids, split.corpus.sides)}
    query_to_id = {side.text: q for q, side in zip(split.queries.ids, split.queries.sides)}

    def oracle(queries, documents):  # the qrels' grade of each pair
        return torch.tensor([float(split.qrels[query_to_id[q]].get(text_to_id[d], 0))
                             for q, d in zip(queries, documents)])

    metrics = rerank_run(oracle, split, run, depth=10)
    cut = {q: dict(sorted(scores.items(), key=lambda item: -item[1])[:10]) for q, scores in run.items()}
    assert {k[len("first_stage/"):]: v for k, v in metrics.items() if k.startswith("first_stage/")} == \
        corpus_metrics(cut, split.qrels)
    assert metrics["first_stage/ndcg@10"] < 0.7 and metrics["first_stage/mrr@10"] == pytest.approx(0.25)
    assert metrics["reranked/mrr@10"] == 1.0
    q6_alone = corpus_metrics({"q6": {"d6": 1.0}}, {"q6": split.qrels["q6"]})["ndcg@10"] < 1.0
    assert q6_alone and metrics["reranked/ndcg@10"] < 1.0  # d12 was never a candidate
    assert metrics["reranked/recall@10"] == metrics["first_stage/recall@10"]  # reordering finds nothing new


def test_a_trained_cross_encoder_scores_the_candidates(tmp_path, rerank_recipe):
    from vembed.components import recipe_from_dict
    from vembed.reranking.cross_encoder import CrossEncoderAdapter
    from vembed.reranking.evaluation import read_run_file, rerank_run

    split, path = _split_and_run(tmp_path)
    adapter = CrossEncoderAdapter.from_recipe(recipe_from_dict(rerank_recipe))
    metrics = rerank_run(adapter.score, split, read_run_file(path), depth=10)
    assert 0.0 <= metrics["reranked/ndcg@10"] <= 1.0
    assert metrics["reranked/num_queries"] == metrics["first_stage/num_queries"] == len(split.qrels)


def test_a_bad_run_line_is_named(tmp_path):
    from vembed.reranking.evaluation import read_run_file

    path = tmp_path / "run.trec"
    path.write_text("q1 Q0 d1 1 2.5 tag\nq1 Q0 d2 2 high tag\n")
    with pytest.raises(DataError, match=r"run.trec, row 2: is not a TREC run line"):
        read_run_file(path)
