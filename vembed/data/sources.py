"""Data sources: find the files a recipe names and read them into `Example`s, skipping and counting unusable rows.

JSON Lines and JSON files are read with the standard library; CSV, Parquet and local `datasets` folders with
`datasets`. Images stay as absolute paths here; they are decoded only when a record is fetched (see `PairDataset`),
so memory stays small.
"""

from __future__ import annotations

import glob
import io
import json
import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import zip_longest
from typing import TYPE_CHECKING, Any

from vembed.data.records import Example, ImageLike, Side
from vembed.errors import DataError, RecipeError, did_you_mean

if TYPE_CHECKING:
    import datasets

    from vembed.recipe import DataConfig

logger = logging.getLogger(__name__)

# The extensions `format: auto` recognises, and the `datasets` builder each one is read with.
BUILDER_BY_EXTENSION = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
EXTENSIONS_BY_FORMAT = {
    "auto": tuple(BUILDER_BY_EXTENSION),
    "jsonl": (".jsonl", ".json"),
    "json": (".json", ".jsonl"),
    "csv": (".csv",),
    "parquet": (".parquet",),
}
HF_SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")  # written by `save_to_disk`
MAX_BAD_ROWS_SHOWN = 5

# Why a row was skipped, and what the user can do about it (used in the error when too many are).
SKIP_FIXES = {
    "empty_query": "give every row a query text or image",
    "empty_positive": "give every row a positive text or image",
    "missing_image": "check the image paths and data.image_root",
    "bad_image": "give image columns file paths (or a datasets Image feature)",
    "bad_text": "give query/positive/negatives text (a column of numbers only is read as numbers: check that "
                "data.columns maps the text columns)",
    "too_few_negatives": "lower data.num_hard_negatives or add negatives to those rows",
}


# --- finding files -------------------------------------------------------------------------------------------------


def resolve_files(
    value: str | os.PathLike | Sequence[str | os.PathLike], format: str = "auto", key: str = "data"
) -> list[str]:
    """The data files a recipe value names: a path, a glob, a directory (its data files, sorted) or a list of those.

    Paths are relative to the working directory. For `format: hf` the value is a local `datasets` folder (or file)
    and only its existence is checked. Raises `RecipeError(key, ...)` with a fix when something matches nothing.
    """
    items = [value] if isinstance(value, (str, os.PathLike)) else list(value)
    if not items:
        raise RecipeError(key, "is an empty list; give at least one file, glob or directory")
    files: list[str] = []
    for item in items:
        files.extend(_resolve_one(os.path.expanduser(os.fspath(item)), format, key))
    return list(dict.fromkeys(files))  # a file named twice is read once


def check_data_paths(data: "DataConfig", splits: Sequence[str] = ("train", "validation", "test")) -> None:
    """Every file, glob or directory the recipe's `data.<split>` names exists (and `data.image_root`), before anything
    is built; a RecipeError names the first that does not."""
    for split in splits:
        value = getattr(data, split)
        if value is not None:
            resolve_files(value, data.format, key=f"data.{split}")
    if data.image_root is not None and not os.path.isdir(data.image_root):
        raise RecipeError("data.image_root", f"directory {data.image_root!r} not found")


def _resolve_one(item: str, format: str, key: str) -> list[str]:
    if format == "hf":
        if os.path.exists(item):
            return [item]
        raise RecipeError(
            key,
            f"path {item!r} not found{_sibling_hint(item)}; format 'hf' takes a local datasets folder (saved with "
            "save_to_disk, or a folder of data files) - nothing is downloaded",
        )
    extensions = EXTENSIONS_BY_FORMAT[format]
    shown = "/".join(extensions)
    if os.path.isdir(item):
        found = sorted(
            os.path.join(item, name)
            for name in os.listdir(item)
            if name.lower().endswith(extensions) and os.path.isfile(os.path.join(item, name))
        )
        if not found:
            raise RecipeError(key, f"directory {item!r} has no {shown} files; point at the data files themselves")
        return found
    if os.path.isfile(item):
        if format == "auto":
            builder_for(item, format, key)  # fails early on an extension we cannot read
        return [item]
    if glob.has_magic(item):
        matches = sorted(path for path in glob.glob(item, recursive=True) if os.path.isfile(path))
        found = [path for path in matches if path.lower().endswith(extensions)]
        if found:
            return found
        if matches:
            raise RecipeError(key, f"glob {item!r} matched no {shown} files (only e.g. {matches[0]!r})")
        raise RecipeError(key, f"glob {item!r} matched no files; check the pattern (relative to {os.getcwd()!r})")
    raise RecipeError(key, f"file {item!r} not found{_sibling_hint(item)}; relative paths start at {os.getcwd()!r}")


def _sibling_hint(path: str) -> str:
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        return f" (directory {parent!r} does not exist either)"
    return did_you_mean(os.path.basename(path), os.listdir(parent))


def builder_for(path: str, format: str = "auto", key: str = "data.format") -> str:
    """The `datasets` builder name ("json", "csv", "parquet") for a file, from `format` or its extension."""
    if format in ("jsonl", "json"):
        return "json"
    if format in ("csv", "parquet", "hf"):
        return format
    lowered = path.lower()
    for extension, builder in BUILDER_BY_EXTENSION.items():
        if lowered.endswith(extension):
            return builder
    known = "/".join(BUILDER_BY_EXTENSION)
    raise RecipeError(key, f"cannot tell the format of {path!r} from its extension; use {known} or set data.format")


# --- reading tables ------------------------------------------------------------------------------------------------


@dataclass
class Rows:
    """Records read without `datasets`, offering the part of `datasets.Dataset` that `load_examples` reads."""

    records: list[dict[str, Any]]
    column_names: list[str]

    @property
    def num_rows(self) -> int:
        return len(self.records)

    def select_columns(self, names: list[str]) -> "Rows":
        return Rows(self.records, [name for name in self.column_names if name in names])

    def iter(self, batch_size: int):
        for start in range(0, len(self.records), batch_size):
            part = self.records[start : start + batch_size]
            yield {name: [record.get(name) for record in part] for name in self.column_names}


def _read_json(path: str, split: str) -> Rows:
    """JSON Lines (one object per line), or a JSON file holding a list of objects or a dict of columns, the layouts
    `datasets`' json builder accepts. The standard library rather than `datasets` here: half a second less start-up,
    no Arrow copy of every file written to ~/.cache by every rank, and a parse error names its line."""
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError as err:
        if text.lstrip().startswith("["):
            raise DataError(f"cannot read as json: line {err.lineno}: {err.msg}", file=path) from err
        records = _json_lines(text, path)
    else:
        if isinstance(loaded, dict) and loaded and all(isinstance(column, list) for column in loaded.values()):
            if len({len(column) for column in loaded.values()}) > 1:
                raise DataError("cannot read as json: its columns have different lengths", file=path)
            loaded = [dict(zip(loaded, values)) for values in zip(*loaded.values())]
        records = loaded if isinstance(loaded, list) else [loaded]
    for number, record in enumerate(records, start=1):
        if not isinstance(record, dict):
            raise DataError(f"cannot read as json: record {number} is a {type(record).__name__}, not an object "
                            '({"query": ..., "positive": ...})', file=path, row=number)
    return Rows(records, list(dict.fromkeys(key for record in records for key in record)))


def _json_lines(text: str, path: str) -> list[Any]:
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise DataError(f"cannot read as json: line {number} is not valid JSON ({err.msg})", file=path,
                            row=number) from err
    return records


def _read_file(path: str, builder: str) -> "datasets.Dataset":
    import datasets

    # datasets logs "Failed to read file ..." itself before raising; our DataError says it once, naming the file.
    builder_logger = logging.getLogger(f"datasets.packaged_modules.{builder}.{builder}")
    level = builder_logger.level
    builder_logger.setLevel(logging.CRITICAL)
    try:
        return datasets.load_dataset(builder, data_files=path, split="train")
    finally:
        builder_logger.setLevel(level)


def _read_hf(path: str, split: str) -> "datasets.Dataset":
    import datasets

    if os.path.isdir(path) and any(os.path.isfile(os.path.join(path, m)) for m in HF_SAVED_MARKERS):
        loaded = datasets.load_from_disk(path)
    else:
        loaded = datasets.load_dataset(path)
    if isinstance(loaded, datasets.Dataset):
        return loaded
    if split in loaded:
        return loaded[split]
    if len(loaded) == 1:
        return next(iter(loaded.values()))
    raise DataError(f"has splits {sorted(loaded)} but no {split!r}; point data.{split} at one split's files", file=path)


# A small dict, not a registry: `data.format` is a Literal in the recipe, so the names are closed.
READERS: dict[str, Callable[[str, str], "datasets.Dataset | Rows"]] = {
    "json": _read_json,
    "csv": lambda path, split: _read_file(path, "csv"),
    "parquet": lambda path, split: _read_file(path, "parquet"),
    "hf": _read_hf,
}


def read_table(path: str, builder: str, split: str) -> "datasets.Dataset | Rows":
    """One file (or `datasets` folder) as a table; parse failures become a `DataError` naming the file."""
    try:
        return READERS[builder](path, split)
    except DataError:
        raise
    except Exception as err:  # noqa: BLE001 - pyarrow/pandas/datasets raise many types; the user needs the file name
        cause = err.__cause__ or err
        first_line = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        raise DataError(f"cannot read as {builder}: {type(cause).__name__}: {first_line}", file=path) from err


def _undecoded_images(table: "datasets.Dataset | Rows", columns: list[str]) -> "datasets.Dataset | Rows":
    """Image features come back as {path, bytes} dicts instead of decoded pictures (memory stays small)."""
    if isinstance(table, Rows):  # no typed columns: image columns hold paths
        return table
    import datasets

    for name in columns:
        feature = table.features.get(name)
        if isinstance(feature, datasets.Image) and feature.decode:
            table = table.cast_column(name, datasets.Image(decode=False))
        elif isinstance(feature, (datasets.List, datasets.LargeList)) and isinstance(feature.feature, datasets.Image):
            table = table.cast_column(name, type(feature)(datasets.Image(decode=False)))
    return table


# --- the report ----------------------------------------------------------------------------------------------------


@dataclass
class BadRow:
    """One skipped row: `row` is the 1-based record number in `file` (a JSONL file's line number, a CSV's data row)."""

    file: str
    row: int
    reason: str  # a key of SKIP_FIXES
    detail: str

    def __str__(self) -> str:
        return f"{self.file}, row {self.row}: {self.detail}"


@dataclass
class DataReport:
    """What `load_examples` read: rows seen, kept, skipped per reason, the first few bad rows."""

    split: str
    files: list[str]
    total: int = 0
    kept: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count
    bad_rows: list[BadRow] = field(default_factory=list)  # the first MAX_BAD_ROWS_SHOWN
    num_hard_negatives: int = 0  # negatives per kept record, after truncation

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def skip(self, file: str, row: int, reason: str, detail: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        if len(self.bad_rows) < MAX_BAD_ROWS_SHOWN:
            self.bad_rows.append(BadRow(file, row, reason, detail))

    def summary(self) -> str:
        files = f"{len(self.files)} files" if len(self.files) != 1 else self.files[0]
        text = f"{self.split}: kept {self.kept} of {self.total} rows from {files}"
        if self.skipped:
            text += " (skipped " + ", ".join(f"{n} {reason}" for reason, n in sorted(self.skipped.items())) + ")"
        return text + f"; {self.num_hard_negatives} hard negatives per record"

    def to_dict(self) -> dict[str, Any]:
        return {
            "split": self.split,
            "files": list(self.files),
            "total": self.total,
            "kept": self.kept,
            "skipped": dict(self.skipped),
            "bad_rows": [vars(bad).copy() for bad in self.bad_rows],
            "num_hard_negatives": self.num_hard_negatives,
        }


# --- rows -> examples ----------------------------------------------------------------------------------------------


class _UnusableImage(Exception):
    """Raised while reading a row whose image (or text) cell cannot be used; the row is skipped under `reason`."""

    def __init__(self, reason: str, detail: str):
        self.reason, self.detail = reason, detail


def _is_null(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _side_text(value: Any, part: str) -> str | None:
    """A text cell of a query, positive or negative: a string, or nothing. A number or a list there is a wrong column
    or a wrongly typed file, not text to embed (str() would train on "12" or "['a', 'b']")."""
    if _is_null(value):
        return None
    if not isinstance(value, str):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise _UnusableImage("bad_text", f"{part} cell holds {type(value).__name__} {shown}, not text")
    return value if value.strip() else None


def _text(value: Any) -> str | None:
    if _is_null(value):
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # CSV integer columns with gaps are read as floats: label 7.0 means "7"
    text = value if isinstance(value, str) else str(value)
    return text if text.strip() else None


def _as_list(value: Any, builder: str) -> list[Any]:
    if _is_null(value):
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    if builder == "csv" and isinstance(value, str) and value.lstrip().startswith("["):
        try:  # a CSV cell cannot hold a list; accept one written as JSON
            parsed = json.loads(value)
        except ValueError:
            parsed = None
        if isinstance(parsed, list):
            return parsed
    return [value]


class _RowReader:
    """Turns the rows of one table into Examples; knows its file, column map and image base directory."""

    def __init__(self, file: str, builder: str, columns: dict[str, str], image_base: str):
        self.file, self.builder, self.columns, self.image_base = file, builder, columns, image_base

    def image(self, value: Any) -> ImageLike | None:
        if _is_null(value):
            return None
        if isinstance(value, dict):  # a datasets Image feature: {"path", "bytes"}
            if value.get("bytes"):
                from PIL import Image

                try:  # opened lazily: only the compressed bytes are held until the record is fetched
                    return Image.open(io.BytesIO(value["bytes"]))
                except Exception as err:  # noqa: BLE001 - PIL raises several types for bad data
                    raise _UnusableImage("bad_image", f"embedded image is not readable: {err}") from None
            value = value.get("path")
            if not value:
                return None
        if not isinstance(value, str):
            from PIL import Image

            if isinstance(value, Image.Image):
                return value
            raise _UnusableImage("bad_image", f"image cell holds {type(value).__name__} {value!r}, not a path")
        if not value.strip():
            return None
        path = os.path.expanduser(value)
        if not os.path.isabs(path):
            path = os.path.join(self.image_base, path)
        path = os.path.normpath(path)
        if not os.path.isfile(path):
            raise _UnusableImage("missing_image", f"image {path!r} not found")
        return path

    def side_images(self, value: Any) -> ImageLike | list[ImageLike] | None:
        """One side's image cell: a path (or embedded image), or a list of them (several images per sample, e.g. a
        JSON list, a parquet list column, a datasets List(Image), or a CSV cell holding a JSON list). A list of one is
        that one image, so single-image adapters read it too."""
        images = [image for image in map(self.image, _as_list(value, self.builder)) if image is not None]
        if not images:
            return None
        return images[0] if len(images) == 1 else images

    def example(self, row: dict[str, Any], number: int, report: DataReport) -> Example | None:
        get = row.get
        try:
            query = Side(_side_text(get("query"), "query"), self.side_images(get("query_image")), role="query")
            positive = Side(_side_text(get("positive"), "positive"), self.side_images(get("positive_image")),
                            role="document")
            if query.is_empty:
                report.skip(self.file, number, "empty_query", "no query text or image")
                return None
            if positive.is_empty:
                report.skip(self.file, number, "empty_positive", "no positive text or image")
                return None
            texts = _as_list(get("negatives"), self.builder)
            images = _as_list(get("negative_images"), self.builder)
            negatives = [Side(_side_text(t, "negatives"), self.side_images(i), role="document")
                         for t, i in zip_longest(texts, images)]
        except _UnusableImage as bad:
            report.skip(self.file, number, bad.reason, bad.detail)
            return None
        return Example(
            query=query,
            positive=positive,
            negatives=[side for side in negatives if not side.is_empty],
            label=_text(get("label")),
            row=number,
            source=self.file,
        )

    def examples(self, table: "datasets.Dataset", report: DataReport, batch_size: int = 1024) -> list[Example]:
        names = {part: name for part, name in self.columns.items() if name in table.column_names}
        table = table.select_columns(list(dict.fromkeys(names.values())))
        out: list[Example] = []
        number = 0
        for batch in table.iter(batch_size=batch_size):
            size = len(next(iter(batch.values())))
            for i in range(size):
                number += 1
                row = {part: batch[name][i] for part, name in names.items()}
                example = self.example(row, number, report)
                if example is not None:
                    out.append(example)
        report.total += number
        return out


def _check_columns(file: str, present: list[str], columns: dict[str, str]) -> None:
    """Every file needs a query column (text or image) and a positive column; say which names were looked for."""
    missing = []
    for side in ("query", "positive"):
        text_col, image_col = columns[side], columns[f"{side}_image"]
        if text_col not in present and image_col not in present:
            hint = did_you_mean(text_col, present) or did_you_mean(image_col, present)
            missing.append(
                f"no {side} column: looked for {text_col!r} (data.columns.{side}) and {image_col!r} "
                f"(data.columns.{side}_image){hint}"
            )
    if missing:
        raise DataError(
            "; ".join(missing) + f"; the file has columns {present}; map yours with data.columns.<part>=<column>",
            file=file,
        )


def _image_base(file: str, image_root: str | None) -> str:
    if image_root is not None:
        return os.path.abspath(os.path.expanduser(image_root))
    path = os.path.abspath(file)
    return path if os.path.isdir(path) else os.path.dirname(path)


# --- the entry point -----------------------------------------------------------------------------------------------


def load_examples(
    data_cfg: "DataConfig", split: str, *, num_hard_negatives: int | None = None
) -> tuple[list[Example], DataReport]:
    """Read the files of `data.<split>` into Examples, with a report of what was skipped and why.

    Rows without query or positive content, or naming an image file that does not exist, are skipped and counted;
    when their share exceeds `data.max_bad_fraction` a `DataError` names the counts and the first bad row.
    `num_hard_negatives` (else `data.num_hard_negatives`, else the smallest count among the kept rows) is the number
    of negatives each record keeps: longer lists are truncated, rows with fewer are skipped as `too_few_negatives`.
    For evaluation splits pass the training report's `num_hard_negatives`, or 0 when negatives are not used.
    """
    value = getattr(data_cfg, split, None)
    if value is None:
        raise RecipeError(f"data.{split}", "is not set; point it at a JSONL/CSV/Parquet file, glob or directory")
    files = resolve_files(value, data_cfg.format, key=f"data.{split}")
    columns = data_cfg.columns.model_dump()
    report = DataReport(split=split, files=files)
    examples: list[Example] = []
    empty: list[str] = []
    for file in files:
        builder = builder_for(file, data_cfg.format)
        table = read_table(file, builder, split)
        if table.num_rows == 0:
            empty.append(file)
            continue
        _check_columns(file, list(table.column_names), columns)
        used = [name for name in columns.values() if name in table.column_names]
        table = _undecoded_images(table, used)
        reader = _RowReader(file, builder, columns, _image_base(file, data_cfg.image_root))
        examples.extend(reader.examples(table, report))

    wanted = num_hard_negatives if num_hard_negatives is not None else data_cfg.num_hard_negatives
    if wanted is None:
        wanted = min((len(example.negatives) for example in examples), default=0)
    else:
        enough = []
        for example in examples:
            if len(example.negatives) < wanted:
                detail = f"has {len(example.negatives)} hard negatives, {wanted} required"
                report.skip(example.source or "?", example.row or 0, "too_few_negatives", detail)
            else:
                enough.append(example)
        examples = enough
    for example in examples:
        del example.negatives[wanted:]
    report.kept, report.num_hard_negatives = len(examples), wanted

    _check_bad_fraction(report, data_cfg.max_bad_fraction)
    for file in empty:  # said only when other files had rows; else the error above says it, once
        logger.warning("%s: no rows, ignored", file)
    logger.info(report.summary())
    return examples, report


def _check_bad_fraction(report: DataReport, max_bad_fraction: float) -> None:
    where = report.files[0] if len(report.files) == 1 else None
    if report.total == 0:
        raise DataError(f"data.{report.split} has no rows", file=where)
    first = report.bad_rows[0] if report.bad_rows else None
    counts = ", ".join(f"{n} {reason}" for reason, n in sorted(report.skipped.items()))
    if report.kept == 0:
        raise DataError(
            f"no usable rows in data.{report.split}: all {report.total} skipped ({counts}); "
            f"first bad row: {first.detail}; {SKIP_FIXES[first.reason]}",
            file=first.file,
            row=first.row,
        )
    fraction = report.num_skipped / report.total
    if fraction > max_bad_fraction:
        raise DataError(
            f"{report.num_skipped} of {report.total} rows of data.{report.split} are unusable ({counts}; "
            f"{fraction:.1%} > data.max_bad_fraction={max_bad_fraction}); first bad row: {first.detail}; "
            f"{SKIP_FIXES[first.reason]}, or raise data.max_bad_fraction or fix the rows",
            file=first.file,
            row=first.row,
        )
    if report.num_skipped:
        logger.warning("%s; first bad row: %s", report.summary(), first)
