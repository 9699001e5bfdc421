"""vembed/data/image_columns.py: the image files a split's records use, read from its columns without making a
record, are exactly those the records name; a text-only table reads no image column at all."""

from __future__ import annotations

import json

import pytest

from vembed.data.image_cache import image_paths
from vembed.data.reader import RowReader
from vembed.data.sources import load_rows
from vembed.recipe import DataConfig


@pytest.fixture(autouse=True)
def _private_datasets_cache(tmp_path_factory, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf_cache")))


def _no_records(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a record was made")

    monkeypatch.setattr(RowReader, "example", refuse)


def test_a_text_only_table_gives_no_image_paths_without_making_records(tmp_path, monkeypatch):
    monkeypatch.setattr("vembed.data.tables.SMALL_JSON_BYTES", 0)  # mapped through datasets, as large files are
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"query": f"q{i}", "positive": f"p{i}", "negatives": [f"n{i}"]}) + "\n"
                            for i in range(50)))
    rows, _ = load_rows(DataConfig(train=str(path)), "train")
    _no_records(monkeypatch)
    monkeypatch.setattr("vembed.data.image_columns._column", lambda *a: pytest.fail("an image column was read"))
    assert image_paths(rows, None) == [] and rows.image_paths() == []


# Negatives pair texts and images by position; an empty pair is not a negative, and a record keeps the first
# `num_hard_negatives` of the rest. Row 1's first negative has no image; row 2's first pair is empty.
ROWS = [
    {"query": "q1", "query_image": "a.png", "positive": "p1", "negatives": ["n1", "", "n3"],
     "negative_images": [None, "b.png", "c.png"]},
    {"query": "q2", "positive": "p2", "positive_image": ["d.png", "e.png"], "negatives": ["", "m2"],
     "negative_images": [None, "f.png"]},
    {"query": "q3", "positive": "p3", "negatives": ["x", "y"], "negative_images": ["g.png"]},
    {"query": "q4", "query_image": "sub/h.png", "positive": "p4", "negatives": ["z", "w"],
     "negative_images": ["a.png", None]},
]


def _write(tmp_path, fmt):
    import pandas as pd
    from PIL import Image

    for name in ["a", "b", "c", "d", "e", "f", "g", "sub/h"]:
        (tmp_path / f"{name}.png").parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (4, 4), (9, 9, 9)).save(tmp_path / f"{name}.png")
    if fmt.startswith("jsonl"):
        path = tmp_path / "pairs.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
        return path
    frame = pd.DataFrame(ROWS)
    if fmt == "csv":
        for column in ("positive_image", "negatives", "negative_images"):
            frame[column] = [json.dumps(v) if isinstance(v, list) else v for v in frame[column]]
        frame.to_csv(tmp_path / "pairs.csv", index=False)
        return tmp_path / "pairs.csv"
    frame.to_parquet(tmp_path / "pairs.parquet")
    return tmp_path / "pairs.parquet"


@pytest.mark.parametrize("fmt", ["jsonl small", "jsonl mapped", "parquet", "csv"])
@pytest.mark.parametrize("negatives", [0, 1, 2])
def test_image_paths_from_the_columns_are_those_the_records_name(tmp_path, monkeypatch, fmt, negatives):
    if fmt != "jsonl small":
        monkeypatch.setattr("vembed.data.tables.SMALL_JSON_BYTES", 0)
    path = _write(tmp_path, fmt)
    config = DataConfig(train=str(path), num_hard_negatives=negatives, max_bad_fraction=0.5)
    rows, _ = load_rows(config, "train")
    walked = image_paths(list(rows), None)  # the records themselves
    expected = {0: "a d e h", 1: "a d e f g h", 2: "a b g h"}[negatives]  # 2: row 2 has one negative: skipped
    assert walked == sorted(str(tmp_path / (f"sub/{n}" if n == "h" else n)) + ".png" for n in expected.split())
    _no_records(monkeypatch)
    if fmt in ("jsonl mapped", "parquet"):  # Arrow list columns: whole-column kernels, not cell by cell
        monkeypatch.setattr("vembed.data.image_columns._negative_images_by_cell",
                            lambda *a: pytest.fail("negatives read cell by cell"))
    assert image_paths(rows, None) == walked


def test_image_cells_stored_as_bytes_and_path_give_their_files_and_embedded_bytes_none(tmp_path, monkeypatch):
    """The layout of a datasets Image feature ({bytes, path}); a cell with bytes is an embedded picture, no file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setattr("vembed.data.tables.SMALL_JSON_BYTES", 0)
    _write(tmp_path, "jsonl")
    files = [str(tmp_path / f"{n}.png") for n in ["a", "b", "c", "d"]]
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    embedded = {"bytes": (tmp_path / "g.png").read_bytes(), "path": None}
    table = pa.table({
        "query": ["q1", "q2", "q3"],
        "positive_image": pa.array([{"bytes": None, "path": files[0]}, embedded, {"bytes": None, "path": files[3]}],
                                   image),
        "negatives": [["x", "y"], ["z"], ["u"]],
        "negative_images": pa.array([[{"bytes": None, "path": files[2]}, {"bytes": None, "path": files[1]}],
                                     [{"bytes": None, "path": files[1]}], [None]], pa.list_(image)),
    })
    pq.write_table(table, tmp_path / "pairs.parquet")
    rows, _ = load_rows(DataConfig(train=str(tmp_path / "pairs.parquet"), num_hard_negatives=1), "train")
    walked = image_paths(list(rows), None)
    assert walked == files  # b only as the second row's negative: the first row keeps c, its first
    _no_records(monkeypatch)
    monkeypatch.setattr("vembed.data.image_columns._negative_images_by_cell",
                        lambda *a: pytest.fail("negatives read cell by cell"))
    assert image_paths(rows, None) == walked
