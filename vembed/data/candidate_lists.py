"""The candidate-list shape of a pairs file, one line per query with its ranked candidates and a teacher's scores of
them, read as pairs: `{"query": ..., "documents": [d0, d1, ...], "scores": [s0, s1, ...]}` becomes positive = d0,
negatives = [d1, ...], score = [s0, s1, ...] (what distill_kl, late_interaction_distill_kl and margin_mse read).

Applied once, to the table as it is opened (`vembed.data.tables.open_table`), so the row checks, the records, the
image and duplicate lookups all see an ordinary pairs table; a stream applies it to each sample as it is read
(`vembed.data.stream_samples`). Both call `list_columns` (is it this shape, which columns) and `split_documents` (one
row's split and its score check). A file has this shape when it has the data.columns.documents column and no positive
column; the scores are data.columns.score where the file has that column, else `scores`. Documents are texts.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from vembed.data.reader import as_list, row_number
from vembed.errors import DataError

SCORES = "scores"  # the shape's score column, read when the file has no data.columns.score column


class ListRowError(DataError):
    """A row of this shape that cannot be read. `reason` names it as a skip (a key of streaming.STREAM_SKIP_FIXES):
    the map-style path stops on it, a stream counts it (vembed/data/stream_samples.py)."""

    def __init__(self, reason: str, message: str, file: str, row: int | None = None):
        super().__init__(message, file=file, row=row)
        self.reason = reason


def is_candidate_lists(present: Iterable[str], columns: dict[str, str]) -> bool:
    present = set(present)
    return columns["documents"] in present and columns["positive"] not in present \
        and columns["positive_image"] not in present


@dataclass(frozen=True)
class ListColumns:
    """Where a table's (or a streamed sample's) candidate lists are."""

    documents: str  # data.columns.documents
    score: str | None  # the teacher scores read: data.columns.score where present, else `scores`; None: no scores

    def pair_columns(self, columns: dict[str, str]) -> list[str]:
        """The columns a row of this shape becomes: data.columns.positive, .negatives, and .score with scores."""
        return [columns["positive"], columns["negatives"]] + ([columns["score"]] if self.score else [])


def list_columns(present: Iterable[str], columns: dict[str, str], file: str) -> ListColumns | None:
    """The columns of this shape among `present`; None when they are not of it. A documents column beside a negatives
    column is a `ListRowError` naming the file: which would the hard negatives be?"""
    present = list(present)
    if not is_candidate_lists(present, columns):
        return None
    documents = columns["documents"]
    if columns["negatives"] in present:
        raise ListRowError("documents_and_negatives", f"has both a {documents!r} column (data.columns.documents: the "
                           f"positive, then the hard negatives) and a {columns['negatives']!r} column "
                           "(data.columns.negatives); give one of them", file=file)
    score = columns["score"] if columns["score"] in present else SCORES if SCORES in present else None
    return ListColumns(documents, score)


def split_documents(cell: Any, score: Any, builder: str, names: ListColumns, file: str,
                    row: int) -> tuple[Any, list[Any]]:
    """One row's (positive, negatives) from its documents cell: the first document, then the rest. A score cell that
    is a list (as score_of reads one) of another length than the documents is a `ListRowError` naming the file and
    `row` (1-based): the scores would be matched to the wrong documents."""
    documents = as_list(cell, builder)
    listed = isinstance(score, (list, tuple)) or (builder == "csv" and isinstance(score, str)
                                                   and score.lstrip().startswith("["))  # as score_of reads
    given = as_list(score, builder) if listed else None
    if given is not None and len(given) != len(documents):
        raise ListRowError("bad_score", f"data.columns.score ({names.score!r}): {len(given)} teacher scores for "
                           f"{len(documents)} documents (data.columns.documents {names.documents!r}); give one score "
                           "per document, in order", file=file, row=row)
    return (documents[0] if documents else None), documents[1:]


def pairs_of(row: dict[str, Any], names: ListColumns, builder: str, columns: dict[str, str], file: str,
             number: int) -> dict[str, Any]:
    """The pairs columns of one row of this shape (column -> cell; `number` 1-based): data.columns.positive and
    .negatives from its documents (`split_documents`), and its scores under data.columns.score."""
    score = row.get(names.score) if names.score else None
    positive, negatives = split_documents(row.get(names.documents), score, builder, names, file, number)
    return dict(zip(names.pair_columns(columns), (positive, negatives, score)))  # no score column: the first two


def as_row_of_pairs(row: dict[str, Any], builder: str, columns: dict[str, str], file: str,
                    number: int) -> dict[str, Any]:
    """One row (column -> cell, e.g. a streamed sample's) as a pairs row: its documents and scores replaced by
    `pairs_of`'s columns; unchanged when it is not of this shape. Raises `list_columns`' and `split_documents`'
    `ListRowError`s."""
    names = list_columns(row, columns, file)
    if names is None:
        return row
    kept = {name: cell for name, cell in row.items() if name not in (names.documents, names.score)}
    return {**kept, **pairs_of(row, names, builder, columns, file, number)}


def as_pairs(table: Any, file: str, builder: str, columns: dict[str, str]) -> Any:
    """`table` (a `datasets.Dataset` or `JsonRows`) with its documents column split into positive and negatives and
    its score column under data.columns.score; unchanged when it is not of this shape. A score list whose length is
    not the documents list's is a `DataError` naming the row (`split_documents`)."""
    present = list(table.column_names)
    names = list_columns(present, columns, file)
    if names is None:
        return table
    documents, score = names.documents, names.score
    split = _Splitter(file, builder, names, columns)
    if hasattr(table, "records"):  # vembed.data.tables.JsonRows (the records rebuilt as the same type)
        batch = {name: [record.get(name) for record in table.records] for name in present}
        pairs = split(batch, list(range(table.num_rows)))
        kept = [name for name in present if name not in (documents, score)] + list(pairs)
        batch.update(pairs)
        return type(table)([dict(zip(kept, values)) for values in zip(*(batch[name] for name in kept))], kept)
    return table.map(split, batched=True, with_indices=True, remove_columns=[documents] + ([score] if score else []),
                     features=_features(table, documents, score, columns),
                     desc=f"reading the documents lists of {file}")


class _Splitter:
    """Picklable batch function (`Dataset.map` may hash it for its cache): a batch of rows' columns -> the positive,
    negatives and score columns, row by row by `pairs_of`."""

    def __init__(self, file: str, builder: str, names: ListColumns, columns: dict[str, str]):
        self.file, self.builder, self.names, self.columns = file, builder, names, columns

    def __call__(self, batch: dict[str, list[Any]], indices: list[int]) -> dict[str, list[Any]]:
        read = [name for name in (self.names.documents, self.names.score) if name]
        rows = [pairs_of(dict(zip(read, cells)), self.names, self.builder, self.columns, self.file,
                         row_number(index))
                for index, *cells in zip(indices, *(batch[name] for name in read))]
        return {name: [row[name] for row in rows] for name in self.names.pair_columns(self.columns)}


def _features(table: Any, documents: str, score: str | None, columns: dict[str, str]) -> Any:
    """The mapped table's column types, fixed (a batch whose rows have no negatives would otherwise infer a list of
    nulls): the documents' item type for the positive and the negatives, the score column's own type."""
    import datasets

    features = {name: feature for name, feature in table.features.items() if name not in (documents, score)}
    item = getattr(table.features[documents], "feature", datasets.Value("string"))
    features[columns["positive"]] = item
    features[columns["negatives"]] = datasets.List(item)
    if score:
        features[columns["score"]] = table.features[score]
    return datasets.Features(features)
