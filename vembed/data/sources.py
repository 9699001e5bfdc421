"""Data sources: find the files a recipe names, check every row, and hand out the kept ones as records made on fetch.

Small JSON Lines/JSON files are read with the standard library (start-up stays fast for tiny data); larger ones, CSV,
Parquet and local `datasets` folders through `datasets`, whose Arrow cache is memory-mapped: built once per node (one
rank builds while the others wait on a file lock, then map it), shared by every rank. Rows are checked column by
column (`vembed/data/checks.py`); unusable ones are skipped and counted, and records are made only when fetched
(`vembed/data/rows.py`). Images stay as absolute paths here; they are decoded when a record is fetched by
`PairDataset`.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from vembed.data.reader import SKIP_FIXES, RowReader, Skipped, SourceSettings
from vembed.data.records import Example
from vembed.errors import DataError, RecipeError, did_you_mean

if TYPE_CHECKING:
    import datasets

    from vembed.data.checks import RowChecks
    from vembed.data.rows import PairRows
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
# JSON files up to this size are read with the standard library into memory (no `datasets` import, no Arrow cache:
# the demo's start-up); larger ones are memory-mapped through `datasets`, whose cache a second launch reuses.
SMALL_JSON_BYTES = 8 * 2**20


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
    is built; a RecipeError names the first that does not. A corpus folder must judge its qrels split."""
    from vembed.data.corpus import corpus_sources

    for split in splits:
        value = getattr(data, split)
        if value is None:
            continue
        corpora = corpus_sources(data, split)
        for corpus in corpora.values():
            corpus.check()
        sources = data.sources(split)
        if sources is None and None not in corpora:
            resolve_files(value, data.format, key=f"data.{split}")
        for name, source in (sources or {}).items():
            if name in corpora:
                continue
            resolve_files(source.files, source.format, key=f"data.{split}.{name}.files")
            if source.image_root is not None and not os.path.isdir(source.image_root):
                raise RecipeError(f"data.{split}.{name}.image_root", f"directory {source.image_root!r} not found")
    if data.image_root is not None and not os.path.isdir(data.image_root):
        raise RecipeError("data.image_root", f"directory {data.image_root!r} not found")
    if data.hard_negatives is not None and "train" in splits:
        if None not in corpus_sources(data, "train"):
            raise RecipeError("data.hard_negatives", "gives negatives by id for a corpus folder; data.train is not "
                                                     "one (pairs files carry their negatives in a column)")
        if not os.path.isfile(data.hard_negatives):
            raise RecipeError("data.hard_negatives", f"file {data.hard_negatives!r} not found")


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
    """Records of a small JSON file, read without `datasets`, offering the part of `datasets.Dataset` that
    `load_rows` reads."""

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


def _small(path: str) -> bool:
    return os.path.isfile(path) and os.path.getsize(path) <= SMALL_JSON_BYTES


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
    "json": lambda path, split: _read_json(path, split) if _small(path) else _read_file(path, "json"),
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


def _json_parts(table: "datasets.Dataset | Rows", columns: dict[str, str]) -> frozenset[str]:
    """The parts whose column `datasets` stores as JSON text (its Json feature, for cells of mixed types)."""
    features = getattr(table, "features", None)
    json_feature = _datasets_json_feature() if features is not None else None
    if json_feature is None:
        return frozenset()
    return frozenset(part for part, name in columns.items() if isinstance(features.get(name), json_feature))


def _datasets_json_feature() -> type | None:
    import datasets

    return getattr(datasets, "Json", None)  # datasets >= 4.1


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
    """What `load_rows` read of one split (or one named source of it): rows seen, kept, skipped per reason, the first
    few bad rows."""

    split: str
    files: list[str]
    total: int = 0
    kept: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count
    bad_rows: list[BadRow] = field(default_factory=list)  # the first MAX_BAD_ROWS_SHOWN
    num_hard_negatives: int = 0  # negatives per kept record, after truncation
    source: str | None = None  # the named source (data.train: {name: ...}), if any
    # Rows left out for holding fewer hard negatives than num_hard_negatives. Not bad data (`vembed mine` leaves out
    # queries it found too few negatives for, on purpose), so not counted against data.max_bad_fraction.
    short: int = 0

    @property
    def key(self) -> str:
        """The recipe key these rows came from: data.train, or data.train.<source>."""
        return f"data.{self.split}" + (f".{self.source}" if self.source else "")

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def skip(self, file: str, row: int, reason: str, detail: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        if len(self.bad_rows) < MAX_BAD_ROWS_SHOWN:
            self.bad_rows.append(BadRow(file, row, reason, detail))

    def summary(self) -> str:
        files = f"{len(self.files)} files" if len(self.files) != 1 else self.files[0]
        name = f"{self.split}/{self.source}" if self.source else self.split
        text = f"{name}: kept {self.kept} of {self.total} rows from {files}"
        if self.skipped:
            text += " (skipped " + ", ".join(f"{n} {reason}" for reason, n in sorted(self.skipped.items())) + ")"
        text += f"; {self.num_hard_negatives} hard negatives per record"
        return text + (f" ({self.short} rows with fewer left out)" if self.short else "")

    def to_dict(self) -> dict[str, Any]:
        return {
            "split": self.split,
            "files": list(self.files),
            "total": self.total,
            "kept": self.kept,
            "skipped": dict(self.skipped),
            "bad_rows": [vars(bad).copy() for bad in self.bad_rows],
            "num_hard_negatives": self.num_hard_negatives,
            "short_of_negatives": self.short,
            **({"source": self.source} if self.source else {}),
        }


# --- the entry points ----------------------------------------------------------------------------------------------


@dataclass
class SourcesReport:
    """What `load_rows` read from a split of named sources: one `DataReport` per source."""

    split: str
    sources: dict[str, "DataReport"]

    @property
    def num_skipped(self) -> int:
        return sum(report.num_skipped for report in self.sources.values())

    @property
    def kept(self) -> int:
        return sum(report.kept for report in self.sources.values())

    def summary(self) -> str:
        return "; ".join(report.summary() for report in self.sources.values())

    def to_dict(self) -> dict[str, Any]:
        return {"split": self.split, "sources": {name: report.to_dict() for name, report in self.sources.items()}}


def load_rows(
    data_cfg: "DataConfig", split: str, *, num_hard_negatives: int | None = None
) -> "tuple[PairRows, DataReport | SourcesReport]":
    """The kept rows of `data.<split>` as records made on fetch, with a report of what was skipped and why.

    Rows without query or positive content, or naming an image file that does not exist, are skipped and counted;
    when their share exceeds `data.max_bad_fraction` a `DataError` names the counts and the first bad row.
    `num_hard_negatives` (else `data.num_hard_negatives`, else the smallest count among the kept rows) is the number
    of negatives each record keeps: longer lists are cut, rows with fewer are left out and counted as `short` (not
    bad data: they do not count against `data.max_bad_fraction`).
    For evaluation splits pass 0 when negatives are not used. A split of named sources gives their records one
    source after another (`PairRows.source_ranges`), each source checked, counted and given negatives on its own.
    """
    from vembed.data.rows import PairRows

    value = getattr(data_cfg, split, None)
    if value is None:
        raise RecipeError(f"data.{split}", "is not set; point it at a JSONL/CSV/Parquet file, glob or directory")
    from vembed.data.corpus import corpus_sources

    corpora = corpus_sources(data_cfg, split)
    if corpora:
        wanted = num_hard_negatives if num_hard_negatives is not None else data_cfg.num_hard_negatives
        return _load_corpus_pairs(data_cfg, split, corpora, wanted)
    if data_cfg.hard_negatives is not None and split == "train":
        raise RecipeError("data.hard_negatives", "gives negatives by id for a corpus folder; data.train is not one "
                                                 "(pairs files carry their negatives in a column)")
    sources = data_cfg.sources(split)
    if sources is None:
        wanted = num_hard_negatives if num_hard_negatives is not None else data_cfg.num_hard_negatives
        return _load_source(value, split, data_cfg.format, data_cfg.columns.model_dump(), data_cfg.image_root,
                            wanted, data_cfg.max_bad_fraction, SourceSettings(), data_cfg.score_range)
    loaded = {}
    for name, source in sources.items():
        wanted = num_hard_negatives if num_hard_negatives is not None else source.num_hard_negatives
        settings = SourceSettings(name, source.query_prompt, source.query_instruction)
        loaded[name] = _load_source(source.files, split, source.format, source.columns.model_dump(),
                                    source.image_root, wanted, data_cfg.max_bad_fraction, settings,
                                    data_cfg.score_range)
    rows = PairRows.concat([rows for rows, _ in loaded.values()])
    return rows, SourcesReport(split, {name: report for name, (_, report) in loaded.items()})


def _load_corpus_pairs(data_cfg: "DataConfig", split: str, corpora: dict, wanted: int | None
                       ) -> "tuple[Any, DataReport]":
    """A corpus folder's (query, relevant document) pairs (vembed/data/corpus.py, `CorpusPairs`), with hard
    negatives by id from data.hard_negatives."""
    from vembed.data.corpus import CorpusPairs, read_hard_negatives

    if None not in corpora:
        name = next(iter(corpora))
        raise RecipeError(f"data.{split}.{name}.files", "a corpus folder is not yet a named source of training data; "
                                                        f"give it as data.{split} itself")
    corpus = corpora[None].load()
    path = data_cfg.hard_negatives if split == "train" else None
    if path is not None and not os.path.isfile(path):
        raise RecipeError("data.hard_negatives", f"file {path!r} not found")
    negatives = read_hard_negatives(path, corpus) if path is not None else None
    if wanted is None:  # the smallest number the file lists for a query, as for pairs files; pairs it does not list
        # (queries `vembed mine` found too few negatives for) are left out as short
        counts = [len(found) for found in (negatives or {}).values()]
        wanted = min(counts) if counts else 0
    pairs = CorpusPairs(corpus, negatives, wanted)
    files = [corpus.folder] + ([path] if path else [])
    report = DataReport(split=split, files=files, total=pairs.total, kept=len(pairs), num_hard_negatives=wanted,
                        short=pairs.too_few)
    if not len(pairs):
        raise DataError(f"no (query, relevant document) pair of qrels/{corpus.split}.tsv is usable"
                        + (f" ({pairs.too_few} have fewer than {wanted} hard negatives)" if pairs.too_few else ""),
                        corpus.folder)
    _check_bad_fraction(report, data_cfg.max_bad_fraction)
    logger.info(report.summary())
    return pairs, report


def load_examples(
    data_cfg: "DataConfig", split: str, *, num_hard_negatives: int | None = None
) -> "tuple[list[Example], DataReport | SourcesReport]":
    """`load_rows` with every record made now, as a list (evaluation splits, small data, the Python API)."""
    rows, report = load_rows(data_cfg, split, num_hard_negatives=num_hard_negatives)
    return list(rows), report


def _load_source(value: Any, split: str, format: str, columns: dict[str, str], image_root: str | None,
                 wanted: int | None, max_bad_fraction: float, settings: SourceSettings,
                 score_range: tuple[float, float] | None = None) -> "tuple[PairRows, DataReport]":
    from vembed.data.checks import check_rows
    from vembed.data.rows import PairRows, TablePart

    key = f"data.{split}.{settings.name}.files" if settings.name else f"data.{split}"
    files = resolve_files(value, format, key=key)
    report = DataReport(split=split, files=files, source=settings.name)
    checked: list[tuple[RowReader, Any, "RowChecks"]] = []
    empty: list[str] = []
    for file in files:
        builder = builder_for(file, format)
        with _one_builder_per_node(file, builder):
            table = _open_table(file, builder, split, columns)
            if table is None:
                empty.append(file)
                continue
            reader = RowReader(file, builder, columns, _image_base(file, image_root), settings,
                               json_parts=_json_parts(table, columns))
            checks = check_rows(table, reader)
            if checks.read_the_table:
                # Checking read every page of the text columns into this process's memory map; training reads
                # rows from a fresh mapping of the same file, and the old one (and its pages) is let go.
                table = _open_table(file, builder, split, columns)
        report.total += table.num_rows
        check_scores(reader, table, checks, score_range)
        _count_skipped(report, reader, table, checks)
        checked.append((reader, table, checks))

    usable = [(reader, table, checks, checks.reason == 0) for reader, table, checks in checked]
    if wanted is None:
        wanted = min((int(checks.negatives[ok].min()) for _, _, checks, ok in usable if ok.any()), default=0)
    parts = []
    for reader, table, checks, ok in usable:
        too_few = ok & (checks.negatives < wanted)
        report.short += int(too_few.sum())
        kept = _positions(ok & ~too_few)
        # Every row kept (the usual case): the checks as they are, not a second copy of them
        parts.append(TablePart(reader, table, kept, checks if len(kept) == len(ok) else _select(checks, kept), wanted))
    rows = PairRows(parts)
    report.kept, report.num_hard_negatives = len(rows), wanted
    _check_bad_fraction(report, max_bad_fraction)
    for file in empty:  # said only when other files had rows; else the error above says it, once
        logger.warning("%s: no rows, ignored", file)
    logger.info(report.summary())
    return rows, report


def _open_table(file: str, builder: str, split: str, columns: dict[str, str]) -> Any:
    """A file's table with only the columns used, image features undecoded; None when it is empty."""
    table = read_table(file, builder, split)
    if table.num_rows == 0:
        return None
    _check_columns(file, list(table.column_names), columns)
    used = [name for name in dict.fromkeys(columns.values()) if name in table.column_names]
    return _undecoded_images(table.select_columns(used), used)


def _positions(kept: np.ndarray) -> np.ndarray:
    """Positions of the kept rows, 4 bytes each where the table allows (a rank holds them for the whole run)."""
    positions = np.flatnonzero(kept)
    return positions.astype(np.int32) if len(kept) < 2**31 else positions


def _select(checks: "RowChecks", positions: np.ndarray) -> "RowChecks":
    from vembed.data.checks import FIELDS, RowChecks

    return RowChecks(*(getattr(checks, name)[positions] for name in FIELDS))


def check_scores(reader: RowReader, table: Any, checks: "RowChecks",
                 score_range: tuple[float, float] | None) -> None:
    """Scores are the training target, so a bad one stops the run (a skipped row would silently change it): a cell
    that is not a number or a list of numbers, a score outside data.score_range, a list of teacher scores whose
    length is not 1 + the row's hard negatives. One `DataError` naming the first such row."""
    from vembed.data.checks import CODE
    from vembed.data.rows import TablePart

    key = f"data.columns.score ({reader.columns['score']!r})"
    bad = np.flatnonzero(checks.reason == CODE["bad_score"])
    if len(bad):
        detail = "not a number"
        try:
            reader.example(TablePart(reader, table, bad, checks, 0)._row(int(bad[0])), int(bad[0]) + 1)
        except Skipped as skipped:
            detail = skipped.detail
        raise DataError(f"{key}: {detail} ({len(bad)} such rows); {SKIP_FIXES['bad_score']}", file=reader.file,
                        row=int(bad[0]) + 1)
    usable = checks.reason == 0
    if score_range is not None:
        low, high = score_range
        with np.errstate(invalid="ignore"):
            outside = usable & ((checks.score_low < low) | (checks.score_high > high))
        if outside.any():
            first = int(np.flatnonzero(outside)[0])
            found = checks.score_low[first] if checks.score_low[first] < low else checks.score_high[first]
            raise DataError(f"{key}: score {found:g} is outside data.score_range [{low:g}, {high:g}] "
                            f"({int(outside.sum())} such rows); fix the rows or widen data.score_range",
                            file=reader.file, row=first + 1)
    lists = usable & (checks.scores > 0)
    wrong = lists & (checks.scores != checks.negatives + 1)
    if wrong.any():
        first = int(np.flatnonzero(wrong)[0])
        raise DataError(f"{key}: a list of {int(checks.scores[first])} teacher scores for a row with "
                        f"{int(checks.negatives[first])} hard negatives; give one score for the positive and one per "
                        f"negative ({int(checks.negatives[first]) + 1}), in order ({int(wrong.sum())} such rows)",
                        file=reader.file, row=first + 1)


def _count_skipped(report: "DataReport", reader: RowReader, table: Any, checks: "RowChecks") -> None:
    """Add a file's skip counts to the report, and the first bad rows with the reader's own words for them."""
    from vembed.data.checks import REASONS
    from vembed.data.rows import TablePart

    bad = np.flatnonzero(checks.reason)
    if not len(bad):
        return
    codes, counts = np.unique(checks.reason[bad], return_counts=True)
    for code, count in zip(codes, counts):
        report.skipped[REASONS[code]] = report.skipped.get(REASONS[code], 0) + int(count)
    part = TablePart(reader, table, bad, checks, 0)
    for position in bad[: max(0, MAX_BAD_ROWS_SHOWN - len(report.bad_rows))]:
        reason, detail = REASONS[checks.reason[position]], "unusable row"
        try:
            reader.example(part._row(int(position)), int(position) + 1)
        except Skipped as skipped:
            reason, detail = skipped.reason, skipped.detail
        report.bad_rows.append(BadRow(reader.file, int(position) + 1, reason, detail))


@contextlib.contextmanager
def _one_builder_per_node(file: str, builder: str) -> Iterator[None]:
    """Around reading a file through `datasets` and checking its rows: the first rank of a node to get here builds
    the Arrow cache and the checks; the others wait, then find both built and map them. A file lock, not a barrier:
    ranks read their data before the accelerator (and the process group) exists. Small JSON files need none."""
    if builder == "json" and _small(file):
        yield
        return
    import datasets
    from filelock import FileLock

    if os.environ.get("LOCAL_RANK", "0") != "0":
        datasets.disable_progress_bars()  # one progress bar per node, not one per rank
    locks = os.path.join(datasets.config.HF_DATASETS_CACHE, "vembed-locks")
    os.makedirs(locks, exist_ok=True)
    name = hashlib.sha256(os.path.abspath(file).encode()).hexdigest()[:24]
    with FileLock(os.path.join(locks, f"{name}.lock")):
        yield


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


def _check_bad_fraction(report: DataReport, max_bad_fraction: float) -> None:
    where = report.files[0] if len(report.files) == 1 else None
    if report.total == 0:
        raise DataError(f"{report.key} has no rows", file=where)
    first = report.bad_rows[0] if report.bad_rows else None
    counts = ", ".join(f"{n} {reason}" for reason, n in sorted(report.skipped.items()))
    if report.kept == 0 and first is None:  # every row short of negatives
        raise DataError(f"no usable rows in {report.key}: all {report.total} have fewer than "
                        f"{report.num_hard_negatives} hard negatives; {SKIP_FIXES['too_few_negatives']}", file=where)
    if report.short:
        counts += f"; {report.short} left out with fewer than {report.num_hard_negatives} hard negatives"
    if report.kept == 0:
        raise DataError(
            f"no usable rows in {report.key}: all {report.total} skipped ({counts}); "
            f"first bad row: {first.detail}; {SKIP_FIXES[first.reason]}",
            file=first.file,
            row=first.row,
        )
    fraction = report.num_skipped / report.total
    if fraction > max_bad_fraction:
        raise DataError(
            f"{report.num_skipped} of {report.total} rows of {report.key} are unusable ({counts}; "
            f"{fraction:.1%} > data.max_bad_fraction={max_bad_fraction}); first bad row: {first.detail}; "
            f"{SKIP_FIXES[first.reason]}, or raise data.max_bad_fraction or fix the rows",
            file=first.file,
            row=first.row,
        )
    if report.num_skipped:
        logger.warning("%s; first bad row: %s", report.summary(), first)
