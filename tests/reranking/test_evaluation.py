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
    from vembed.evaluation.runs import read_run
    from vembed.reranking.evaluation import rerank_run

    split, path = _split_and_run(tmp_path)
    run = read_run(path)
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
    from vembed.evaluation.runs import read_run
    from vembed.reranking.evaluation import rerank_run

    split, path = _split_and_run(tmp_path)
    adapter = CrossEncoderAdapter.from_recipe(recipe_from_dict(rerank_recipe))
    metrics = rerank_run(adapter.score, split, read_run(path), depth=10)
    assert 0.0 <= metrics["reranked/ndcg@10"] <= 1.0
    assert metrics["reranked/num_queries"] == metrics["first_stage/num_queries"] == len(split.qrels)


def test_a_bad_run_line_is_named(tmp_path):
    from vembed.evaluation.runs import read_run

    path = tmp_path / "run.trec"
    path.write_text("q1 Q0 d1 1 2.5 tag\nq1 Q0 d2 2 high tag\n")
    with pytest.raises(DataError, match=r"run.trec, row 2: is not a TREC run line"):
        read_run(path)


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
    from vembed.evaluation.runs import read_run
    from vembed.reranking.evaluation import rerank_run
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
                       load_corpus_split(tmp_path / "corpus", "dev"), read_run(raw["data"]["first_stage_run"]))
    assert metrics["validation"].keys() == saved.keys()
    for key, value in saved.items():
        assert metrics["validation"][key] == pytest.approx(value, abs=1e-9), key
    assert metrics["validation"]["first_stage/mrr@10"] == pytest.approx(0.25)


@pytest.mark.parametrize("changes, key", [
    ({"first_stage_run": None}, "data.first_stage_run"),
    ({"first_stage_run": "missing.trec"}, "data.first_stage_run"),
    ({"test": "CORPUS"}, "data.first_stage_run.test"),  # a bare path is validation's run
], ids=["no-run", "missing-run", "test-without-its-run"])
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


def test_data_test_is_reranked_once_by_the_final_model_and_recorded_as_the_embedders_test_split(rerank_recipe,
                                                                                                  tmp_path):
    """data.test with its own first-stage run: the end of training reranks it with the final model (the numbers of
    `rerank_run` on the saved final/), into metrics.json's and the card's `test`, beside validation's."""
    import json

    from corpora import make_corpus_folder
    from rerank_lists import write_first_stage_run

    from vembed.components import recipe_from_dict
    from vembed.data.corpus import load_corpus_split
    from vembed.model_card import CARD_FILE, README_FILE
    from vembed.recipe_checks import check_recipe
    from vembed.reranking.cross_encoder import CrossEncoderAdapter
    from vembed.evaluation.runs import read_run
    from vembed.reranking.evaluation import rerank_run
    from vembed.training.loop import Trainer

    folder = make_corpus_folder(tmp_path / "corpus")
    runs = {split: str(write_first_stage_run(load_corpus_split(folder, qrels), tmp_path / f"{qrels}.trec",
                                             left_out={"q6": "d12"} if split == "test" else None))
            for split, qrels in (("validation", "dev"), ("test", "test"))}
    data = dict(rerank_recipe["data"], validation=str(folder), test=str(folder), first_stage_run=runs)
    recipe = recipe_from_dict(dict(rerank_recipe, data=data))
    check_recipe(recipe)
    result = Trainer(recipe).run()

    saved = CrossEncoderAdapter.load(result.final_model_dir)
    expected = rerank_run(saved.score, load_corpus_split(folder, "test"), read_run(runs["test"]))
    written = json.loads((result.output_dir / "metrics.json").read_text())
    card = json.loads((result.final_model_dir / CARD_FILE).read_text())
    for test in (result.metrics["test"], written["test"], card["evaluation"]["test"]):
        assert test.keys() == expected.keys()
        for key, value in expected.items():
            assert test[key] == pytest.approx(value, abs=1e-6), key
    assert expected["reranked/num_queries"] == len(load_corpus_split(folder, "test").qrels)
    assert written["test"] != written["validation"]  # each split reranks its own run
    assert written["best"]["metric"] == "reranked/ndcg@10"
    # The card shows each split as what the reranker adds there (tests/reranking/test_card.py checks the numbers).
    readme = (result.final_model_dir / README_FILE).read_text()
    tests = int(expected["reranked/num_queries"])
    assert f"### test ({tests} judged queries)" in readme and "### validation (" in readme


def _recipe_file(rerank_recipe, tmp_path, **data):
    import yaml

    path = tmp_path / "recipe.yaml"
    raw = dict(rerank_recipe, data={k: v for k, v in {**rerank_recipe["data"], **data}.items() if v is not None})
    path.write_text(yaml.safe_dump(raw))
    return path


GIVE = "give the TREC run file of the first stage on data.{} (e.g. the embedder's top 100 per query)"
PER_SPLIT = "; a run per split: first_stage_run: {validation: PATH, test: PATH}"
RETRIEVED_ON = "is set but data.{} is not; name the corpus folder the run was retrieved on"


@pytest.mark.parametrize("data, says", [
    ({"test": "CORPUS", "first_stage_run": None},
     "data.first_stage_run.test: is not set; " + GIVE.format("test") + PER_SPLIT),
    ({"test": "CORPUS", "first_stage_run": {"test": "missing.trec"}},
     "data.first_stage_run.test: 'missing.trec' is not a file; " + GIVE.format("test") + PER_SPLIT),
    ({"validation": "CORPUS", "test": "CORPUS", "first_stage_run": "RUN"},
     "data.first_stage_run.test: is not set; " + GIVE.format("test") + PER_SPLIT),
    ({"validation": "CORPUS", "first_stage_run": "missing.trec"},
     "data.first_stage_run: 'missing.trec' is not a file; " + GIVE.format("validation")),
    ({"test": "LISTS", "first_stage_run": {"test": "RUN"}},
     "data.test: must be a corpus folder (corpus.jsonl, queries.jsonl, qrels/) for rerankers: its first-stage "
     "candidates are reranked and judged"),
    ({"test": "CORPUS", "first_stage_run": "RUN"},
     "data.first_stage_run: " + RETRIEVED_ON.format("validation") + " (a bare path is data.validation's run; "
     "data.test's is first_stage_run: {test: PATH})"),
    ({"test": "CORPUS", "first_stage_run": {"validation": "RUN", "test": "RUN"}},
     "data.first_stage_run.validation: " + RETRIEVED_ON.format("validation")),
    ({"first_stage_run": {"test": "RUN"}}, "data.first_stage_run.test: " + RETRIEVED_ON.format("test")),
], ids=["no-run", "missing-run", "bare-path-is-validations", "missing-validation-run", "not-a-corpus",
        "bare-path-without-validation", "validation-run-without-split", "test-run-without-split"])
def test_vembed_train_refuses_a_test_split_without_its_run_in_one_line_before_training(rerank_recipe, tmp_path,
                                                                                         capsys, data, says):
    from corpora import make_corpus_folder
    from rerank_lists import write_first_stage_run

    from vembed.cli import main
    from vembed.data.corpus import load_corpus_split

    folder = make_corpus_folder(tmp_path / "corpus")
    run = write_first_stage_run(load_corpus_split(folder, "test"), tmp_path / "test.trec")
    named = {"CORPUS": str(folder), "RUN": str(run), "LISTS": rerank_recipe["data"]["train"]}

    def resolve(value):
        return {k: named.get(v, v) for k, v in value.items()} if isinstance(value, dict) else named.get(value, value)

    recipe = _recipe_file(rerank_recipe, tmp_path, **{key: resolve(value) for key, value in data.items()})
    assert main(["train", str(recipe)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"recipe error: {says}"
    assert "Traceback" not in "\n".join(err)
    assert not (tmp_path / "run").exists()


def test_first_stage_runs_are_evaluation_not_part_of_whose_run_a_folder_holds(rerank_recipe):
    """Adding data.test and its run file to a resumed run is evaluating more, not another run (as data.test is)."""
    from vembed.components import recipe_from_dict
    from vembed.training.run_dir import run_identity

    def identity(**data):
        return run_identity(recipe_from_dict(dict(rerank_recipe, data={**rerank_recipe["data"], **data})))

    assert identity() == identity(first_stage_run="dev.trec") == \
        identity(first_stage_run={"validation": "dev.trec", "test": "test.trec"})
    assert identity() != identity(num_hard_negatives=3)


def test_the_best_checkpoint_is_picked_by_a_reranking_metric_of_validation(rerank_recipe, tmp_path):
    from vembed.components import recipe_from_dict
    from vembed.errors import RecipeError
    from vembed.evaluation.corpus import DEFAULT_CUTOFFS
    from vembed.recipe_checks import check_recipe

    raw = _validated_recipe(rerank_recipe, tmp_path)
    recipe = recipe_from_dict(raw)
    check_recipe(recipe)
    assert recipe.metric_for_best_model == "reranked/ndcg@10"
    assert "metric_for_best_model" not in recipe.model_fields_set  # still the default: a resume may change it
    chosen = recipe_from_dict(dict(raw, metric_for_best_model="first_stage/recall@100"))
    check_recipe(chosen)
    assert chosen.metric_for_best_model == "first_stage/recall@100"
    with pytest.raises(RecipeError) as error:
        check_recipe(recipe_from_dict(dict(raw, metric_for_best_model="q2d/accuracy@1")))
    names = [f"{stage}/{name}" for stage in ("reranked", "first_stage") for name in DEFAULT_CUTOFFS.names()]
    assert str(error.value) == ("recipe error: metric_for_best_model: 'q2d/accuracy@1' is not a reranking metric; "
                                f"use one of: {', '.join(names)}")
