"""A reranker's unit of data: a query with a list of documents and their labels.

Where the lists come from (no file to convert):
- a corpus folder + `data.hard_negatives` (what `vembed mine` writes), or a pairs file with a negatives column: one
  list per (query, positive) record, the positive (label 1) then its K mined negatives (label 0), read by the
  contrastive task's own loader (`vembed.data.sources.load_rows`: the same checks, counts and report);
- a file of lists `{"query": ..., "documents": [...], "labels": [...]}` (labels: 0/1, grades or scores; a document is
  a text or `{"text": ..., "image": "path"}`, the path relative to data.image_root or the file's folder), or with
  `"scores": [...]` instead of labels (a teacher's scores, which the distillation losses read; the positive first
  for rerank_margin_mse);
- a file of judged pairs `{"query": ..., "document": ..., "label": ...}`: the rows of one query form its list.

A list whose labels (or scores) do not match its documents is one line naming the file and row (DataError, exit 2).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vembed.errors import DataError
from vembed.reranking.pairs import PairPart, pair_document

if TYPE_CHECKING:
    from vembed.recipe import DataConfig


@dataclass
class RankList:
    query: str
    documents: list[PairPart]  # texts, or Sides where a document holds an image
    labels: list[float]
    source: str | None = None
    row: int | None = None


class ExampleLists:
    """`Sequence[RankList]` over contrastive records (corpus pairs with mined negatives, pairs files): the positive
    then the negatives, made on fetch."""

    def __init__(self, examples: Sequence[Any]):
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> RankList:
        example = self.examples[index]
        documents = [pair_document(side) for side in (example.positive, *example.negatives)]
        return RankList(example.query.text or "", documents, [1.0] + [0.0] * len(example.negatives),
                        example.source, example.row)


@dataclass
class ListReport:
    """What was read (the loop's data report contract: `summary`, `to_dict`, `num_skipped`)."""

    files: list[str]
    lists: int
    pairs: int
    num_skipped: int = 0

    def summary(self) -> str:
        return f"{self.lists} lists ({self.pairs} pairs) from {', '.join(self.files)}"

    def to_dict(self) -> dict[str, Any]:
        return {"files": self.files, "lists": self.lists, "pairs": self.pairs, "skipped": {}}


def list_shape(columns: Sequence[str]) -> str | None:
    """"lists" (query, documents, labels), "pairs" (query, document, label), or None (a contrastive pairs file)."""
    if "documents" in columns:
        return "lists"
    if "document" in columns and "label" in columns:
        return "pairs"
    return None


def read_lists(data: "DataConfig", split: str) -> tuple[Sequence[RankList], Any]:
    """The lists of `data.<split>` and a report of what was read."""
    from vembed.data.corpus import corpus_sources
    from vembed.data.paths import builder_for, resolve_files
    from vembed.data.sources import load_rows
    from vembed.data.tables import read_table

    value = getattr(data, split)
    if not corpus_sources(data, split) and not isinstance(value, dict):
        files = resolve_files(value, data.format, f"data.{split}")
        tables = [(file, read_table(file, builder_for(file, data.format), split)) for file in files]
        shapes = {list_shape(table.column_names) for _, table in tables}
        if shapes != {None}:
            if len(shapes) > 1:
                raise DataError("mixes list/pair/contrastive shapes with the other files of "
                                f"data.{split}; give one shape per split", file=tables[0][0])
            shape = shapes.pop()
            lists = [item for file, table in tables for item in _table_lists(file, table, shape, data.image_root)]
            if not lists:
                raise DataError("holds no lists", file=files[0])
            return lists, ListReport(files, len(lists), sum(len(item.documents) for item in lists))
    examples, report = load_rows(data, split)
    return ExampleLists(examples), report


def _records(table: Any):
    for part in table.iter(batch_size=1024):
        names = list(part)
        for values in zip(*(part[name] for name in names)):
            yield dict(zip(names, values))


def _table_lists(file: str, table: Any, shape: str, image_root: str | None = None) -> list[RankList]:
    lists: list[RankList] = []
    by_query: dict[str, RankList] = {}
    for number, row in enumerate(_records(table), start=1):
        query = row.get("query")
        if not isinstance(query, str) or not query.strip():
            raise DataError("has no query text", file=file, row=number)
        if shape == "lists":
            documents, targets = row.get("documents"), _targets(row, file, number)
            labels = row.get(targets)
            if not isinstance(documents, list) or not isinstance(labels, list):
                raise DataError(f"needs a list 'documents' and a list '{targets}'", file=file, row=number)
            if len(documents) != len(labels):
                raise DataError(f"has {len(documents)} documents but {len(labels)} {targets}; give one "
                                f"{targets[:-1]} per document", file=file, row=number)
            if not documents:
                raise DataError("has an empty 'documents' list", file=file, row=number)
            lists.append(RankList(query, [_document(d, file, number, image_root) for d in documents],
                                  [_label(x, file, number) for x in labels], file, number))
        else:
            item = by_query.get(query)
            if item is None:
                item = by_query[query] = RankList(query, [], [], file, number)
                lists.append(item)
            item.documents.append(str(row.get("document")))
            item.labels.append(_label(row.get("label"), file, number))
    return lists


def _document(value: Any, file: str, row: int, image_root: str | None) -> PairPart:
    """A list's document: its text, or `{"text": ..., "image": path}` as a Side (the path relative to image_root or
    the file's folder; a missing image is a DataError naming the row)."""
    from pathlib import Path

    from vembed.data.records import Side

    if not isinstance(value, dict):
        return str(value)
    text, image = value.get("text"), value.get("image")
    if image is None:
        return str(text or "")
    path = Path(image_root or Path(file).parent, image)
    if not path.is_file():
        raise DataError(f"image {image} not found; check the path or data.image_root", file=file, row=row)
    return Side(text=text, image=str(path), role="document")


def first_image_document(lists: Sequence[RankList]) -> RankList | None:
    """The first list holding an image document (None: all text): what a text-only reranker refuses."""
    from vembed.data.records import Side

    return next((item for item in lists if any(isinstance(d, Side) and d.images for d in item.documents)), None)


def _targets(row: dict[str, Any], file: str, number: int) -> str:
    """Which key holds a list's targets: `labels` (relevance) or `scores` (a teacher's, for the distillation losses);
    the loss reads either the same way, so a row gives one."""
    if row.get("labels") is not None and row.get("scores") is not None:
        raise DataError("has both 'labels' and 'scores'; give one (scores: a teacher's, for rerank_margin_mse or "
                        "rerank_distill_kl)", file=file, row=number)
    return "scores" if row.get("scores") is not None else "labels"


def _label(value: Any, file: str, row: int) -> float:
    try:
        label = float(value)
    except (TypeError, ValueError):
        label = math.nan
    if not math.isfinite(label):
        raise DataError(f"label {value!r} is not a number", file=file, row=row)
    return label


def collate_lists(adapter: Any, lists: Sequence[RankList]) -> dict[str, Any]:
    """B lists -> the flat pairs tokenized jointly (B x L at most) and (B, L) labels and mask (shorter lists
    padded)."""
    length = max(len(item.documents) for item in lists)
    queries, documents, labels, mask = [], [], [], []
    for item in lists:
        n = len(item.documents)
        queries += [item.query] * n
        documents += item.documents
        # Rows built in Python, one tensor each: per-list tensor writes cost the main process ~6 torch calls a list,
        # every step (the loader runs here with data.num_workers 0)
        labels.append([*item.labels, *[0.0] * (length - n)])
        mask.append([True] * n + [False] * (length - n))
    return {"pairs": adapter.preprocess(queries, documents), "labels": torch.tensor(labels, dtype=torch.float32),
            "mask": torch.tensor(mask, dtype=torch.bool)}
