"""The samples of a stream: reading shards (tar files through webdataset, data files through `datasets`) into raw
records, and turning a raw record into an `Example` with its images decoded, or into a counted skip.
"""

from __future__ import annotations

import dataclasses

import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vembed.data.candidate_lists import SCORES, ListRowError, as_row_of_pairs
from vembed.data.images import IMAGE_EXTENSIONS, load_image
from vembed.data.records import Example, Side
from vembed.errors import DataError

if TYPE_CHECKING:
    from vembed.data.streaming import SlotPosition

SIDE_IMAGE_EXTENSIONS = tuple(ext.lstrip(".") for ext in IMAGE_EXTENSIONS)


# --- reading shards ------------------------------------------------------------------------------------------------


@dataclass
class RawRecord:
    """One sample as stored: a tar member group ({ext: bytes}) or a data file's row ({column: value})."""

    file: str
    row: int  # 1-based position in `file`
    fields: dict[str, Any]


ErrorSink = Callable[[str, Exception], None]


def _error_file(exn: Exception, files: Sequence[str]) -> str:
    # webdataset appends the url it was reading to the exception's arguments.
    known = set(files)
    return next((arg for arg in exn.args if isinstance(arg, str) and arg in known), "?")


def read_webdataset(files: Sequence[str], on_error: ErrorSink) -> Iterator[RawRecord]:
    """Samples of tar shards, grouped by key (`0001.png` + `0001.txt` → {"png": ..., "txt": ...}) by webdataset.
    A shard that cannot be read goes to `on_error` and the stream goes on with the next one."""
    from webdataset.tariterators import tarfile_samples

    def handler(exn: Exception) -> bool:
        on_error(_error_file(exn, files), exn)
        return True  # go on

    current, row = None, 0
    for sample in tarfile_samples([{"url": path} for path in files], handler=handler):
        url = sample.get("__url__")
        row = row + 1 if url == current else 1
        current = url
        fields = {name: value for name, value in sample.items() if not name.startswith("__")}
        yield RawRecord(url, row, {**fields, "__key__": sample["__key__"]})


def read_data_files(files: Sequence[str], on_error: ErrorSink) -> Iterator[RawRecord]:
    """Rows of JSONL/CSV/Parquet files, streamed by `datasets` (nothing converted to Arrow on disk). `iter` rather
    than `for row in dataset`: inside a DataLoader worker the latter splits the file's shards across workers again."""
    import datasets

    from vembed.data.paths import builder_for

    for path in files:
        row = 0
        try:
            stream = datasets.load_dataset(builder_for(path), data_files=path, split="train", streaming=True)
            features = stream.features or {}
            for name, feature in features.items():  # images stay undecoded bytes until the sample is used
                if isinstance(feature, datasets.Image) and feature.decode:
                    stream = stream.cast_column(name, datasets.Image(decode=False))
            for batch in stream.iter(batch_size=256):
                columns = list(batch)
                for values in zip(*batch.values()):
                    row += 1
                    yield RawRecord(path, row, dict(zip(columns, values)))
        except Exception as err:  # noqa: BLE001 - pyarrow/datasets raise many types; the file is counted as bad
            on_error(path, err)


READERS: dict[str, Callable[[Sequence[str], ErrorSink], Iterator[RawRecord]]] = {
    "webdataset": read_webdataset,
    "datasets": read_data_files,
}


# --- records -> examples -------------------------------------------------------------------------------------------


class SampleSkipped(Exception):
    """A sample that cannot be used, and why (a key of streaming.STREAM_SKIP_FIXES)."""

    def __init__(self, reason: str, detail: str):
        self.reason, self.detail = reason, detail


class SampleDecoder:
    """A raw sample → an `Example` with its images decoded, or a counted skip. Which field is which part follows
    `data.columns`: a tar member whose extension is the column name (`caption` → `0001.caption`), else the field of
    that name in the sample's `.json`; data-file rows by column, as the map-style path reads them. With the default
    names, a tar sample's `.txt` is the query and its image (`.jpg`/`.png`/...) the positive, as open_clip pairs them.
    """

    def __init__(self, columns: dict[str, str], image_root: str | None, num_negatives: int,
                 max_images_per_side: int | None, defaults: dict[str, str] | None = None, keep_encoded: bool = False,
                 required_modalities: frozenset[str] = frozenset(),
                 lacks: Callable[[Example], tuple[str, str] | None] | None = None):
        # What the loss reads that a record may lack (vembed.losses.inputs.record_lacks): such samples are counted
        # skips, as rows read whole are refused before training, never a batch the loss cannot read.
        self.lacks = lacks
        self.keep_encoded = keep_encoded  # return images still compressed (checked by one decode): samples held long
        self.required_modalities = required_modalities  # the adapter's modalities_per_record
        self.columns = columns
        self.image_root = image_root
        self.num_negatives = num_negatives
        self.max_images_per_side = max_images_per_side
        self.defaults = defaults if defaults is not None else _default_columns()

    def __call__(self, record: RawRecord, position: SlotPosition) -> Example | None:
        try:
            example = self._example(record, position)
            if example is None:
                return None
            sides = [example.query, example.positive, *example.negatives]
            if self.max_images_per_side is not None and any(len(s.images) > self.max_images_per_side for s in sides):
                raise SampleSkipped("too_many_images", f"a side has more than {self.max_images_per_side} image(s)")
            fed = {"text"} if any(s.text for s in sides) else set()
            fed |= {"image"} if any(s.image is not None for s in sides) else set()
            missing = sorted(self.required_modalities - fed)
            if missing:
                raise SampleSkipped("missing_modality", f"has no {' or '.join(missing)}")
            lacked = self.lacks(example) if self.lacks is not None else None
            if lacked is not None:
                raise SampleSkipped(*lacked)
            decoded = _decoded(example)
            return example if self.keep_encoded else decoded
        except SampleSkipped as skip:
            position.skip(record.file, record.row, skip.reason, f"sample {self._name(record)}: {skip.detail}")
        except DataError as err:  # an image that does not decode
            position.skip(record.file, record.row, "bad_image", f"sample {self._name(record)}: {err.args[0]}")
        return None

    @staticmethod
    def _name(record: RawRecord) -> str:
        return str(record.fields.get("__key__", record.row))

    def parts_of(self, record: RawRecord) -> dict[str, Any]:
        """The record's fields by part (query, positive_image, ...), still undecoded. A candidate list (`{query,
        documents, scores}`) is split as the map-style path splits it (vembed/data/candidate_lists.py); its bad rows
        are `SampleSkipped`, counted as a stream counts every bad sample."""
        tar = "__key__" in record.fields
        cells = self._tar_cells(record.fields) if tar else record.fields
        try:
            cells = as_row_of_pairs(cells, "json" if tar else _builder(record.file), self.columns, record.file,
                                    record.row)
        except ListRowError as err:
            raise SampleSkipped(err.reason, err.detail) from None
        return {part: cells[name] for part, name in self.columns.items() if name in cells}

    def _example(self, record: RawRecord, position: SlotPosition) -> Example | None:
        from vembed.data.reader import RowReader, Skipped  # the map-style rules for a row: one place for a cell

        tar = "__key__" in record.fields
        row = self.parts_of(record)
        base = self.image_root or os.path.dirname(record.file)
        reader = RowReader(record.file, "json" if tar else _builder(record.file), self.columns, base)
        try:
            example = reader.example(row, record.row)
        except Skipped as skipped:
            raise SampleSkipped(skipped.reason, skipped.detail) from None
        if len(example.negatives) < self.num_negatives:
            raise SampleSkipped("too_few_negatives", f"has {len(example.negatives)} hard negatives, "
                                             f"{self.num_negatives} required")
        example.keep_negatives(self.num_negatives)
        return example

    def _tar_cells(self, fields: dict[str, Any]) -> dict[str, Any]:
        """A tar sample's cells by column name: the member named as the column, else the field of its `.json` (where
        a candidate list's `scores` are read too), else open_clip's pairing (a side's image: its positive, so a
        `.json` documents list beside it is not a candidate list, as a file's positive_image column would say)."""
        meta: dict[str, Any] = {}
        if "json" in fields:
            try:
                meta = json.loads(fields["json"])
            except (ValueError, UnicodeDecodeError) as err:
                raise SampleSkipped("bad_json", f".json is not valid JSON ({err})") from None
            if not isinstance(meta, dict):
                raise SampleSkipped("bad_json", f".json holds a {type(meta).__name__}, not an object")
        cells: dict[str, Any] = {SCORES: meta[SCORES]} if SCORES in meta else {}
        for part, name in self.columns.items():
            key = name.lower()
            if key in fields and key != "json":
                cells[name] = _member_value(part, fields[key])
            elif name in meta:
                cells[name] = meta[name]
        used = {name.lower() for name in self.columns.values()}
        for part, member in self.defaults.items():
            # open_clip's pairing fills a side only while that side's columns keep their default names (so a part is
            # its column's name) and none was found, and only from a member no column claims.
            side = part.removesuffix("_image")
            renamed = self.columns[side] != side or self.columns[f"{side}_image"] != f"{side}_image"
            if renamed or side in cells or f"{side}_image" in cells:
                continue
            found = _first_image(fields, used) if member == "image" else (member if member in fields else None)
            if found is not None and found not in used:
                cells[part] = _member_value(part, fields[found])
        return cells


def _default_columns() -> dict[str, str]:
    return {"query": "txt", "positive_image": "image"}


def _first_image(fields: dict[str, Any], used: set[str]) -> str | None:
    return next((ext for ext in SIDE_IMAGE_EXTENSIONS if ext in fields and ext not in used), None)


def _member_value(part: str, data: bytes) -> Any:
    if part.endswith("image") or part == "negative_images":
        return {"bytes": data}
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise SampleSkipped("bad_text", f"member for {part} is not UTF-8 text ({err.reason})") from None
    if part in ("negatives", "documents"):  # a JSON list, else one per line
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = None
        return parsed if isinstance(parsed, list) else [line for line in text.splitlines() if line.strip()]
    return text


def _builder(path: str) -> str:
    from vembed.data.paths import builder_for

    return builder_for(path)


def _decoded(example: Example) -> Example:
    def side(s: Side) -> Side:
        if s.image is None:
            return s
        images = [load_image(i) for i in s.image] if isinstance(s.image, list) else load_image(s.image)
        return Side(s.text, images, s.role)

    return dataclasses.replace(example, query=side(example.query), positive=side(example.positive),
                               negatives=[side(n) for n in example.negatives])
