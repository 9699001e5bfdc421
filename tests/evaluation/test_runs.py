"""Run files: TREC lines read back exactly as written, in trec_eval's order (ties by document id descending), JSONL
rows with texts, and each malformed file named at its line."""

from __future__ import annotations

import json

import pytest

from vembed.data.corpus import Corpus, CorpusSplit
from vembed.data.records import Side
from vembed.errors import DataError
from vembed.evaluation.runs import check_documents_in_corpus, cut, ranked, read_run, write_run


def _split() -> CorpusSplit:
    corpus = Corpus(["d1", "d2", "d10"], [Side(text="one"), Side(text="two"), Side(image="ten.png")])
    queries = Corpus(["q1", "q2"], [Side(text="first?"), Side(text="second?")])
    return CorpusSplit("corpus", "test", corpus, queries, {"q1": {"d1": 1}, "q2": {"d2": 1}})


def test_a_written_run_reads_back_exactly_in_trec_eval_order(tmp_path):
    run = {"q1": {"d1": 0.5, "d10": 0.5, "d2": 0.75}, "q2": {"d2": 1 / 3}}
    path = write_run(tmp_path / "run.trec", run, tag="mine")
    lines = [line.split() for line in path.read_text().splitlines()]
    # Equal scores: document id descending as strings ("d10" < "d1"? no: "d10" > "d1"), as trec_eval sorts them.
    assert [(q, d, r) for q, _, d, r, _, _ in lines] == [("q1", "d2", "1"), ("q1", "d10", "2"), ("q1", "d1", "3"),
                                                         ("q2", "d2", "1")]
    assert {line[1] for line in lines} == {"Q0"} and {line[5] for line in lines} == {"mine"}
    assert read_run(path) == run  # every score exactly (repr keeps all digits)
    assert ranked(run, 2) == {"q1": [("d2", 0.75), ("d10", 0.5)], "q2": [("d2", 1 / 3)]}
    assert cut(run, 1) == {"q1": {"d2": 0.75}, "q2": {"d2": 1 / 3}}


def test_jsonl_rows_carry_both_texts_and_an_image_documents_path(tmp_path):
    path = write_run(tmp_path / "run.jsonl", {"q1": {"d10": 2.0, "d1": 1.0}}, format="jsonl", split=_split())
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [{"query_id": "q1", "doc_id": "d10", "rank": 1, "score": 2.0, "query": "first?",
                     "document": "ten.png"},
                    {"query_id": "q1", "doc_id": "d1", "rank": 2, "score": 1.0, "query": "first?",
                     "document": "one"}]
    bare = write_run(tmp_path / "bare.jsonl", {"q1": {"d1": 1.0}}, format="jsonl")
    assert json.loads(bare.read_text()) == {"query_id": "q1", "doc_id": "d1", "rank": 1, "score": 1.0}


def test_jsonl_keeps_text_as_written_names_every_image_and_leaves_unknown_ids_empty(tmp_path):
    split = _split()
    split.corpus.sides[0] = Side(text="café über")
    split.corpus.sides[2] = Side(image=["p1.png", "p2.png"])
    path = write_run(tmp_path / "run.jsonl", {"q1": {"d1": 2.0, "d10": 1.0}, "q9": {"d1": 0.5}}, format="jsonl",
                     split=split)
    text = path.read_text(encoding="utf-8")
    assert "café über" in text  # readable, not \u escapes
    rows = [json.loads(line) for line in text.splitlines()]
    assert [row["document"] for row in rows] == ["café über", "p1.png, p2.png", "café über"]
    assert rows[2]["query"] is None  # a query the split does not hold


@pytest.mark.parametrize("tag, format", [("two words", "trec"), ("", "trec"), ("x", "xml")])
def test_a_bad_tag_or_format_writes_nothing(tmp_path, tag, format):
    with pytest.raises(ValueError):
        write_run(tmp_path / "run.trec", {"q": {"d": 1.0}}, tag=tag, format=format)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("text, message, row", [
    ("q Q0 d 1 1.0 t\nq Q0 e 2 x t\n", "is not a TREC run line", 2),
    ("q Q0 d 1 1.0\n", "is not a TREC run line", 1),
    ("q Q0 d 1 1.0 t extra\n", "is not a TREC run line", 1),
    ("q Q0 d 1 1.0 t\n\nq Q0 d 2 0.5 t\n", "document 'd' is listed twice for query 'q'", 3),
    ("q Q0 d 1 nan t\n", "score 'nan' is not a finite number", 1),
    ("q Q0 d 1 inf t\n", "score 'inf' is not a finite number", 1),
    ("\n\n", "holds no run line", None),
])
def test_a_malformed_run_is_named_at_its_line(tmp_path, text, message, row):
    path = tmp_path / "run.trec"
    path.write_text(text)
    with pytest.raises(DataError) as error:
        read_run(path)
    assert message in str(error.value) and error.value.row == row and error.value.file == str(path)


def test_blank_lines_are_skipped_and_the_same_document_may_serve_two_queries(tmp_path):
    path = tmp_path / "run.trec"
    path.write_text("\nq1 Q0 d 1 1.5 t\n\nq2 Q0 d 1 -2 t\n")
    assert read_run(path) == {"q1": {"d": 1.5}, "q2": {"d": -2.0}}


def test_a_document_the_corpus_lacks_is_named_with_its_query(tmp_path):
    check_documents_in_corpus({"q1": {"d1": 1.0, "d10": 0.5}}, _split(), "run.trec")  # all there: no error
    with pytest.raises(DataError, match=r"run.trec: document 'd3' \(query 'q2'\) is not in corpus/corpus.jsonl"):
        check_documents_in_corpus({"q1": {"d1": 1.0}, "q2": {"d2": 1.0, "d3": 0.5}}, _split(), "run.trec")


def test_a_run_is_written_into_a_folder_that_does_not_exist_yet(tmp_path):
    path = write_run(tmp_path / "runs" / "dev" / "run.trec", {"q": {"d": 1.0}})
    assert read_run(path) == {"q": {"d": 1.0}}
