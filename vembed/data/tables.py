"""One data file (or local `datasets` folder) read as a table with only the columns a recipe uses.

Small JSON Lines/JSON files are read with the standard library (start-up stays fast for tiny data); larger ones, CSV,
Parquet and local `datasets` folders through `datasets`, whose Arrow cache is memory-mapped and shared by every rank of
a node (node_lock.py: one rank builds it). Image features stay undecoded ({path, bytes}); parse failures become a
`DataError` naming the file.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vembed.data.reader import row_number
from vembed.errors import DataError, did_you_mean

if TYPE_CHECKING:
    import datasets

HF_SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")  # written by `save_to_disk`
# JSON files up to this size are read with the standard library into memory (no `datasets` import, no Arrow cache:
# the demo's start-up); larger ones are memory-mapped through `datasets`, whose cache a second launch reuses.
SMALL_JSON_BYTES = 8 * 2**20


@dataclass
class JsonRows:
    """Records of a small JSON file, read without `datasets`, offering the part of `datasets.Dataset` that
    `load_rows` reads."""

    records: list[dict[str, Any]]
    column_names: list[str]

    @property
    def num_rows(self) -> int:
        return len(self.records)

    def select_columns(self, names: list[str]) -> "JsonRows":
        return JsonRows(self.records, [name for name in self.column_names if name in names])

    def iter(self, batch_size: int):
        for start in range(0, len(self.records), batch_size):
            part = self.records[start : start + batch_size]
            yield {name: [record.get(name) for record in part] for name in self.column_names}


def is_small_json(path: str) -> bool:
    return os.path.isfile(path) and os.path.getsize(path) <= SMALL_JSON_BYTES


def _read_json(path: str, split: str) -> JsonRows:
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
    return JsonRows(records, list(dict.fromkeys(key for record in records for key in record)))


def _json_lines(text: str, path: str) -> list[Any]:
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            # the row is the record it would have been (blank lines are no rows); the line says where in the file
            raise DataError(f"cannot read as json: line {number} is not valid JSON ({err.msg})", file=path,
                            row=row_number(len(records))) from err
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
READERS: dict[str, Callable[[str, str], "datasets.Dataset | JsonRows"]] = {
    "json": lambda path, split: _read_json(path, split) if is_small_json(path) else _read_file(path, "json"),
    "csv": lambda path, split: _read_file(path, "csv"),
    "parquet": lambda path, split: _read_file(path, "parquet"),
    "hf": _read_hf,
}


def read_table(path: str, builder: str, split: str) -> "datasets.Dataset | JsonRows":
    """One file (or `datasets` folder) as a table; parse failures become a `DataError` naming the file."""
    try:
        return READERS[builder](path, split)
    except DataError:
        raise
    except Exception as err:  # noqa: BLE001 - pyarrow/pandas/datasets raise many types; the user needs the file name
        cause = err.__cause__ or err
        first_line = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        raise DataError(f"cannot read as {builder}: {type(cause).__name__}: {first_line}", file=path) from err


def json_parts(table: "datasets.Dataset | JsonRows", columns: dict[str, str]) -> frozenset[str]:
    """The parts whose column `datasets` stores as JSON text (its Json feature, for cells of mixed types)."""
    features = getattr(table, "features", None)
    json_feature = _datasets_json_feature() if features is not None else None
    if json_feature is None:
        return frozenset()
    return frozenset(part for part, name in columns.items() if isinstance(features.get(name), json_feature))


def _datasets_json_feature() -> type | None:
    import datasets

    return getattr(datasets, "Json", None)  # datasets >= 4.1


def _undecoded_images(table: "datasets.Dataset | JsonRows", columns: list[str]) -> "datasets.Dataset | JsonRows":
    """Image features come back as {path, bytes} dicts instead of decoded pictures (memory stays small)."""
    if isinstance(table, JsonRows):  # no typed columns: image columns hold paths
        return table
    import datasets

    for name in columns:
        feature = table.features.get(name)
        if isinstance(feature, datasets.Image) and feature.decode:
            table = table.cast_column(name, datasets.Image(decode=False))
        elif isinstance(feature, (datasets.List, datasets.LargeList)) and isinstance(feature.feature, datasets.Image):
            table = table.cast_column(name, type(feature)(datasets.Image(decode=False)))
    return table


def open_table(file: str, builder: str, split: str, columns: dict[str, str]) -> Any:
    """A file's table with only the columns used, image features undecoded; None when it is empty."""
    from vembed.data.candidate_lists import SCORES, as_pairs, is_candidate_lists

    table = read_table(file, builder, split)
    if table.num_rows == 0:
        return None
    present = list(table.column_names)
    if is_candidate_lists(present, columns):  # {query, documents, scores}: read as pairs (candidate_lists.py)
        table = as_pairs(table.select_columns([name for name in present if name in {*columns.values(), SCORES}]),
                         file, builder, columns)
    check_columns(file, list(table.column_names), columns)
    used = [name for name in dict.fromkeys(columns.values()) if name in table.column_names]
    return _undecoded_images(table.select_columns(used), used)


def check_columns(file: str, present: list[str], columns: dict[str, str]) -> None:
    """Every file needs a query column (text or image) and a positive column; say which names were looked for."""
    missing = []
    for side in ("query", "positive"):
        text_col, image_col = columns[side], columns[f"{side}_image"]
        if text_col not in present and image_col not in present:
            hint = did_you_mean(text_col, present) or did_you_mean(image_col, present)
            # the candidate-list shape (vembed/data/candidate_lists.py) gives the positive as the first document
            alternative = f", or a list {columns['documents']!r} (data.columns.documents)" if side == "positive" \
                and "documents" in columns else ""
            missing.append(
                f"no {side} column: looked for {text_col!r} (data.columns.{side}) and {image_col!r} "
                f"(data.columns.{side}_image){alternative}{hint}"
            )
    if missing:
        raise DataError(
            "; ".join(missing) + f"; the file has columns {present}; map yours with data.columns.<part>=<column>",
            file=file,
        )
