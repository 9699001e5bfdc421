"""A split's kept rows (`PairRows`), each made an `Example` by reader.py only when fetched, from tables left on disk.

The tables are Arrow, memory-mapped, or small JSON files read whole (tables.py).

Only integer arrays live in Python memory (the kept row positions and a few per-row figures from the checks), so a
rank holds a few bytes per row instead of a Python object graph per record; the mapped Arrow files are the same pages
for every rank of a node.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from vembed.data.checks import IMAGE, TEXT, RowChecks
from vembed.data.reader import RowReader, Skipped, row_number
from vembed.data.records import Example
from vembed.errors import DataError

MODALITY_BITS = {"text": TEXT, "image": IMAGE}


class ScoreCell(NamedTuple):
    """A record's score cell, for an error naming it: its file, row (`row_number`) and score column; `row` is None
    when the file has no such column (`column` None: it has none by its kind, as a corpus folder)."""

    file: str
    row: int | None
    column: str | None


@dataclass
class TablePart:
    """The kept rows of one file: where they are in its table, and what the checks found about them."""

    reader: RowReader
    table: Any  # a datasets.Dataset (only the columns used) or vembed.data.tables.JsonRows
    rows: np.ndarray  # positions of the kept rows in `table`, in file order
    checks: RowChecks  # the checks of the kept rows only, aligned with `rows`
    num_negatives: int  # hard negatives every record keeps (longer lists are cut)
    _columns: dict[str, Any] | None = field(default=None, repr=False)

    def example(self, position: int) -> Example:
        try:
            example = self.reader.example(self._row(position), row_number(position))
        except Skipped as skipped:  # it passed the checks when the run started: the data changed since
            raise DataError(f"{skipped.detail} (it was usable when the run started)", file=self.reader.file,
                            row=row_number(position)) from None
        example.keep_negatives(self.num_negatives)
        return example

    def _row(self, position: int) -> dict[str, Any]:
        if self._columns is None:
            names = {part: name for part, name in self.reader.columns.items() if name in self.table.column_names}
            if hasattr(self.table, "records"):
                self._columns = names
            else:  # one Arrow column per part: a cell is read without formatting a whole row (~4 us, not ~40)
                self._columns = {part: self.table.data.column(name) for part, name in names.items()}
        if hasattr(self.table, "records"):
            record = self.table.records[position]
            return {part: record.get(name) for part, name in self._columns.items()}
        cell = self.reader.cell
        return {part: cell(part, column[position].as_py()) for part, column in self._columns.items()}

    def __getstate__(self) -> dict[str, Any]:
        # DataLoader workers get the table by reference (datasets pickles a memory-mapped table as its path);
        # the Arrow column handles are reopened there.
        return {**self.__dict__, "_columns": None}


class PairRows(Sequence):
    """`Sequence[Example]` over the kept rows of one or more files, made on fetch. Named sources (several files
    each) sit one after another; `source_ranges()` says where each starts and stops."""

    def __init__(self, parts: list[TablePart]):
        self.parts = [part for part in parts if len(part.rows)]
        self._ends = np.cumsum([len(part.rows) for part in self.parts], dtype=np.int64)

    @classmethod
    def concat(cls, rows: Sequence["PairRows"]) -> "PairRows":
        return cls([part for item in rows for part in item.parts])

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        size = len(self)
        if not -size <= index < size:
            raise IndexError(f"record {index} out of range for {size} records")
        index %= size
        number = int(np.searchsorted(self._ends, index, side="right"))
        start = int(self._ends[number - 1]) if number else 0
        part = self.parts[number]
        return part.example(int(part.rows[index - start]))

    def source_ranges(self) -> list[tuple[str | None, int, int]]:
        """(source name, first record, one past the last) of each named source, in order; one unnamed range for a
        split without named sources."""
        ranges: list[tuple[str | None, int, int]] = []
        start = 0
        for part, end in zip(self.parts, self._ends):
            name = part.reader.source.name
            if ranges and ranges[-1][0] == name:
                ranges[-1] = (name, ranges[-1][1], int(end))
            else:
                ranges.append((name, start, int(end)))
            start = int(end)
        return ranges

    def negative_counts(self) -> set[int]:
        """The hard negatives the records keep, one count per table."""
        return {part.num_negatives for part in self.parts}

    def image_paths(self) -> list[str]:
        """Every image file the records use (query, positive, the negatives they keep), once each, sorted: read from
        the image columns (vembed/data/image_columns.py), no record made; none read for a text-only table."""
        from vembed.data.image_columns import image_paths

        return sorted(set().union(*(image_paths(part) for part in self.parts)))

    # --- figures over every record, from the checks (no record is made) --------------------------------------------

    def every_record_has(self, modalities: frozenset[str]) -> bool:
        """True when every record feeds each of `modalities` (text, image) from its query or positive, or from the
        hard negatives it keeps; False when that is unknown (negatives cut from a longer list might have been the
        only image)."""
        wanted = 0
        for modality in modalities:
            wanted |= MODALITY_BITS[modality]
        for part in self.parts:
            found = part.checks.modalities.astype(np.int64)
            if part.num_negatives:
                whole = part.checks.negatives == part.num_negatives  # the row keeps all its negatives
                found = found | np.where(whole, part.checks.negative_modalities, 0)
            if np.any((found & wanted) != wanted):
                return False
        return True

    def score_shapes(self) -> tuple[int, int, int]:
        """How many records have no score, one number, and a list of teacher scores (from the checks)."""
        from vembed.data.checks import SCORE_SHAPES, has_score_shape

        none, numbers, lists = (sum(int(has_score_shape(part.checks.scores, shape).sum()) for part in self.parts)
                                for shape in SCORE_SHAPES)
        return none, numbers, lists

    def first_score(self, shape: str) -> "ScoreCell | None":
        """Where the first record whose score is of `shape` (checks.SCORE_SHAPES) is, in file order; None when no
        record's is."""
        from vembed.data.checks import has_score_shape

        for part in self.parts:
            column = part.reader.columns["score"]
            if shape == "none" and column not in part.table.column_names:
                return ScoreCell(part.reader.file, None, column)
            found = np.flatnonzero(has_score_shape(part.checks.scores, shape))
            if len(found):
                return ScoreCell(part.reader.file, row_number(part.rows[found[0]]), column)
        return None

    def unlabelled_records(self) -> tuple[int, int | None]:
        """How many records have no label (the file has no label column, or the cell is empty) and the first of them
        (an index into this sequence): what a loss that mines on labels cannot train on. Reads the label column only."""
        from vembed.data.reader import text_of

        count, first, start = 0, None, 0
        for part, end in zip(self.parts, self._ends):
            name = part.reader.columns.get("label")
            if name not in part.table.column_names:
                missing = np.arange(len(part.rows))
            elif hasattr(part.table, "records"):
                missing = np.flatnonzero([text_of(part.table.records[int(i)].get(name)) is None for i in part.rows])
            else:
                values = part.table.data.column(name).take(part.rows).to_pylist()
                missing = np.flatnonzero([text_of(value) is None for value in values])
            if len(missing) and first is None:
                first = start + int(missing[0])
            count, start = count + len(missing), int(end)
        return count, first

    def most_images_per_side(self) -> tuple[int, int | None]:
        """The most images any side of any record has (negatives a record keeps included) and the first record with
        that many (an index into this sequence), so a model's limit is checked without making records."""
        best, where, start = 0, None, 0
        for part, end in zip(self.parts, self._ends):
            counts = part.checks.max_images
            if len(counts) and int(counts.max()) > best:
                best, where = int(counts.max()), start + int(np.argmax(counts))
            start = int(end)
        return best, where

    def duplicate_keys(self) -> tuple[np.ndarray, np.ndarray]:
        """Per record, ids of the texts and images it holds (query, positive, the negatives it keeps), equal ids for
        equal values across the whole sequence: `keys[offsets[i]:offsets[i + 1]]` are record i's. What the
        no-duplicates batch sampler compares; computed once, in batches of rows."""
        ids: dict[tuple[str, Any], int] = {}
        offsets, keys = [0], []
        for part in self.parts:
            for position in part.rows:
                row = part._row(int(position))
                found = {ids.setdefault(value, len(ids)) for value in _values(row, part)}
                keys.extend(sorted(found))
                offsets.append(len(keys))
        return np.asarray(offsets, dtype=np.int64), np.asarray(keys, dtype=np.int64)


def _values(row: dict[str, Any], part: TablePart) -> list[tuple[str, Any]]:
    """The texts and image references of one row, as comparable values."""
    from vembed.data.reader import as_list, text_of

    builder = part.reader.builder
    values: list[tuple[str, Any]] = []
    for side in ("query", "positive"):
        text = text_of(row.get(side))
        if text is not None:
            values.append(("text", text))
        values.extend(("image", _image_key(cell)) for cell in as_list(row.get(f"{side}_image"), builder))
    negatives = as_list(row.get("negatives"), builder)[: part.num_negatives]
    values.extend(("text", text) for text in map(text_of, negatives) if text is not None)
    for cell in as_list(row.get("negative_images"), builder)[: part.num_negatives]:
        values.extend(("image", _image_key(image)) for image in as_list(cell, builder))
    return [value for value in values if value[1] is not None]


def _image_key(cell: Any) -> Any:
    if isinstance(cell, dict):  # a datasets Image feature: the path, or a digest of the bytes
        if cell.get("path"):
            return cell["path"]
        if cell.get("bytes"):
            import hashlib

            return hashlib.sha1(cell["bytes"]).hexdigest()
        return None
    return cell if isinstance(cell, str) and cell.strip() else None
