"""Corpus-format data (the BEIR layout): documents and queries by id, relevance judgements in TSV files.

    folder/corpus.jsonl  {"_id": "d1", "title": "...", "text": "...", "image": "img/d1.png"}  (title, image: optional)
    folder/queries.jsonl {"_id": "q1", "text": "...", "image": "..."}
    folder/qrels/<split>.tsv query-id <TAB> corpus-id <TAB> score   (a header line; graded: 0 = not relevant)

Documents are read once and referred to by position, never copied into every training row. A document's text is
`title + " " + text` when it has a title (as BEIR and sentence-transformers' InformationRetrievalEvaluator embed it).
Image paths are relative to the folder (or `image_root`).

Reading uses the standard library: one pass over each file, a few seconds per million documents. Bad rows are one
line naming the file and row (DataError), never skipped silently, because an id that vanishes changes every metric.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vembed.data.reader import row_number
from vembed.data.records import Side
from vembed.errors import DataError, RecipeError
from vembed.files import replace_atomically

if TYPE_CHECKING:
    from vembed.recipe import DataConfig

CORPUS_FILE = "corpus.jsonl"
QUERIES_FILE = "queries.jsonl"
QRELS_DIR = "qrels"
IMAGE_FIELDS = ("image", "image_path")  # the first present is a row's image


def is_corpus_folder(path: str | os.PathLike) -> bool:
    """True for a folder in the BEIR layout (corpus.jsonl, queries.jsonl and a qrels/ folder)."""
    root = Path(path)
    return (root / CORPUS_FILE).is_file() and (root / QUERIES_FILE).is_file() and (root / QRELS_DIR).is_dir()


def qrels_splits(path: str | os.PathLike) -> list[str]:
    """The splits a corpus folder judges (the names of its qrels/*.tsv files), sorted."""
    return sorted(p.stem for p in (Path(path) / QRELS_DIR).glob("*.tsv"))


@dataclass(frozen=True)
class CorpusSource:
    """A split (or one named source of it) that names a corpus folder: where, which qrels split, the recipe key."""

    name: str | None
    folder: str
    qrels_split: str
    image_root: str | None
    key: str  # the recipe key that sets qrels_split, for messages

    def check(self) -> None:
        """The folder judges `qrels_split` (one line naming the key and the splits it has, before anything loads)."""
        if not (Path(self.folder) / QRELS_DIR / f"{self.qrels_split}.tsv").is_file():
            have = ", ".join(qrels_splits(self.folder)) or "none"
            raise RecipeError(self.key, f"corpus folder {self.folder} has no {QRELS_DIR}/{self.qrels_split}.tsv "
                                        f"(splits here: {have}); set {self.key} to one of them")

    def load(self) -> "CorpusSplit":
        return load_corpus_split(self.folder, self.qrels_split, self.image_root, key=self.key)


def corpus_sources(data: "DataConfig", split: str) -> "dict[str | None, CorpusSource]":
    """The parts of `data.<split>` that are corpus folders: `{None: ...}` for a split that is one folder, else the
    named sources whose `files` is one (keyed by name). Other parts (pair files) are not listed."""
    value = getattr(data, split)
    sources = data.sources(split)
    if sources is None:
        if _one_folder(value):
            return {None: CorpusSource(None, str(value), getattr(data.qrels_splits, split), data.image_root,
                                       f"data.qrels_splits.{split}")}
        return {}
    return {name: CorpusSource(name, str(source.files), source.qrels_split, source.image_root,
                               f"data.{split}.{name}.qrels_split")
            for name, source in sources.items() if _one_folder(source.files)}


def _one_folder(value: Any) -> bool:
    return isinstance(value, (str, os.PathLike)) and is_corpus_folder(value)


@dataclass
class Corpus:
    """Documents or queries of a corpus folder: ids and sides in file order; `index` maps an id to its position."""

    ids: list[str]
    sides: list[Side]
    index: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.index:
            self.index = {item_id: i for i, item_id in enumerate(self.ids)}

    def __len__(self) -> int:
        return len(self.ids)


@dataclass
class CorpusSplit:
    """One split of a corpus folder: the whole corpus, the queries judged in this split, and graded qrels.

    `qrels[query_id][doc_id]` is the graded relevance (> 0 relevant; 0 and negative are judged not relevant, as in
    trec_eval). `queries` holds only the queries that have at least one judgement in the split, in file order.
    """

    folder: str
    split: str
    corpus: Corpus
    queries: Corpus
    qrels: dict[str, dict[str, int]]

    def relevant(self, query_id: str) -> dict[str, int]:
        """The documents relevant to `query_id` (grade > 0) with their grades."""
        return {doc: grade for doc, grade in self.qrels.get(query_id, {}).items() if grade > 0}


def _jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    """(row number, object) of each non-blank line: rows are numbered as every data message numbers them
    (reader.row_number: blank lines are no rows); a line that does not parse says its line too."""
    with open(path, encoding="utf-8") as handle:
        position = 0
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            number, position = row_number(position), position + 1
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"line {line_number} is not JSON ({err.msg}); each line must be one JSON object",
                                str(path), number) from None
            if not isinstance(row, dict):
                raise DataError(f"is {type(row).__name__}, not a JSON object with _id and text", str(path), number)
            yield number, row


def _side(row: dict, path: Path, line_number: int, image_base: Path, role: str, with_title: bool) -> Side:
    text = row.get("text")
    if text is not None and not isinstance(text, str):
        raise DataError(f"'text' is {type(text).__name__}; give text as a string", str(path), line_number)
    title = row.get("title") if with_title else None
    if title:
        text = f"{title} {text}".strip() if text else str(title)
    image = next((row[key] for key in IMAGE_FIELDS if row.get(key)), None)
    if image is not None:
        if not isinstance(image, str):
            raise DataError("'image' must be a file path", str(path), line_number)
        image = str(image_base / image) if not os.path.isabs(image) else image
        if not os.path.isfile(image):
            raise DataError(f"image {image} not found; check the path or image_root", str(path), line_number)
    side = Side(text=text or None, image=image, role=role)
    if side.is_empty:
        raise DataError("has neither text nor image", str(path), line_number)
    return side


def read_items(path: str | os.PathLike, role: str, image_root: str | os.PathLike | None = None,
               wanted: set[str] | None = None) -> Corpus:
    """The rows of corpus.jsonl or queries.jsonl as a Corpus (ids must be unique). `wanted`: keep only these ids."""
    path = Path(path)
    image_base = Path(image_root) if image_root is not None else path.parent
    ids: list[str] = []
    sides: list[Side] = []
    index: dict[str, int] = {}
    rows: dict[str, int] = {}  # id -> its row, for the error naming a repeated id
    for line_number, row in _jsonl(path):
        if "_id" not in row:
            raise DataError("has no '_id'; every row of a corpus folder needs one", str(path), line_number)
        item_id = str(row["_id"])
        if wanted is not None and item_id not in wanted:
            continue
        if item_id in index:
            raise DataError(f"_id {item_id!r} repeats row {rows[item_id]}'s id; ids must be unique", str(path),
                            line_number)
        index[item_id], rows[item_id] = len(ids), line_number
        ids.append(item_id)
        sides.append(_side(row, path, line_number, image_base, role, with_title=role == "document"))
    if not ids and wanted is None:
        raise DataError("holds no rows", str(path))
    return Corpus(ids, sides, index)


def read_qrels(path: str | os.PathLike) -> dict[str, dict[str, int]]:
    """`query-id corpus-id score` rows of a TSV file (a header line is recognised and skipped) as nested dicts. Rows
    are numbered as every data message numbers them (reader.row_number): the header and blank lines are no rows."""
    path = Path(path)
    qrels: dict[str, dict[str, int]] = {}
    with open(path, encoding="utf-8", newline="") as handle:
        position = 0
        for line_number, cells in enumerate(csv.reader(handle, delimiter="\t"), start=1):
            if not cells or not "".join(cells).strip():
                continue
            if line_number == 1 and len(cells) in (3, 4) and _grade(cells[-1]) is None:
                continue  # the header
            number, position = row_number(position), position + 1
            if len(cells) == 4:  # TREC qrels: query 0 document grade
                cells = [cells[0], cells[2], cells[3]]
            if len(cells) != 3:
                raise DataError(f"has {len(cells)} columns; a qrels row is query-id, corpus-id, score", str(path),
                                number)
            grade = _grade(cells[2])
            if grade is None:
                raise DataError(f"score {cells[2]!r} is not a number", str(path), number)
            qrels.setdefault(cells[0].strip(), {})[cells[1].strip()] = grade
    if not qrels:
        raise DataError("holds no judgements", str(path))
    return qrels


def _grade(text: str) -> int | None:
    """A qrels score cell as an integer grade; None when it is not a finite number (a header's `score`, NaN)."""
    try:
        number = float(text)
    except ValueError:
        return None
    return int(number) if math.isfinite(number) else None


def load_corpus_split(folder: str | os.PathLike, split: str, image_root: str | os.PathLike | None = None,
                      key: str = "data") -> CorpusSplit:
    """Read a corpus folder's documents, the queries judged in `split`, and that split's qrels.

    Every judged query and document id must exist (a DataError names the first that does not): a qrels file that
    points past the corpus would otherwise lower every metric without a word.
    """
    root = Path(folder)
    if not is_corpus_folder(root):
        raise DataError(f"is not a corpus folder: it needs {CORPUS_FILE}, {QUERIES_FILE} and {QRELS_DIR}/<split>.tsv",
                        str(root))
    qrels_path = root / QRELS_DIR / f"{split}.tsv"
    if not qrels_path.is_file():
        have = ", ".join(qrels_splits(root)) or "none"
        raise DataError(f"has no {QRELS_DIR}/{split}.tsv (splits here: {have}); name a split it judges ({key})",
                        str(root))
    qrels = read_qrels(qrels_path)
    corpus = read_items(root / CORPUS_FILE, "document", image_root)
    queries = read_items(root / QUERIES_FILE, "query", image_root, wanted=set(qrels))
    missing_queries = [q for q in qrels if q not in queries.index]
    if missing_queries:
        raise DataError(f"judges query {missing_queries[0]!r} ({len(missing_queries)} in all), which "
                        f"{QUERIES_FILE} does not have", str(qrels_path))
    missing_docs = sorted({d for judged in qrels.values() for d in judged if d not in corpus.index})
    if missing_docs:
        raise DataError(f"judges document {missing_docs[0]!r} ({len(missing_docs)} in all), which {CORPUS_FILE} "
                        "does not have", str(qrels_path))
    return CorpusSplit(str(root), split, corpus, queries, qrels)


def write_corpus_folder(folder: str | os.PathLike, documents: dict[str, dict], queries: dict[str, dict],
                        qrels: dict[str, dict[str, dict[str, int]]]) -> Path:
    """Write a corpus folder: `documents`/`queries` map ids to rows (text, title, image); `qrels[split][q][d] = grade`.

    Used by the offline generators and the tests; files are written whole, then renamed into place.
    """
    root = Path(folder)
    (root / QRELS_DIR).mkdir(parents=True, exist_ok=True)

    def write(path: Path, text: str) -> None:
        replace_atomically(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))

    def lines(items: dict[str, dict]) -> str:
        return "".join(json.dumps({"_id": item_id, **row}, ensure_ascii=False) + "\n" for item_id, row in items.items())

    write(root / CORPUS_FILE, lines(documents))
    write(root / QUERIES_FILE, lines(queries))
    for split, judged in qrels.items():
        rows = ["query-id\tcorpus-id\tscore\n"]
        rows += [f"{q}\t{d}\t{grade}\n" for q, docs in judged.items() for d, grade in docs.items()]
        write(root / QRELS_DIR / f"{split}.tsv", "".join(rows))
    return root


# --- training on a corpus folder -----------------------------------------------------------------------------------


def read_hard_negatives(path: str | os.PathLike, split: CorpusSplit) -> dict[tuple[str, str | None], list[int]]:
    """Mined negatives by id, one JSONL row per query (or per query and positive):
    `{"query_id": "q1", "positive_id": "d1", "negative_ids": ["d7", "d9"]}` (`positive_ids`: a list; neither: the
    negatives of every positive of the query). Returns `{(query_id, positive_id or None): corpus positions}`.

    Unknown ids are a DataError naming the row; negatives the qrels judge relevant to the query are dropped (a mined
    "negative" that is a known positive would teach the model the opposite of the judgement).
    """
    path = Path(path)
    found: dict[tuple[str, str | None], list[int]] = {}
    for line_number, row in _jsonl(path):
        query = row.get("query_id")
        negatives = row.get("negative_ids")
        if query is None or not isinstance(negatives, list):
            raise DataError("needs 'query_id' and a list 'negative_ids'", str(path), line_number)
        query = str(query)
        positives = row.get("positive_ids", [row["positive_id"]] if row.get("positive_id") is not None else [None])
        if not isinstance(positives, list):
            raise DataError("'positive_ids' must be a list of corpus ids", str(path), line_number)
        relevant = split.relevant(query)
        positions = []
        for negative in map(str, negatives):
            if negative not in split.corpus.index:
                raise DataError(f"negative {negative!r} is not in {CORPUS_FILE}", str(path), line_number)
            if negative not in relevant:
                positions.append(split.corpus.index[negative])
        for positive in positives:
            key = (query, None if positive is None else str(positive))
            if key in found:
                raise DataError(f"repeats the negatives of query {query!r}"
                                + (f", positive {key[1]!r}" if key[1] else ""), str(path), line_number)
            found[key] = positions
    return found


class CorpusPairs:
    """`Sequence[Example]` of a corpus folder's training split: one record per (query, relevant document) pair,
    made on fetch from the one copy of the corpus (documents are referred to by position, never copied per row).

    One record per pair, not per query: every judged positive is trained on each epoch, the samplers see a fixed
    number of records, and pairs behave as the rows of a pairs file would. A record's `label` is its relevance group
    (queries and documents connected by judgements, `data.mask_same_label`): two queries sharing a relevant
    document, or one query's pairs, are not each other's in-batch negatives.
    """

    def __init__(self, split: CorpusSplit, negatives: dict[tuple[str, str | None], list[int]] | None = None,
                 num_negatives: int = 0, source_name: str | None = None):
        import numpy as np

        self.split, self.num_negatives, self.source_name = split, num_negatives, source_name
        pairs = [(split.queries.index[q], split.corpus.index[d], q, d)
                 for q in split.queries.ids for d, grade in split.qrels[q].items() if grade > 0]
        groups = _relevance_groups([(q, d) for _, _, q, d in pairs])
        kept, self.too_few = [], 0
        negative_rows: list[list[int]] = []
        for query_pos, doc_pos, q, d in pairs:
            found = (negatives or {}).get((q, d), (negatives or {}).get((q, None), []))
            if len(found) < num_negatives:
                self.too_few += 1
                continue
            kept.append((query_pos, doc_pos, groups[q]))
            negative_rows.append(found[:num_negatives])
        self.total = len(pairs)
        self.queries = np.asarray([k[0] for k in kept], dtype=np.int64)
        self.documents = np.asarray([k[1] for k in kept], dtype=np.int64)
        self.groups = np.asarray([k[2] for k in kept], dtype=np.int64)
        self.negatives = np.asarray(negative_rows, dtype=np.int64).reshape(len(kept), num_negatives)

    def __len__(self) -> int:
        return len(self.queries)

    # What a loss needs of the training rows (vembed/losses/inputs.py), as PairRows answers it: a corpus folder's
    # pairs keep `num_negatives` mined negatives each and carry no score column.
    def negative_counts(self) -> set[int]:
        return {self.num_negatives}

    def score_shapes(self) -> tuple[int, int, int]:
        return len(self), 0, 0

    def first_score(self, shape: str) -> Any:
        from vembed.data.rows import ScoreCell

        # a corpus folder has no score column: its pairs are judgements
        return ScoreCell(self.split.folder, None, None) if shape == "none" and len(self) else None

    def unlabelled_records(self) -> tuple[int, int | None]:
        return 0, None  # every pair's label is its relevance group

    def __getitem__(self, index: Any) -> Any:
        from dataclasses import replace

        from vembed.data.records import Example

        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        sides = self.split.corpus.sides
        query = self.split.queries.sides[int(self.queries[index])]
        # Copies of the sides (small: text and a path), so a collator that edits one cannot change the corpus.
        return Example(query=replace(query), positive=replace(sides[int(self.documents[index])]),
                       negatives=[replace(sides[int(i)]) for i in self.negatives[index]],
                       label=f"corpus-group-{int(self.groups[index])}", row=int(index) + 1,
                       source=self.split.folder, source_name=self.source_name)

    def source_ranges(self) -> list[tuple[str | None, int, int]]:
        return [(self.source_name, 0, len(self))]

    def ids(self, index: int) -> tuple[str, str, list[str]]:
        """(query id, positive id, negative ids) of record `index`, for reports and tests."""
        corpus = self.split.corpus.ids
        return (self.split.queries.ids[int(self.queries[index])], corpus[int(self.documents[index])],
                [corpus[int(i)] for i in self.negatives[index]])

    # What the run checks over every record, from the corpus (no record is made).
    def every_record_has(self, modalities: frozenset[str]) -> bool:
        used = [self.split.queries.sides[int(i)] for i in set(self.queries.tolist())]
        used += [self.split.corpus.sides[int(i)] for i in set(self.documents.tolist())]
        have = {"text": all(s.text for s in used), "image": all(s.image for s in used)}
        return all(have[m] for m in modalities) if used else False

    def most_images_per_side(self) -> tuple[int, int | None]:
        return (1, 0) if any(s.image for s in self.split.corpus.sides + self.split.queries.sides) else (0, None)

    def image_paths(self) -> list[str]:
        """Every image file the records use, once each, sorted: from the queries and documents the pairs refer to,
        not from one record per pair."""
        import numpy as np

        queries = [self.split.queries.sides[int(i)] for i in np.unique(self.queries)]
        documents = [self.split.corpus.sides[int(i)] for i in np.unique(np.concatenate(
            [self.documents, self.negatives.reshape(-1)]))]
        return sorted({image for side in queries + documents for image in side.images if isinstance(image, str)})

    def duplicate_keys(self) -> tuple[Any, Any]:
        """Per record, ids of the items it holds (query, positive, negatives): equal ids for the same query or document,
        what the no-duplicates sampler compares."""
        import numpy as np

        n_docs = len(self.split.corpus)
        keys = np.concatenate([self.queries[:, None] + n_docs, self.documents[:, None], self.negatives], axis=1)
        width = keys.shape[1]
        return np.arange(0, len(keys) * width + 1, width, dtype=np.int64), keys.reshape(-1)


def _relevance_groups(pairs: list[tuple[str, str]]) -> dict[str, int]:
    """Each query's connected component of the query-document judgement graph (union-find), numbered from 0."""
    parent: dict[str, str] = {}

    def find(item: str) -> str:
        while parent.setdefault(item, item) != item:
            parent[item] = parent[parent[item]]
            item = parent[item]
        return item

    for query, doc in pairs:
        parent[find("q:" + query)] = find("d:" + doc)
    numbers: dict[str, int] = {}
    return {query: numbers.setdefault(find("q:" + query), len(numbers)) for query, _ in pairs}
