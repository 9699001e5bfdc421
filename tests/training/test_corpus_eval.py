"""Corpus evaluation in a run: a corpus folder as data.validation/test is searched at eval_steps and at the end, the
figures equal `vembed eval` on the saved final/, and wrong qrels splits or metric names are one line."""

from __future__ import annotations

import json
import math

import pytest
from corpora import make_corpus_folder, text_model_keys, write_pairs

from vembed.components import recipe_from_dict
from vembed.errors import RecipeError
from vembed.recipe_checks import check_recipe
from vembed.training.loop import Trainer

CORPUS_KEYS = ("corpus/ndcg@10", "corpus/recall@1", "corpus/recall@10", "corpus/recall@100", "corpus/map@100",
               "corpus/mrr@10")


@pytest.fixture
def corpus_run(tmp_path, tiny_tokenizer_dir):
    folder = make_corpus_folder(tmp_path / "corpus")
    raw = {**text_model_keys(tiny_tokenizer_dir),
           "data": {"train": str(write_pairs(folder, tmp_path / "train.jsonl")), "validation": str(folder)},
           "output_dir": str(tmp_path / "run"), "batch_size": 4, "max_steps": 4, "eval_steps": 2, "save_steps": 2,
           "learning_rate": 1e-3, "logging_steps": 1, "seed": 0, "eval_before_training": True}
    return folder, raw


def test_in_run_corpus_metrics_equal_vembed_eval_on_the_saved_model(corpus_run, tmp_path, capsys):
    from vembed.entrypoints.evaluate import main

    folder, raw = corpus_run
    raw["data"]["test"] = {"beir": {"files": str(folder), "qrels_split": "test"}}
    recipe = recipe_from_dict(raw)
    check_recipe(recipe)
    assert recipe.metric_for_best_model == "corpus/ndcg@10"  # the default, for a corpus validation split
    metrics = Trainer(recipe).run().metrics

    assert [entry["step"] for entry in metrics["eval_history"]] == [2, 4]
    assert all(set(CORPUS_KEYS) <= set(entry) for entry in metrics["eval_history"])
    assert metrics["best"]["value"] == max(entry["corpus/ndcg@10"] for entry in metrics["eval_history"])
    assert metrics["before"]["num_queries"] == 4  # dev: 5 judged queries, one without a relevant document
    assert metrics["before"]["corpus/ndcg@10"] != metrics["validation"]["corpus/ndcg@10"]  # training moved it
    assert set(metrics["test"]) >= {f"beir/{key}" for key in CORPUS_KEYS} | set(CORPUS_KEYS)

    for split, name, prefix in (("dev", "validation", ""), ("test", "test", "beir/")):
        out = tmp_path / f"{split}.json"
        assert main([str(tmp_path / "run" / "final"), str(folder), "--split", split, "--output", str(out)]) == 0
        saved = json.loads(out.read_text())
        for key, value in saved.items():
            assert metrics[name][prefix + key] == pytest.approx(value, abs=1e-6), (split, key)


def test_a_missing_qrels_split_is_one_line_naming_the_key_and_the_splits(corpus_run, tmp_path, capsys):
    from vembed.entrypoints.evaluate import main

    folder, raw = corpus_run
    raw["data"]["qrels_splits"] = {"validation": "validation"}
    with pytest.raises(RecipeError, match=r"data.qrels_splits.validation: corpus folder .* has no "
                                          r"qrels/validation.tsv \(splits here: dev, test, train\)"):
        check_recipe(recipe_from_dict(raw))
    raw["data"]["validation"] = {"beir": {"files": str(folder), "qrels_split": "Dev"}}
    with pytest.raises(RecipeError, match=r"data.validation.beir.qrels_split: .*no qrels/Dev.tsv"):
        check_recipe(recipe_from_dict(raw))
    with pytest.raises(RecipeError, match="did you mean qrels_splits"):
        recipe_from_dict({**raw, "data": {**raw["data"], "qrels_split": "dev"}})
    assert main([str(tmp_path), str(folder), "--split", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--split: corpus folder" in err and "splits here: dev, test, train" in err


def test_metric_for_best_model_must_be_a_validation_metric(corpus_run):
    folder, raw = corpus_run
    with pytest.raises(RecipeError, match=r"metric_for_best_model: 'corpus/ndcg@5' is not a validation metric of "
                                          r"this recipe \(did you mean corpus/ndcg@10\?\); use one of: corpus/"):
        check_recipe(recipe_from_dict({**raw, "metric_for_best_model": "corpus/ndcg@5"}))
    named = {**raw, "data": {**raw["data"], "validation": {"beir": str(folder), "pairs": raw["data"]["train"]}}}
    check_recipe(recipe_from_dict({**named, "metric_for_best_model": "beir/corpus/map@100"}))
    check_recipe(recipe_from_dict({**named, "metric_for_best_model": "pairs/q2d/mrr"}))
    with pytest.raises(RecipeError, match="'q2d/accuracy@1' is not a validation metric"):
        check_recipe(recipe_from_dict(named))  # mixed sources share no key: the default must be named


def test_a_text_model_trains_on_a_corpus_folder_with_its_judged_documents_and_negatives_by_id(corpus_run, tmp_path):
    from corpora import write_negatives

    from vembed.data.corpus import load_corpus_split

    folder, raw = corpus_run
    negatives_file = write_negatives(tmp_path / "negatives.jsonl")
    raw["data"] = {"train": str(folder), "hard_negatives": str(negatives_file), "num_hard_negatives": 2}
    raw.update(max_steps=3, save_steps=None, eval_steps=None, eval_before_training=False)
    recipe = recipe_from_dict(raw)
    check_recipe(recipe)
    trainer = Trainer(recipe)
    batches = []
    original = trainer.task.train_dataset

    def recording_collate(objective):
        dataset, collate = original(objective)

        def recording(examples):
            batch = collate(examples)
            batches.append((examples, batch["label_ids"].tolist()))
            return batch

        return dataset, recording

    trainer.task.train_dataset = recording_collate
    metrics = trainer.run().metrics
    assert metrics["train"]["steps"] == 3 and math.isfinite(metrics["train"]["final_loss"])
    assert metrics["train"]["data"]["kept"] == 13 and metrics["train"]["data"]["num_hard_negatives"] == 2

    split = load_corpus_split(folder, "train")
    doc_id = {side.text: i for i, side in zip(split.corpus.ids, split.corpus.sides)}
    query_id = {side.text: i for i, side in zip(split.queries.ids, split.queries.sides)}
    mined = {(row["query_id"], row.get("positive_id")): row["negative_ids"]
             for row in map(json.loads, negatives_file.read_text().splitlines())}
    seen = set()
    for examples, labels in batches:
        assert len(examples) == 4
        for example, label in zip(examples, labels):
            query, positive = query_id[example.query.text], doc_id[example.positive.text]
            assert split.qrels[query][positive] > 0  # the query's own judged document
            listed = mined.get((query, positive)) or mined[(query, None)]
            expected = [d for d in listed if split.qrels[query].get(d, 0) <= 0][:2]
            assert [doc_id[n.text] for n in example.negatives] == expected  # from the file, relevant ones dropped
            seen.add((query, positive))
        groups = {}  # pairs of one relevance group (same query, or a shared relevant document) share a label id
        for example, label in zip(examples, labels):
            groups.setdefault(example.label, set()).add(label)
        assert all(len(ids) == 1 for ids in groups.values()) and len(set(labels)) == len(groups)
    assert len(seen) >= 10  # 3 steps (+1 prefetched batch) of 4 records: most of the 13 pairs


def test_named_validation_sources_may_mix_corpus_folders_and_pair_files(corpus_run):
    from vembed.data.corpus import CorpusSplit
    from vembed.tasks.contrastive import ContrastiveTask

    folder, raw = corpus_run
    raw["data"]["validation"] = {"pairs": raw["data"]["train"], "beir": {"files": str(folder), "qrels_split": "test"}}
    recipe = recipe_from_dict({**raw, "metric_for_best_model": "beir/corpus/ndcg@10"})
    check_recipe(recipe)
    loaded = ContrastiveTask(recipe).load_eval_split("validation")
    assert list(loaded) == ["pairs", "beir"]
    assert isinstance(loaded["beir"], CorpusSplit) and loaded["beir"].split == "test"
    assert len(loaded["pairs"]) == 13 and loaded["pairs"][0].query.text == "a photo of a red square"
