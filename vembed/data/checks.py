"""Which rows of a table can become records, computed column by column over batches of rows, never one Python
record per row: a skip code, the number of usable hard negatives, the modalities and the most images of any side.

Text emptiness is computed by pyarrow on Arrow string columns (no Python string per cell); image cells and list
cells that need the file system or JSON parsing go through `RowReader`'s own rules, so a row counted here as skipped
is exactly the row `RowReader.example` would refuse (a test holds the two together). For tables read with
`datasets`, `Dataset.map` caches the result beside the Arrow cache, so a second launch reads it instead of checking
again.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from dataclasses import dataclass
from itertools import zip_longest
from typing import TYPE_CHECKING, Any

import numpy as np

from vembed.data.reader import RowReader, UnusableImage, as_list, side_text

if TYPE_CHECKING:
    import datasets

# Skip codes in the order `RowReader.example` finds them; 0 is a usable row.
REASONS = ("", "empty_query", "empty_positive", "missing_image", "bad_image", "bad_text", "bad_score")
CODE = {reason: code for code, reason in enumerate(REASONS)}
TEXT, IMAGE = 1, 2  # modality bits
CHECK_BATCH_ROWS = 10_000
MIN_ROWS_FOR_PROCESSES, MAX_CHECK_PROCESSES = 100_000, 8
CHECKS_VERSION = 3  # bump when the rules change: cached verdicts of older rules are not reused
FIELDS = ("reason", "negatives", "modalities", "negative_modalities", "max_images", "scores", "score_low",
          "score_high")
NO_SCORE, ONE_SCORE = 0, -1  # `scores` per row: no score, one number; n > 0: a list of n
SCORE_SHAPES = ("none", "number", "list")  # the names of those three cases, as losses ask for them


def has_score_shape(scores: np.ndarray, shape: str) -> np.ndarray:
    """Which rows' `scores` (RowChecks.scores) are of `shape`, one of SCORE_SHAPES."""
    if shape == "none":
        return scores == NO_SCORE
    if shape == "number":
        return scores == ONE_SCORE
    if shape == "list":
        return scores > 0
    raise ValueError(f"score shape {shape!r} is not one of {SCORE_SHAPES}")


@dataclass
class RowChecks:
    """Per row of a table: `reason` (a code of REASONS), `negatives` (usable hard negatives), `modalities` and
    `negative_modalities` (TEXT | IMAGE bits of the query and positive, and of the negatives), `max_images` (the
    most images any side of the row has), `scores` (NO_SCORE, ONE_SCORE, or the length of a list of scores) and
    `score_low` / `score_high` (the row's smallest and largest score; NaN without one)."""

    reason: np.ndarray
    negatives: np.ndarray
    modalities: np.ndarray
    negative_modalities: np.ndarray
    max_images: np.ndarray
    scores: np.ndarray
    score_low: np.ndarray
    score_high: np.ndarray
    # This process read every page of a memory-mapped table to compute them (checked here, not in workers or the
    # cache): the caller may map the table afresh so those pages do not stay in its memory (vembed/data/sources.py).
    read_the_table: bool = False

    @classmethod
    def concat(cls, parts: list["RowChecks"]) -> "RowChecks":
        if not parts:
            return cls(*(np.zeros(0, dtype=np.int8) for _ in FIELDS))
        return cls(*(np.concatenate([getattr(part, name) for part in parts]) for name in FIELDS))


class BatchChecker:
    """`checker(batch) -> dict of arrays` for a batch of rows: a pyarrow Table (what `Dataset.map` hands over with
    the arrow format) or a dict of column lists. Picklable, so `map(num_proc=...)` can run it in workers."""

    def __init__(self, reader: RowReader):
        self.reader = reader

    def __call__(self, batch: Any) -> dict[str, np.ndarray]:
        columns = self.reader.columns
        size = batch.num_rows if hasattr(batch, "num_rows") else len(next(iter(batch.values()), []))

        def column(part: str) -> Any:
            name = columns[part]
            if hasattr(batch, "column_names"):
                values = batch.column(name) if name in batch.column_names else None
            else:
                values = batch.get(name)
            if values is not None and part in self.reader.json_parts:
                return [self.reader.cell(part, value) for value in _python(values)]
            return values

        query_text, query_text_error = _texts_present(column("query"), size)
        positive_text, positive_text_error = _texts_present(column("positive"), size)
        query_images, query_error = self._image_cells(column("query_image"), size)
        positive_images, positive_error = self._image_cells(column("positive_image"), size)
        negatives, negative_modalities, negative_images, negative_error = self._negatives(
            column("negatives"), column("negative_images"), size)

        # The first problem `RowReader.example` meets wins: it reads the query side (text, then images), the
        # positive side, checks both are non-empty, then reads the negatives. Applied here from last to first.
        reason = negative_error
        reason = np.where(positive_text | (positive_images > 0), reason, CODE["empty_positive"])
        reason = np.where(query_text | (query_images > 0), reason, CODE["empty_query"])
        reason = np.where(positive_error > 0, positive_error, reason)
        reason = np.where(positive_text_error > 0, positive_text_error, reason)
        reason = np.where(query_error > 0, query_error, reason)
        reason = np.where(query_text_error > 0, query_text_error, reason).astype(np.int8)
        scores, score_low, score_high, score_error = _scores(column("score"), size, self.reader.builder)
        # Last: a bad score stops the run (vembed/data/sources.py), so it is reported only for rows usable otherwise.
        reason = np.where((reason == 0) & (score_error > 0), score_error, reason).astype(np.int8)
        modalities = (np.where(query_text | positive_text, TEXT, 0)
                      | np.where((query_images > 0) | (positive_images > 0), IMAGE, 0)).astype(np.int8)
        most = np.maximum(np.maximum(query_images, positive_images), negative_images).astype(np.int16)
        # Prefixed: a data column may be called "negatives" too, and map() must not mix the two up.
        return {"checked_reason": reason, "checked_negatives": negatives.astype(np.int32),
                "checked_modalities": modalities, "checked_negative_modalities": negative_modalities.astype(np.int8),
                "checked_max_images": most, "checked_scores": scores, "checked_score_low": score_low,
                "checked_score_high": score_high}

    def _image_cells(self, values: Any, size: int) -> tuple[np.ndarray, np.ndarray]:
        """Images per cell and the skip code of cells that cannot be used (missing file, unreadable bytes)."""
        counts, errors = np.zeros(size, dtype=np.int16), np.zeros(size, dtype=np.int8)
        if values is None or _all_null(values):
            return counts, errors
        for i, value in enumerate(_python(values)):
            try:
                images = self.reader.side_images(value)
            except UnusableImage as bad:
                errors[i] = CODE[bad.reason]
                continue
            counts[i] = 0 if images is None else len(images) if isinstance(images, list) else 1
        return counts, errors

    def _negatives(self, texts: Any, images: Any, size: int) -> tuple[np.ndarray, ...]:
        """Usable negatives per row, their modalities, the most images of one negative, and image errors."""
        counts, modalities = np.zeros(size, dtype=np.int32), np.zeros(size, dtype=np.int8)
        most, errors = np.zeros(size, dtype=np.int16), np.zeros(size, dtype=np.int8)
        if images is None or _all_null(images):
            if texts is None or _all_null(texts):
                return counts, modalities, most, errors
            fast = _text_list_counts(texts, size)
            if fast is not None:  # a list<string> column: counted by pyarrow
                return fast, np.where(fast > 0, TEXT, 0).astype(np.int8), most, errors
            images = None
        text_cells = _python(texts) if texts is not None else [None] * size
        image_cells = _python(images) if images is not None else [None] * size
        builder, side_images = self.reader.builder, self.reader.side_images
        for i, (text_cell, image_cell) in enumerate(zip(text_cells, image_cells)):
            try:
                for text, image in zip_longest(as_list(text_cell, builder), as_list(image_cell, builder)):
                    has_text = side_text(text, "negatives") is not None
                    found = side_images(image)
                    if found is None and not has_text:
                        continue
                    counts[i] += 1
                    if has_text:
                        modalities[i] |= TEXT
                    if found is not None:
                        modalities[i] |= IMAGE
                        most[i] = max(most[i], len(found) if isinstance(found, list) else 1)
            except UnusableImage as bad:
                errors[i] = CODE[bad.reason]
        return counts, modalities, most, errors


def _scores(values: Any, size: int, builder: str) -> tuple[np.ndarray, ...]:
    """Per score cell: NO_SCORE, ONE_SCORE or a list's length; its smallest and largest score; the `bad_score` code
    where it is not a number or a list of numbers. Numeric columns and lists of numbers are read by pyarrow."""
    counts = np.zeros(size, dtype=np.int16)
    low, high = np.full(size, np.nan), np.full(size, np.nan)
    errors = np.zeros(size, dtype=np.int8)
    if values is None or _all_null(values):
        return counts, low, high, errors
    fast = _arrow_scores(values, size)
    if fast is not None:
        return (*fast, errors)
    from vembed.data.reader import UnusableImage, score_of

    for i, value in enumerate(_python(values)):
        try:
            score = score_of(value, builder)
        except UnusableImage:
            errors[i] = CODE["bad_score"]
            continue
        if score is None:
            continue
        found = score if isinstance(score, list) else [score]
        counts[i] = len(found) if isinstance(score, list) else ONE_SCORE
        if found:
            low[i], high[i] = min(found), max(found)
    return counts, low, high, errors


def _arrow_scores(values: Any, size: int) -> tuple[np.ndarray, ...] | None:
    """`_scores` of an Arrow column of numbers or of lists of numbers (None for any other column)."""
    if not hasattr(values, "to_pylist"):
        return None
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    kind = values.type
    if pa.types.is_integer(kind) or pa.types.is_floating(kind):
        numbers = np.asarray(pc.fill_null(pc.cast(values, pa.float64()), np.nan), dtype=np.float64)
        present = ~np.isnan(numbers)
        return np.where(present, ONE_SCORE, NO_SCORE).astype(np.int16), numbers.copy(), numbers.copy()
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not (
            pa.types.is_integer(kind.value_type) or pa.types.is_floating(kind.value_type)):
        return None
    if values.null_count or pc.list_flatten(values).null_count:
        return None  # a missing list or a missing teacher score: the Python path says which
    lengths = np.asarray(pc.list_value_length(values), dtype=np.int64)
    flat = np.asarray(pc.cast(pc.list_flatten(values), pa.float64()), dtype=np.float64)
    if np.isnan(flat).any():
        return None
    low, high = np.full(size, np.nan), np.full(size, np.nan)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    filled = lengths > 0
    if filled.any():
        low[filled] = np.minimum.reduceat(flat, starts[filled])
        high[filled] = np.maximum.reduceat(flat, starts[filled])
    return lengths.astype(np.int16), low, high


def _python(values: Any) -> list[Any]:
    return values.to_pylist() if hasattr(values, "to_pylist") else values


def _all_null(values: Any) -> bool:
    if hasattr(values, "null_count"):
        return values.null_count == len(values)
    return all(value is None for value in values)


def _is_arrow_text(values: Any) -> bool:
    if not hasattr(values, "to_pylist"):  # a Python list (small JSON files): pyarrow stays unimported
        return False
    import pyarrow as pa

    return isinstance(values, (pa.Array, pa.ChunkedArray)) and (
        pa.types.is_string(values.type) or pa.types.is_large_string(values.type))


def _texts_present(values: Any, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Per text cell: whether it holds text (not null, NaN, empty or only whitespace), and the `bad_text` code where
    it holds something else (a number, a list), as `side_text` decides."""
    errors = np.zeros(size, dtype=np.int8)
    if values is None:
        return np.zeros(size, dtype=bool), errors
    if _is_arrow_text(values):
        import pyarrow.compute as pc

        empty = pc.or_kleene(pc.is_null(values),
                             pc.or_(pc.equal(pc.utf8_length(values), 0), pc.utf8_is_space(values)))
        return ~np.asarray(pc.fill_null(empty, True), dtype=bool), errors
    present = np.zeros(size, dtype=bool)
    for i, value in enumerate(_python(values)):
        try:
            present[i] = side_text(value, "") is not None
        except UnusableImage:
            errors[i] = CODE["bad_text"]
    return present, errors


def _text_list_counts(values: Any, size: int) -> np.ndarray | None:
    """Non-empty texts per cell of an Arrow list<string> column; None for any other column."""
    if not hasattr(values, "to_pylist"):
        return None
    import pyarrow as pa
    import pyarrow.compute as pc

    if not isinstance(values, (pa.Array, pa.ChunkedArray)) or not (
            pa.types.is_list(values.type) or pa.types.is_large_list(values.type)):
        return None
    flat = pc.list_flatten(values)
    if not _is_arrow_text(flat):
        return None
    present, _ = _texts_present(flat, len(flat))
    parents = np.asarray(pc.list_parent_indices(values))
    return np.bincount(parents[present], minlength=size).astype(np.int32)


# --- whole tables ----------------------------------------------------------------------------------------------------


def check_rows(table: Any, reader: RowReader) -> RowChecks:
    """The checks of every row of `table`: a `datasets.Dataset` (checked by `Dataset.map` in batches of Arrow rows,
    the result cached) or in-memory `JsonRows` (checked in batches of Python lists)."""
    if hasattr(table, "records"):  # vembed.data.tables.JsonRows: small files, read without datasets
        parts = [_as_checks(BatchChecker(reader)(batch)) for batch in table.iter(CHECK_BATCH_ROWS)]
        return RowChecks.concat(parts)
    return _check_dataset(table, reader)


def _as_checks(arrays: dict[str, Any]) -> RowChecks:
    return RowChecks(*(np.asarray(arrays[f"checked_{name}"]) for name in FIELDS))


def _check_dataset(table: "datasets.Dataset", reader: RowReader) -> RowChecks:
    import datasets

    if not table.cache_files:  # built in memory (Dataset.from_dict): nothing on disk to key a cache by
        batches = table.with_format("arrow").iter(batch_size=CHECK_BATCH_ROWS)
        return RowChecks.concat([_as_checks(BatchChecker(reader)(batch)) for batch in batches])
    key = checks_key(table, reader)
    cache_dir = os.path.join(datasets.config.HF_DATASETS_CACHE, "vembed-row-checks")
    os.makedirs(cache_dir, exist_ok=True)
    cached = bool(glob.glob(os.path.join(cache_dir, f"{key}*.arrow")))  # with workers: one file per worker
    processes = _check_processes(table, reader)
    checked = table.with_format("arrow").map(
        BatchChecker(reader),
        batched=True,
        batch_size=CHECK_BATCH_ROWS,
        remove_columns=table.column_names,
        cache_file_name=os.path.join(cache_dir, f"{key}.arrow"),
        new_fingerprint=key,
        desc=f"checking rows of {os.path.basename(reader.file)}",
        num_proc=processes,
    )
    data = checked.data
    return RowChecks(*(data.column(f"checked_{name}").to_numpy() for name in FIELDS),
                     read_the_table=not cached and processes is None)


def _check_processes(table: "datasets.Dataset", reader: RowReader) -> int | None:
    """Worker processes for checking a large table where they help: when cells need Python per row (image paths
    looked up on disk, embedded images opened, JSON cells parsed). Columns pyarrow checks on its own (text, lists of
    text) are faster in-process: 1 M text pairs took 0.25-0.37 s in-process, 0.74-0.89 s with two workers (the
    pool's start and the shards' merge) on this 2-core machine."""
    cores = min(os.cpu_count() or 1, MAX_CHECK_PROCESSES)
    if table.num_rows < MIN_ROWS_FOR_PROCESSES or cores < 2 or _arrow_only(table, reader):
        return None
    return cores


def _arrow_only(table: "datasets.Dataset", reader: RowReader) -> bool:
    """True when every column the checks read is text or a list of text: pyarrow checks them, no Python per row."""
    import pyarrow as pa

    schema = table.data.schema
    for part, name in reader.columns.items():
        if part in ("label", "score") or name not in schema.names:  # label: not checked; score: numbers
            continue
        kind = schema.field(name).type
        if part in reader.json_parts or part.endswith("image") or part.endswith("images"):
            return False
        if part == "negatives":
            if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
                return False
            kind = kind.value_type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            return False
    return True


def checks_key(table: "datasets.Dataset", reader: RowReader) -> str:
    """What the checks depend on: the table's files (path, size, modification time), the column map, the image base
    directory, the format and the rules' version. Image files themselves are not part of it: one deleted after a
    launch is found when its record is fetched (and replaced, see PairDataset)."""
    files = sorted({entry["filename"] for entry in table.cache_files})
    stats = [(path, os.path.getsize(path), os.stat(path).st_mtime_ns) for path in files]
    payload = json.dumps([CHECKS_VERSION, stats, reader.columns, reader.image_base, reader.builder, table.num_rows,
                          table.column_names], sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:32]
