"""Reranking a first-stage run on a corpus split: before/after with the corpus evaluation's trec_eval metrics."""

from __future__ import annotations

import pytest
import torch

from vembed.errors import DataError


def _split_and_run(tmp_path, name: str = "test"):
    from corpora import make_corpus_folder
    from rerank_lists import write_first_stage_run

    from vembed.data.corpus import load_corpus_split

    split = load_corpus_split(make_corpus_folder(tmp_path / "corpus"), name)
    return split, write_first_stage_run(split, tmp_path / "first_stage.trec", left_out={"q6": "d12"})


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


def _validated_recipe(rerank_recipe, tmp_path, **changes):
    from corpora import make_corpus_folder
    from rerank_lists import write_first_stage_run

    from vembed.data.corpus import load_corpus_split

    folder = make_corpus_folder(tmp_path / "corpus")
    run = write_first_stage_run(load_corpus_split(folder, "dev"), tmp_path / "dev.trec")
    data = dict(rerank_recipe["data"], validation=str(folder), first_stage_run=str(run))
    return dict(rerank_recipe, data=data, **changes)


def test_in_run_evaluation_reranks_the_first_stage_as_the_saved_model_does(rerank_recipe, tmp_path):
    from vembed.components import recipe_from_dict
    from vembed.data.corpus import load_corpus_split
    from vembed.reranking.cross_encoder import CrossEncoderAdapter
    from vembed.reranking.evaluation import read_run_file, rerank_run
    from vembed.recipe_checks import check_recipe
    from vembed.training.loop import Trainer

    raw = _validated_recipe(rerank_recipe, tmp_path, eval_steps=1)
    recipe = recipe_from_dict(raw)
    check_recipe(recipe)
    result = Trainer(recipe).run()
    metrics = result.metrics
    assert metrics["best"]["metric"] == "reranked/ndcg@10"
    assert len(metrics["eval_history"]) >= 2
    saved = rerank_run(CrossEncoderAdapter.load(result.final_model_dir).score,
                       load_corpus_split(tmp_path / "corpus", "dev"), read_run_file(raw["data"]["first_stage_run"]))
    assert metrics["validation"].keys() == saved.keys()
    for key, value in saved.items():
        assert metrics["validation"][key] == pytest.approx(value, abs=1e-9), key
    assert metrics["validation"]["first_stage/mrr@10"] == pytest.approx(0.25)


@pytest.mark.parametrize("changes, key", [
    ({"first_stage_run": None}, "data.first_stage_run"),
    ({"first_stage_run": "missing.trec"}, "data.first_stage_run"),
    ({"test": "CORPUS"}, "data.test"),
], ids=["no-run", "missing-run", "test-split"])
def test_reranker_evaluation_keys_are_checked_before_anything_is_read(rerank_recipe, tmp_path, changes, key):
    from vembed.components import recipe_from_dict
    from vembed.errors import RecipeError
    from vembed.recipe_checks import check_recipe

    raw = _validated_recipe(rerank_recipe, tmp_path)
    data = {k: (raw["data"]["validation"] if v == "CORPUS" else v) for k, v in changes.items()}
    raw["data"] = {k: v for k, v in {**raw["data"], **data}.items() if v is not None}
    with pytest.raises(RecipeError) as error:
        check_recipe(recipe_from_dict(raw))
    assert error.value.key == key
