"""Corpus-format (BEIR layout) folders: documents and queries by id, graded qrels, bad rows named."""

from __future__ import annotations

import pytest

from vembed.data.corpus import is_corpus_folder, load_corpus_split, qrels_splits, write_corpus_folder
from vembed.errors import DataError


def _folder(tmp_path, **changes):
    documents = {"d1": {"title": "Cats", "text": "Cats purr."}, "d2": {"text": "Dogs bark."},
                 "d3": {"text": "Fish swim.", "image": "fish.png"}}
    queries = {"q1": {"text": "what purrs"}, "q2": {"text": "what barks"}, "q3": {"text": "unjudged"}}
    qrels = {"test": {"q1": {"d1": 2, "d2": 0}, "q2": {"d2": 1, "d3": 1}}, "train": {"q3": {"d3": 1}}}
    args = {"documents": documents, "queries": queries, "qrels": qrels, **changes}
    (tmp_path / "fish.png").write_bytes(b"not read here")
    return write_corpus_folder(tmp_path, **args)


def test_a_split_reads_its_judged_queries_graded_qrels_and_the_whole_corpus(tmp_path):
    root = _folder(tmp_path)
    assert is_corpus_folder(root) and qrels_splits(root) == ["test", "train"]
    split = load_corpus_split(root, "test")
    assert split.corpus.ids == ["d1", "d2", "d3"]
    assert split.corpus.sides[0].text == "Cats Cats purr." and split.corpus.sides[0].role == "document"
    assert split.corpus.sides[2].image == str(tmp_path / "fish.png")
    assert split.queries.ids == ["q1", "q2"]  # q3 is judged only in train
    assert split.queries.sides[1].text == "what barks" and split.queries.sides[1].role == "query"
    assert split.qrels["q1"] == {"d1": 2, "d2": 0}
    assert split.relevant("q1") == {"d1": 2}  # grade 0 is judged, not relevant
    assert split.corpus.index["d2"] == 1


@pytest.mark.parametrize("change, words", [
    ({"qrels": {"test": {"q1": {"d9": 1}}}}, "judges document 'd9'"),
    ({"qrels": {"test": {"q9": {"d1": 1}}}}, "judges query 'q9'"),
    ({"documents": {"d1": {"text": 3}}}, "'text' is int"),
    ({"documents": {"d1": {"title": ""}}}, "has neither text nor image"),
])
def test_bad_folders_are_one_line_naming_file_and_row(tmp_path, change, words):
    with pytest.raises(DataError, match=words):
        load_corpus_split(_folder(tmp_path, **change), "test")


def test_duplicate_ids_missing_split_and_broken_lines_are_named(tmp_path):
    root = _folder(tmp_path)
    with pytest.raises(DataError, match=r"no qrels/dev.tsv \(splits here: test, train\)"):
        load_corpus_split(root, "dev")
    with open(root / "corpus.jsonl", "a") as handle:
        handle.write('{"_id": "d2", "text": "again"}\n')
    with pytest.raises(DataError, match=r"corpus.jsonl, row 4: _id 'd2' repeats row 2"):
        load_corpus_split(root, "test")
    with open(root / "corpus.jsonl", "w") as handle:
        handle.write('{"_id": "d1", "text": "x"}\n{broken\n')
    with pytest.raises(DataError, match=r"row 2: not JSON"):
        load_corpus_split(root, "test")
