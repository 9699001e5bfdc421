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
        handle.write('{"_id": "d1", "text": "x"}\n\n{broken\n')
    with pytest.raises(DataError, match=r"corpus.jsonl, row 2: line 3 is not JSON"):  # rows: blank lines are none
        load_corpus_split(root, "test")
    with open(root / "corpus.jsonl", "w") as handle:
        handle.write('\n{"_id": "d1", "text": "x"}\n\n{"_id": "d2", "text": "y"}\n{"_id": "d1", "text": "z"}\n')
    with pytest.raises(DataError, match=r"corpus.jsonl, row 3: _id 'd1' repeats row 1's id"):
        load_corpus_split(root, "test")


@pytest.mark.parametrize("columns", [2, 5])  # a qrels row has 3 columns (4 in TREC's layout): one fewer, one more
def test_a_qrels_row_of_another_width_is_named(tmp_path, columns):
    root = _folder(tmp_path)
    qrels = root / "qrels" / "test.tsv"
    qrels.write_text(qrels.read_text() + "\t".join(["q1", "0", "d3", "1", "x"][:columns]) + "\n")
    rows = len(qrels.read_text().splitlines()) - 1  # its header line is not a row
    with pytest.raises(DataError, match=rf"test.tsv, row {rows}: has {columns} columns; a qrels row is query-id"):
        load_corpus_split(root, "test")


def test_qrels_rows_are_counted_under_the_header(tmp_path):
    root = _folder(tmp_path)
    qrels = root / "qrels" / "test.tsv"
    lines = qrels.read_text().splitlines()
    assert lines[0].split("\t")[-1] == "score"  # a header, then 4 judgements
    for score in ("high", "nan"):
        qrels.write_text("\n".join(lines[:3] + [f"q2\td2\t{score}"] + lines[3:]) + "\n")
        with pytest.raises(DataError, match=rf"test.tsv, row 3: score '{score}' is not a number"):
            load_corpus_split(root, "test")
    qrels.write_text("\n".join(lines[1:]) + "\n")  # no header: the first line is row 1
    assert load_corpus_split(root, "test").qrels["q1"] == {"d1": 2, "d2": 0}


# --- training pairs of a corpus folder -----------------------------------------------------------------------------


def test_corpus_pairs_are_one_record_per_relevant_document_with_negatives_by_id(tmp_path):
    from corpora import make_corpus_folder, write_negatives

    from vembed.data.corpus import CorpusPairs, read_hard_negatives

    split = load_corpus_split(make_corpus_folder(tmp_path / "c"), "train")
    negatives = read_hard_negatives(write_negatives(tmp_path / "negatives.jsonl"), split)
    pairs = CorpusPairs(split, negatives, num_negatives=2)
    ids = [pairs.ids(i) for i in range(len(pairs))]
    assert ids[:3] == [("q0", "d0", ["d1", "d3"]), ("q0", "d6", ["d7", "d9"]), ("q2", "d2", ["d3", "d5"])]
    assert ("q18", "d24", ["d19", "d20"]) in ids and ("q24", "d30", ["d25", "d27"]) in ids
    assert len(pairs) == pairs.total == 13  # every (query, grade > 0 document) judgement of qrels/train.tsv
    record = pairs[0]
    assert record.query.text == "a photo of a red square" and record.positive.text == "square a red square on blue"
    assert [n.text for n in record.negatives] == [split.corpus.sides[1].text, split.corpus.sides[3].text]
    assert record.positive.role == "document" and record.query.role == "query"
    # Relevance groups: one query's pairs, and queries sharing a relevant document (q18, q24: d24), share a label.
    label = {pair: pairs[i].label for i, pair in enumerate((q, d) for q, d, _ in ids)}
    assert label[("q0", "d0")] == label[("q0", "d6")]
    assert label[("q18", "d18")] == label[("q24", "d30")] != label[("q0", "d0")]
    assert len(set(label.values())) == 9
    # Pairs with fewer negatives than asked are left out (q0/d0 keeps 3 after dropping its relevant d6).
    three = CorpusPairs(split, negatives, 3)
    assert [three.ids(i)[:2] for i in range(len(three))] == [("q0", "d0"), ("q18", "d18"), ("q18", "d24")]
    assert three.too_few == 10


def test_bad_negative_rows_are_one_line(tmp_path):
    from corpora import make_corpus_folder

    from vembed.data.corpus import read_hard_negatives

    split = load_corpus_split(make_corpus_folder(tmp_path / "c"), "train")
    path = tmp_path / "negatives.jsonl"
    for text, words in (('{"query_id": "q0", "negative_ids": ["d1", "nope"]}', "row 1: negative 'nope' is not in"),
                        ('{"query_id": "q0"}', "row 1: needs 'query_id' and a list 'negative_ids'"),
                        ('{"query_id": "q0", "negative_ids": []}\n{"query_id": "q0", "negative_ids": ["d1"]}',
                         "row 2: repeats the negatives of query 'q0'")):
        path.write_text(text + "\n")
        with pytest.raises(DataError, match=words):
            read_hard_negatives(path, split)
