"""Candidate lists `{"query", "documents": [positive, negatives...], "scores": [...]}` streamed (data.streaming): read
as the map-style path reads them (vembed/data/candidate_lists.py), from data files and from tar samples' `.json`; a
score list of another length is a counted `bad_score` skip in the map-style path's words, naming the file and row; a
documents list beside a negatives column is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("webdataset")  # the streaming extra (in dev)

from corpora import text_model_keys
from data_files import write_jsonl as _jsonl
from data_files import write_parquet as _parquet
from streams import write_tar

from vembed.data.sources import load_rows
from vembed.data.stream_samples import SampleDecoder
from vembed.data.streaming import ShardStream, SlotPosition, StreamReport, open_stream
from vembed.errors import DataError
from vembed.recipe import DataConfig

LISTS = [{"query": f"a photo of a red square {i}", "documents": [f"a red square {i}", f"a blue circle {i}",
                                                                  f"a green star {i}"],
          "scores": [9.0 - i, 1.0, -2.0 + i]} for i in range(8)]


def _csv(path: Path, rows: list[dict]) -> Path:  # lists written as JSON, as a CSV cell holds them
    import csv

    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows({k: json.dumps(v) if isinstance(v, list) else v for k, v in row.items()} for row in rows)
    return path


def _tar(path: Path, rows: list[dict]) -> Path:  # each row a sample whose .json holds its fields
    return write_tar(path.with_suffix(".tar"), {f"s{i:03d}": {"json": json.dumps(row).encode()}
                                                for i, row in enumerate(rows)})


WRITERS = {"jsonl": _jsonl, "parquet": _parquet, "csv": _csv, "tar": _tar}


def _streamed(train: str, **data) -> tuple[list, SlotPosition]:
    """Every example of one epoch of `train` streamed, and the slot's end position (its skips)."""
    config = DataConfig(train=train, streaming=True, **data)
    backend, shards = open_stream(config)
    decoder = SampleDecoder(config.columns.model_dump(), config.image_root, config.num_hard_negatives or 0, None)
    stream = ShardStream(backend, shards, decoder, list, batch_size=1, seed=0, shuffle_buffer=4)
    stream.start_epoch(0)
    items = list(stream)
    return [example for _, batch in items if batch for example in batch], SlotPosition.from_dict(items[-1][0])


def _parts(examples) -> list[tuple]:
    return sorted((e.query.text, e.positive.text, [n.text for n in e.negatives], e.score) for e in examples)


@pytest.mark.parametrize("kind", list(WRITERS))
def test_a_streamed_lists_file_gives_the_examples_of_the_map_style_read(tmp_path, kind):
    train = WRITERS[kind](tmp_path / f"lists.{kind}", LISTS)
    same_rows = _jsonl(tmp_path / "same.jsonl", LISTS) if kind == "tar" else train  # the map-style path reads no tar
    for negatives in (2, 1):  # all of them; one, the scores cut with the negatives as the map-style path cuts them
        mapped, _ = load_rows(DataConfig(train=str(same_rows), num_hard_negatives=negatives), "train")
        streamed, end = _streamed(str(train), num_hard_negatives=negatives)
        assert _parts(streamed) == _parts(mapped) and len(streamed) == 8 and not end.skipped
    assert _parts(streamed)[0] == ("a photo of a red square 0", "a red square 0", ["a blue circle 0"], [9.0, 1.0])


@pytest.mark.parametrize("kind", ["jsonl", "tar"])
@pytest.mark.parametrize("count", [2, 4], ids=["fewer", "more"])  # one short of the documents and one over
def test_a_score_list_of_another_length_is_a_counted_skip_in_the_map_style_words(tmp_path, kind, count):
    rows = [dict(row) for row in LISTS]
    rows[2]["scores"] = [1.0, 2.0, 3.0, 4.0][:count]
    with pytest.raises(DataError) as mapped:
        load_rows(DataConfig(train=str(_jsonl(tmp_path / "rows.jsonl", rows))), "train")
    train = WRITERS[kind](tmp_path / f"w.{kind}", rows)

    streamed, end = _streamed(str(train), num_hard_negatives=2)
    assert len(streamed) == 7 and end.skipped == {"bad_score": 1}  # a stream counts its bad rows and goes on
    [bad] = end.bad_rows
    assert (bad["file"], bad["row"]) == (str(train), 3) and mapped.value.detail in bad["detail"]
    report = StreamReport(split="train", files=[str(train)])
    report.merge_positions(0, [end])
    with pytest.raises(DataError) as stopped:  # 1 of 8 is over max_bad_fraction: the run stops, one line
        report.check_bad_fraction(0.05, epoch_done=True)
    message = str(stopped.value)
    assert f"{train}, row 3:" in message and f"{count} teacher scores for 3 documents" in message
    assert "\n" not in message


def test_a_documents_list_beside_negatives_is_refused_first_and_skipped_later(tmp_path):
    both = [dict(LISTS[0], negatives=["a white page"]), *LISTS[1:]]
    with pytest.raises(DataError) as mapped:
        load_rows(DataConfig(train=str(_jsonl(tmp_path / "both.jsonl", both))), "train")
    with pytest.raises(DataError) as streamed:  # the first sample: refused before training, as the map-style path
        _streamed(str(tmp_path / "both.jsonl"))
    assert str(streamed.value) == str(mapped.value) and "give one of them" in str(streamed.value)

    later = _tar(tmp_path / "later", [*LISTS[:5], dict(LISTS[5], negatives=["a white page"]), *LISTS[6:]])
    examples, end = _streamed(str(later), num_hard_negatives=2)  # a later tar sample: counted, as bad rows are
    assert len(examples) == 7 and end.skipped == {"documents_and_negatives": 1}
    assert end.bad_rows[0]["row"] == 6 and "give one of them" in end.bad_rows[0]["detail"]


def test_a_distillation_loss_trains_on_a_streamed_lists_file_as_on_the_file_read_whole(tmp_path, tiny_tokenizer_dir):
    from vembed.components import recipe_from_dict
    from vembed.training.loop import Trainer

    train = _jsonl(tmp_path / "lists.jsonl", LISTS)
    losses = {}
    for streaming in (True, False):  # one batch of all 8 lists: its loss does not depend on the stream's order
        out = tmp_path / f"run-{streaming}"
        raw = {**text_model_keys(tiny_tokenizer_dir), "loss_type": "distill_kl", "output_dir": str(out),
               "data": {"train": str(train), "streaming": streaming, "num_hard_negatives": 2},
               "batch_size": 8, "max_steps": 1, "seed": 0, "logging_steps": 1, "eval_before_training": False}
        Trainer(recipe_from_dict(raw)).run()
        losses[streaming] = json.loads((out / "metrics.json").read_text())["loss_history"]
    assert len(losses[True]) == 1 and losses[True][0]["loss"] == pytest.approx(losses[False][0]["loss"], rel=1e-5)


def test_a_streamed_loss_that_reads_negatives_needs_data_num_hard_negatives(tmp_path, tiny_tokenizer_dir):
    from vembed.components import recipe_from_dict
    from vembed.errors import RecipeError
    from vembed.recipe_checks import check_recipe

    train = _jsonl(tmp_path / "lists.jsonl", LISTS)
    raw = {**text_model_keys(tiny_tokenizer_dir), "loss_type": "distill_kl", "max_steps": 1,
           "data": {"train": str(train), "streaming": True}}
    with pytest.raises(RecipeError) as refused:  # before: a ValueError traceback at step 1 (the batch had none)
        check_recipe(recipe_from_dict(raw))
    assert refused.value.key == "data.num_hard_negatives" and "distill_kl reads at least 1" in str(refused.value)
    check_recipe(recipe_from_dict({**raw, "data": {**raw["data"], "num_hard_negatives": 1}}))
    check_recipe(recipe_from_dict({**raw, "loss_type": "infonce"}))  # reads negatives where there are, needs none


def test_a_tar_sample_whose_image_is_its_positive_is_not_a_candidate_list(tmp_path):
    from streams import png_bytes

    shard = write_tar(tmp_path / "s-0.tar", {"k0": {"png": png_bytes(), "txt": b"a red square",
                                                   "json": json.dumps(LISTS[0]).encode()}})
    [example], end = _streamed(str(shard))  # open_clip's pairing: as a file with a positive_image column and lists
    assert example.positive.image is not None and example.positive.text is None and example.score is None
    assert example.query.text == "a photo of a red square 0" and not end.skipped  # the .json's query names it


# --- what the loss reads, per streamed sample (rows read whole are refused before training by check_loss_inputs) ---


def _decoded_with(train: Path, loss_type: str, **data) -> tuple[list, SlotPosition]:
    from vembed.components import LOSSES
    from vembed.losses.inputs import record_lacks

    config = DataConfig(train=str(train), streaming=True, **data)
    backend, shards = open_stream(config)
    decoder = SampleDecoder(config.columns.model_dump(), None, config.num_hard_negatives or 0, None,
                            lacks=record_lacks(LOSSES.get(loss_type), loss_type))
    stream = ShardStream(backend, shards, decoder, list, batch_size=1, seed=0, shuffle_buffer=4)
    stream.start_epoch(0)
    items = list(stream)
    return [example for _, batch in items if batch for example in batch], SlotPosition.from_dict(items[-1][0])


PAIRS = [{"query": f"q {i}", "positive": f"p {i}", "score": float(i % 5), "label": f"c{i % 3}"} for i in range(8)]


@pytest.mark.parametrize("loss_type, cell, value, reason, words", [
    ("cosent", "score", None, "bad_score", "has no score; loss_type cosent needs one number per pair"),
    ("cosent", "score", [1.0, 2.0], "bad_score", "has a list of teacher scores; loss_type cosent needs one number"),
    ("distill_kl", "score", 3.0, "bad_score", "has one number; loss_type distill_kl needs a list of teacher scores"),
    ("batch_hard_triplet", "label", None, "missing_label", "has no label (data.columns.label); loss_type "
                                                           "batch_hard_triplet mines on labels"),
])
def test_a_streamed_sample_lacking_what_the_loss_reads_is_a_counted_skip_naming_its_row(tmp_path, loss_type, cell,
                                                                                        value, reason, words):
    """Before, the sample reached a batch: `CoSENTLoss needs a score per pair ...; the batch has none`, a ValueError
    traceback at the step, or a TypeError building the score tensor from a None."""
    rows = [dict(row) for row in PAIRS]
    if loss_type == "distill_kl":
        rows = [dict(row, negatives=[f"n {i}"], score=[1.0, 0.5]) for i, row in enumerate(rows)]
    rows[3][cell] = value
    negatives = {"num_hard_negatives": 1} if loss_type == "distill_kl" else {}
    examples, end = _decoded_with(_jsonl(tmp_path / "pairs.jsonl", rows), loss_type, **negatives)
    assert len(examples) == 7 and end.skipped == {reason: 1}
    [bad] = end.bad_rows
    assert bad["row"] == 4 and words in bad["detail"], bad
    _, kept = _decoded_with(_jsonl(tmp_path / "all.jsonl", rows), "infonce", **negatives)
    assert not kept.skipped  # a loss that reads neither keeps every sample


@pytest.mark.parametrize("loss_type, column, words", [
    ("cosent", "score", "loss_type cosent needs one number per pair"),
    ("batch_hard_triplet", "label", "loss_type batch_hard_triplet mines on labels"),
])
def test_a_stream_without_the_column_the_loss_reads_is_refused_before_training(tmp_path, tiny_tokenizer_dir,
                                                                               loss_type, column, words):
    from vembed.components import recipe_from_dict
    from vembed.errors import RecipeError
    from vembed.recipe_checks import check_recipe

    rows = [{key: value for key, value in row.items() if key != column} for row in PAIRS]
    train = _jsonl(tmp_path / "pairs.jsonl", rows)
    raw = {**text_model_keys(tiny_tokenizer_dir), "loss_type": loss_type, "max_steps": 1,
           "data": {"train": str(train), "streaming": True}}
    with pytest.raises(RecipeError) as refused:  # before: every sample a skip, found only when training
        check_recipe(recipe_from_dict(raw))
    assert refused.value.key == f"data.columns.{column}" and words in str(refused.value)
    assert f"the first sample of {train} has no {column}" in str(refused.value)
    check_recipe(recipe_from_dict({**raw, "loss_type": "infonce"}))


def test_a_streamed_training_skips_and_counts_the_sample_without_a_score(tmp_path, tiny_tokenizer_dir):
    from vembed.components import recipe_from_dict
    from vembed.training.loop import Trainer

    rows = [dict(row) for row in PAIRS] * 2
    rows[5] = dict(rows[5], score=float("nan"))  # a NaN cell is a missing score, as in rows read whole
    train = _jsonl(tmp_path / "pairs.jsonl", rows)
    out = tmp_path / "run"
    raw = {**text_model_keys(tiny_tokenizer_dir), "loss_type": "cosent", "output_dir": str(out), "batch_size": 5,
           "data": {"train": str(train), "streaming": True, "max_bad_fraction": 0.1}, "max_steps": 3, "seed": 0,
           "logging_steps": 1, "eval_before_training": False}
    Trainer(recipe_from_dict(raw)).run()
    metrics = json.loads((out / "metrics.json").read_text())
    assert len(metrics["loss_history"]) == 3
    assert "bad_score" in json.dumps(metrics)  # the skip is reported with the run
