"""The score column (data.columns.score): a number per pair or a list of teacher scores, read by the row checks and
the records alike, and refused with one line naming the row when it is text, outside data.score_range, or a list of
the wrong length."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from data_files import write_jsonl as _jsonl
from data_files import write_parquet as _parquet

from vembed.data.collate import score_tensor
from vembed.data.sources import load_rows
from vembed.errors import DataError
from vembed.recipe import DataConfig


PAIRS = [{"query": f"a{i}", "positive": f"b{i}", "score": s} for i, s in enumerate([0.0, 2.5, 5, 4.25])]
CANDIDATES = [{"query": f"q{i}", "positive": f"p{i}", "negatives": [f"n{i}a", f"n{i}b"],
               "score": [9.0 - i, 1.0, -2.0 + i]} for i in range(4)]


@pytest.mark.parametrize("write", [_jsonl, _parquet], ids=["jsonl", "parquet"])
def test_a_number_per_pair_reaches_the_records_and_the_batch(tmp_path, write):
    path = write(tmp_path / f"pairs.{'jsonl' if write is _jsonl else 'parquet'}", PAIRS)
    rows, _ = load_rows(DataConfig(train=str(path), score_range=(0, 5)), "train")
    assert [example.score for example in rows] == [0.0, 2.5, 5.0, 4.25]
    assert rows.score_shapes() == (0, 4, 0)
    assert torch.equal(score_tensor(list(rows)), torch.tensor([0.0, 2.5, 5.0, 4.25]))


@pytest.mark.parametrize("write", [_jsonl, _parquet], ids=["jsonl", "parquet"])
def test_teacher_score_lists_are_cut_with_the_negatives(tmp_path, write):
    path = write(tmp_path / f"c.{'jsonl' if write is _jsonl else 'parquet'}", CANDIDATES)
    rows, _ = load_rows(DataConfig(train=str(path)), "train")
    assert rows.score_shapes() == (0, 0, 4)
    assert score_tensor(list(rows)).shape == (4, 3)
    one, _ = load_rows(DataConfig(train=str(path), num_hard_negatives=1), "train")
    assert [example.score for example in one] == [[9.0 - i, 1.0] for i in range(4)]


def test_a_csv_cell_may_hold_the_list_as_json(tmp_path):
    path = tmp_path / "c.csv"
    path.write_text('query,positive,negatives,score\nq,p,"[""n""]","[0.5, 0.25]"\n')
    rows, _ = load_rows(DataConfig(train=str(path)), "train")
    assert rows[0].score == [0.5, 0.25]


@pytest.mark.parametrize("write", [_jsonl, _parquet], ids=["jsonl", "parquet"])
def test_a_score_column_with_text_stops_naming_the_row(tmp_path, write):
    rows = [dict(row) for row in PAIRS]
    rows[2]["score"] = "high"
    if write is _parquet:
        for row in rows:
            row["score"] = str(row["score"])
    path = write(tmp_path / f"t.{'jsonl' if write is _jsonl else 'parquet'}", rows)
    with pytest.raises(DataError) as found:
        load_rows(DataConfig(train=str(path)), "train")
    message = str(found.value)
    assert "data.columns.score" in message and "not a number" in message
    assert f"row {1 if write is _parquet else 3}" in message  # parquet: every cell is text, the first row says so


@pytest.mark.parametrize("write", [_jsonl, _parquet], ids=["jsonl", "parquet"])
def test_scores_outside_the_declared_range_stop_naming_the_row(tmp_path, write):
    path = write(tmp_path / f"r.{'jsonl' if write is _jsonl else 'parquet'}", PAIRS)
    with pytest.raises(DataError, match=r"row 2: .*score 2.5 is outside data.score_range \[0, 1\] \(3 such rows\)"):
        load_rows(DataConfig(train=str(path), score_range=(0, 1)), "train")


@pytest.mark.parametrize("write", [_jsonl, _parquet], ids=["jsonl", "parquet"])
@pytest.mark.parametrize("count", [2, 4], ids=["fewer", "more"])  # one short of 1 + 2 negatives and one over
def test_a_teacher_score_list_of_the_wrong_length_stops_naming_the_row(tmp_path, write, count):
    rows = [dict(row) for row in CANDIDATES]
    rows[1]["score"] = [1.0, 2.0, 3.0, 4.0][:count]
    path = write(tmp_path / f"w.{'jsonl' if write is _jsonl else 'parquet'}", rows)
    with pytest.raises(DataError, match=rf"row 2: .*a list of {count} teacher scores for a row with 2 hard negatives"):
        load_rows(DataConfig(train=str(path)), "train")


# --- the candidate-list shape: {"query", "documents": [positive, negatives...], "scores": [...]} ---------------------
LISTS = [{"query": f"q{i}", "documents": [f"p{i}", f"n{i}a", f"n{i}b"], "scores": [9.0 - i, 1.0, -2.0 + i]}
         for i in range(4)]


def _csv(path: Path, rows: list[dict]) -> Path:
    import csv

    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows({key: json.dumps(value) if isinstance(value, list) else value for key, value in row.items()}
                         for row in rows)
    return path


@pytest.mark.parametrize("write", [_jsonl, _parquet, _csv], ids=["jsonl", "parquet", "csv"])
def test_a_documents_list_is_the_positive_then_the_negatives_with_its_scores(tmp_path, write):
    path = write(tmp_path / f"lists.{write.__name__.rsplit('_', 1)[-1]}", LISTS)
    rows, report = load_rows(DataConfig(train=str(path)), "train")
    assert [(e.query.text, e.positive.text, [n.text for n in e.negatives], e.score) for e in rows] == [
        (f"q{i}", f"p{i}", [f"n{i}a", f"n{i}b"], [9.0 - i, 1.0, -2.0 + i]) for i in range(4)]
    assert rows.score_shapes() == (0, 0, 4) and report.num_hard_negatives == 2
    one, _ = load_rows(DataConfig(train=str(path), num_hard_negatives=1), "train")  # cut with the negatives
    assert [e.score for e in one] == [[9.0 - i, 1.0] for i in range(4)]


def test_a_documents_list_without_scores_is_contrastive_pairs_and_data_columns_maps_it(tmp_path):
    rows = [{"question": "q", "candidates": ["p", "n1", "n2"]}, {"question": "r", "candidates": ["s", "m1", "m2"]}]
    path = _jsonl(tmp_path / "c.jsonl", rows)
    config = DataConfig(train=str(path), columns={"query": "question", "documents": "candidates"})
    loaded, _ = load_rows(config, "train")
    assert [(e.positive.text, [n.text for n in e.negatives], e.score) for e in loaded] == [
        ("p", ["n1", "n2"], None), ("s", ["m1", "m2"], None)]


@pytest.mark.parametrize("write", [_jsonl, _parquet, _csv], ids=["jsonl", "parquet", "csv"])
@pytest.mark.parametrize("count", [2, 4], ids=["fewer", "more"])  # one short of the documents and one over
def test_scores_of_another_length_than_the_documents_stop_naming_the_file_and_row(tmp_path, write, count):
    rows = [dict(row) for row in LISTS]
    rows[2]["scores"] = [1.0, 2.0, 3.0, 4.0][:count]
    path = write(tmp_path / f"w.{write.__name__.rsplit('_', 1)[-1]}", rows)
    with pytest.raises(DataError) as found:
        load_rows(DataConfig(train=str(path)), "train")
    message = str(found.value)
    assert message.startswith(f"data error: {path}, row 3: data.columns.score ('scores'): {count} teacher scores for "
                              "3 documents") and "\n" not in message


def test_a_documents_list_beside_a_negatives_column_is_refused(tmp_path):
    path = _jsonl(tmp_path / "both.jsonl", [dict(LISTS[0], negatives=["x"])])
    with pytest.raises(DataError, match="give one of them") as found:
        load_rows(DataConfig(train=str(path)), "train")
    assert str(path) in str(found.value)


def test_a_file_with_a_positive_column_is_ordinary_pairs_whatever_else_it_holds(tmp_path):
    path = _jsonl(tmp_path / "pairs.jsonl", [{"query": "q", "positive": "p", "documents": ["x", "y"]}])
    rows, _ = load_rows(DataConfig(train=str(path)), "train")
    assert (rows[0].positive.text, rows[0].negatives) == ("p", [])


def test_the_score_column_the_recipe_names_wins_over_scores(tmp_path):
    path = _jsonl(tmp_path / "t.jsonl", [dict(LISTS[0], teacher=[1.0, 2.0, 3.0])])
    rows, _ = load_rows(DataConfig(train=str(path), columns={"score": "teacher"}), "train")
    assert rows[0].score == [1.0, 2.0, 3.0]


def test_an_empty_documents_list_is_a_row_without_a_positive(tmp_path):
    path = _jsonl(tmp_path / "e.jsonl", [*LISTS, {"query": "q", "documents": [], "scores": []}])
    rows, report = load_rows(DataConfig(train=str(path), max_bad_fraction=0.5), "train")
    assert len(rows) == 4 and report.skipped == {"empty_positive": 1}
