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
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vembed.data.records import Side
from vembed.errors import DataError, RecipeError

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
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"not JSON ({err.msg}); each line must be one JSON object", str(path),
                                line_number) from None
            if not isinstance(row, dict):
                raise DataError(f"is {type(row).__name__}, not a JSON object with _id and text", str(path),
                                line_number)
            yield line_number, row


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
    for line_number, row in _jsonl(path):
        if "_id" not in row:
            raise DataError("has no '_id'; every row of a corpus folder needs one", str(path), line_number)
        item_id = str(row["_id"])
        if wanted is not None and item_id not in wanted:
            continue
        if item_id in index:
            raise DataError(f"_id {item_id!r} repeats row {index[item_id] + 1}'s id; ids must be unique", str(path),
                            line_number)
        index[item_id] = len(ids)
        ids.append(item_id)
        sides.append(_side(row, path, line_number, image_base, role, with_title=role == "document"))
    if not ids and wanted is None:
        raise DataError("holds no rows", str(path))
    return Corpus(ids, sides, index)


def read_qrels(path: str | os.PathLike) -> dict[str, dict[str, int]]:
    """`query-id corpus-id score` rows of a TSV file (a header line is recognised and skipped) as nested dicts."""
    path = Path(path)
    qrels: dict[str, dict[str, int]] = {}
    with open(path, encoding="utf-8", newline="") as handle:
        for line_number, cells in enumerate(csv.reader(handle, delimiter="\t"), start=1):
            if not cells or not "".join(cells).strip():
                continue
            if len(cells) == 4:  # TREC qrels: query 0 document grade
                cells = [cells[0], cells[2], cells[3]]
            if len(cells) != 3:
                raise DataError(f"has {len(cells)} columns; a qrels row is query-id, corpus-id, score", str(path),
                                line_number)
            try:
                grade = int(float(cells[2]))
            except ValueError:
                if line_number == 1:
                    continue  # the header
                raise DataError(f"score {cells[2]!r} is not a number", str(path), line_number) from None
            qrels.setdefault(cells[0].strip(), {})[cells[1].strip()] = grade
    if not qrels:
        raise DataError("holds no judgements", str(path))
    return qrels


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
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)

    def lines(items: dict[str, dict]) -> str:
        return "".join(json.dumps({"_id": item_id, **row}, ensure_ascii=False) + "\n" for item_id, row in items.items())

    write(root / CORPUS_FILE, lines(documents))
    write(root / QUERIES_FILE, lines(queries))
    for split, judged in qrels.items():
        rows = ["query-id\tcorpus-id\tscore\n"]
        rows += [f"{q}\t{d}\t{grade}\n" for q, docs in judged.items() for d, grade in docs.items()]
        write(root / QRELS_DIR / f"{split}.tsv", "".join(rows))
    return root
