"""vembed/data/synthetic.py: offline datasets on disk, split by image, deterministic, with a loadable tokenizer."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from vembed.data.synthetic import make_digits_dataset, make_dummy_dataset
from vembed.errors import DataError

SPLITS = ("train", "validation", "test")


def _records(out_dir):
    return {s: [json.loads(line) for line in (out_dir / f"{s}.jsonl").read_text().splitlines()] for s in SPLITS}


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("synthetic") / "digits"
    return out_dir, make_digits_dataset(out_dir, image_size=16, seed=0)


def test_digits_layout_and_records(digits):
    from PIL import Image

    out_dir, summary = digits
    expected = {"train.jsonl", "validation.jsonl", "test.jsonl", "images", "classes.json", "tokenizer", "dataset.json"}
    assert {p.name for p in out_dir.iterdir()} == expected
    records = _records(out_dir)
    assert sum(len(r) for r in records.values()) == 1797 == len(list((out_dir / "images").iterdir()))
    assert {summary[s] for s in SPLITS} == {len(records["train"]), len(records["validation"]), len(records["test"])}
    row = records["train"][0]
    assert set(row) == {"query", "positive_image", "label"} and row["label"] in "0123456789"
    image = Image.open(out_dir / row["positive_image"])
    assert image.size == (16, 16) and image.mode == "RGB"
    classes = json.loads((out_dir / "classes.json").read_text())
    assert list(classes) == [str(d) for d in range(10)] and classes["7"] == "a handwritten digit seven"
    assert len({r["query"] for rows in records.values() for r in rows}) >= 60  # templated with variety


def test_digits_splits_are_disjoint_by_image_and_stratified(digits):
    out_dir, _ = digits
    records = _records(out_dir)
    images = {s: {r["positive_image"] for r in rows} for s, rows in records.items()}
    assert not images["train"] & images["validation"]
    assert not images["train"] & images["test"]
    assert not images["validation"] & images["test"]
    assert len(records["train"]) == pytest.approx(0.7 * 1797, abs=2)
    assert len(records["validation"]) == pytest.approx(0.15 * 1797, abs=2)
    for split in SPLITS:
        counts = Counter(r["label"] for r in records[split])
        share = {label: n / len(records[split]) for label, n in counts.items()}
        assert len(counts) == 10 and max(share.values()) - min(share.values()) < 0.03


def test_digits_tokenizer_loads_with_auto_tokenizer(digits):
    from transformers import AutoTokenizer

    out_dir, summary = digits
    tokenizer = AutoTokenizer.from_pretrained(summary["tokenizer"])
    ids = tokenizer("a handwritten digit seven")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
    assert tokenizer.unk_token_id not in ids


def test_digits_are_deterministic_and_reused(digits, tmp_path):
    out_dir, summary = digits
    assert make_digits_dataset(out_dir, image_size=16, seed=0) == summary  # same settings: the folder is reused
    other = make_digits_dataset(tmp_path / "digits", image_size=16, seed=0)
    assert _records(tmp_path / "digits") == _records(out_dir) and other["train"] == summary["train"]
    assert (tmp_path / "digits/images/0042.png").read_bytes() == (out_dir / "images/0042.png").read_bytes()


def test_dummy_layout_negatives_and_determinism(tmp_path):
    summary = make_dummy_dataset(tmp_path / "dummy", num_samples=30, seed=0, image_size=24)
    records = _records(tmp_path / "dummy")
    assert [summary[s] for s in SPLITS] == [len(records[s]) for s in SPLITS] and sum(summary[s] for s in SPLITS) == 30
    row = records["train"][0]
    shape, colour = row["label"].split("-")
    assert shape in row["query"] and colour in row["query"]
    assert len(row["negatives"]) == 2 and row["query"] not in row["negatives"]
    images = [{r["positive_image"] for r in records[s]} for s in SPLITS]
    assert sum(len(i) for i in images) == len(set().union(*images)) == 30
    make_dummy_dataset(tmp_path / "again", num_samples=30, seed=0, image_size=24)
    assert _records(tmp_path / "again") == records
    make_dummy_dataset(tmp_path / "other", num_samples=30, seed=1, image_size=24)
    assert _records(tmp_path / "other") != records
    make_dummy_dataset(tmp_path / "dummy", num_samples=30, seed=1, image_size=24)  # other settings: replaced
    assert _records(tmp_path / "dummy") == _records(tmp_path / "other")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again", "dummy", "other"]  # no temporary folders left
    classes = json.loads((tmp_path / "dummy" / "classes.json").read_text())
    assert classes["circle-red"] == "a red circle" and len(classes) == 12


def test_dummy_loads_through_the_sources(tmp_path, monkeypatch):
    import datasets

    from vembed.data.sources import load_examples
    from vembed.recipe import DataConfig

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    summary = make_dummy_dataset(tmp_path / "dummy", num_samples=20)
    examples, report = load_examples(DataConfig(train=summary["files"]["train"]), "train")
    assert report.kept == summary["train"] and report.num_hard_negatives == 2
    assert examples[0].positive.image.startswith(str(tmp_path / "dummy" / "images"))


def test_a_failed_build_leaves_nothing_behind(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("killed")

    monkeypatch.setattr("vembed.data.tokenizer.train_tokenizer", boom)
    with pytest.raises(RuntimeError):
        make_dummy_dataset(tmp_path / "dummy", num_samples=6)
    assert list(tmp_path.iterdir()) == []


def test_an_unrelated_folder_is_not_overwritten(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(DataError, match="not a vembed synthetic dataset"):
        make_dummy_dataset(tmp_path / "mine", num_samples=6)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_a_rebuild_with_other_settings_keeps_files_the_user_added(tmp_path):
    make_dummy_dataset(tmp_path / "d", num_samples=6)
    (tmp_path / "d" / "notes.txt").write_text("keep me")
    with pytest.raises(DataError, match=r"d: holds notes.txt, not written by vembed"):
        make_dummy_dataset(tmp_path / "d", num_samples=9)  # other settings: the folder would be replaced
    assert (tmp_path / "d" / "notes.txt").read_text() == "keep me"
    (tmp_path / "d" / "notes.txt").unlink()
    assert make_dummy_dataset(tmp_path / "d", num_samples=9)["train"] > 0  # only what it wrote: rebuilt
