"""Labelled images for classification and metric learning, in the layouts people have: an ImageFolder tree
(`<dir>/<class>/*.png`), a CSV/JSONL file with an `image` column (a path, relative to data.image_root or the file's
folder) and a `label` column (data.columns.label), or a Hugging Face `datasets` table with an Image feature `image` and
a label column: a folder written by `save_to_disk`, or a Parquet file as `datasets` writes it ({bytes, path} cells).

Labels become ids through the class names: folder names, a ClassLabel feature's names (in its id order), or the label
column's distinct values (sorted; integer labels are ids already, 0..num_labels-1). Rows whose image is missing (no
file, empty or unreadable embedded bytes) are skipped and counted; above data.max_bad_fraction the run stops.
Embedded images are opened when fetched, not decoded up front (only their headers are read, to find the bad ones).
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vembed.data.images import IMAGE_EXTENSIONS, load_image
from vembed.data.reader import row_number
from vembed.errors import DataError, RecipeError

if TYPE_CHECKING:
    from PIL import Image

    from vembed.data.image_cache import CachedPixels, ImageCache

IMAGE_COLUMN = "image"


@dataclass
class EmbeddedImages:
    """Images stored in a `datasets` table's Image column: `rows` maps an image's key (`<source>#<position>`) to its
    position in the table.
    `files` are the files the table is read from: their size and modification time key the image cache."""

    source: str
    table: Any  # datasets.Dataset with only the image column, undecoded ({bytes, path})
    files: list[str]
    rows: dict[str, int] = field(default_factory=dict)

    def open(self, key: str) -> "Image.Image":
        """The image, opened lazily (its bytes are decoded when used), or a `DataError` naming the row."""
        from PIL import Image

        row = self.rows[key]
        try:
            return Image.open(io.BytesIO(self.table[row][IMAGE_COLUMN]["bytes"]))
        except Exception as err:  # noqa: BLE001 - PIL raises several types for bad data
            raise DataError(f"image column {IMAGE_COLUMN!r}: cannot decode the embedded image: {err}",
                            file=self.source, row=row_number(row)) from None

    def stamp(self) -> str:
        parts = []
        for file in self.files:
            try:
                stat = os.stat(file)
                parts.append(f"{file}\0{stat.st_size}\0{stat.st_mtime_ns}")
            except OSError:
                parts.append(f"{file}\0-1")
        return "\0".join(parts)


@dataclass
class LabelledImages:
    """Images, their label ids and what was skipped; `names` are the classes in id order. `paths` are the images'
    keys: a file path, or `<source>#<position>` for an image embedded in a table (`embedded`). `rows`: each image's
    row in a table (reader.row_number), as `skipped` names them; empty for an ImageFolder tree. With `cache` (the
    training images resized once, vembed/data/image_cache.py), `image(i)` gives the cached pixels."""

    source: str
    paths: list[str] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)  # {"row": its row, or None in a tree; "reason"}
    rows: list[int] = field(default_factory=list)
    num_rows: int | None = None  # rows of a table read (unset: paths + skipped)
    embedded: EmbeddedImages | None = None
    cache: "ImageCache | None" = None

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)

    def image(self, index: int) -> "str | Image.Image | CachedPixels":
        """What the collator preprocesses for image `index`: cached pixels, a lazily opened image, or a file path."""
        key = self.paths[index]
        if self.cache is not None and key in self.cache:
            return self.cache.pixels(key)
        if self.embedded is not None and key in self.embedded.rows:
            return self.embedded.open(key)
        return key

    def load(self, key: str) -> "Image.Image":
        """Image `key` decoded (the image cache's build reads it so); `DataError` naming the file or row."""
        if self.embedded is not None and key in self.embedded.rows:
            return load_image(self.embedded.open(key))
        return load_image(key)

    def stamp(self, key: str) -> str | None:
        """What changes when image `key` changes, for the cache key: the table's files for an embedded image; None
        for a file (the cache stats it)."""
        if self.embedded is not None and key in self.embedded.rows:
            return self.embedded.stamp()
        return None

    def head(self, limit: int | None) -> "LabelledImages":
        """The first `limit` images (data.eval_max_samples); all when unset."""
        if limit is None:
            return self
        return replace(self, paths=self.paths[:limit], labels=self.labels[:limit], rows=self.rows[:limit])

    def without(self, bad: dict[str, str]) -> "LabelledImages":
        """Images whose key is in `bad` (key -> why) moved to `skipped`, in place (found decoding every image)."""
        keep = [i for i, key in enumerate(self.paths) if key not in bad]
        for i, key in enumerate(self.paths):
            if key in bad:
                self.skipped.append({"row": self.rows[i] if self.rows else None, "reason": bad[key]})
        self.paths, self.labels = [self.paths[i] for i in keep], [self.labels[i] for i in keep]
        self.rows = [self.rows[i] for i in keep] if self.rows else []
        return self

    def add(self, path: str, label: int, position: int) -> None:
        """Keep the image of the table row at `position`."""
        self.paths.append(path)
        self.labels.append(label)
        self.rows.append(row_number(position))

    def skip(self, position: int, reason: str) -> None:
        """Skip the table row at `position`, saying why."""
        self.skipped.append({"row": row_number(position), "reason": reason})

    def check_bad_fraction(self, max_bad_fraction: float, how: str = "") -> None:
        """data.max_bad_fraction over the rows read: skipped rows above it stop the run, naming the first."""
        total = self.num_rows if self.num_rows is not None else len(self.paths) + self.num_skipped
        if total and self.num_skipped / total > max_bad_fraction:
            raise DataError(f"{self.num_skipped} of {total} rows have no image file or no readable image{how} "
                            f"(more than data.max_bad_fraction={max_bad_fraction}); first: {self._first_skipped()}; "
                            "fix or remove those images (check the paths and data.image_root), or raise "
                            "data.max_bad_fraction", file=self.source)

    def _first_skipped(self) -> str:
        first = self.skipped[0]
        return (f"row {first['row']}: " if first["row"] is not None else "") + first["reason"]

    def summary(self) -> str:
        text = f"{len(self.paths)} images of {len(set(self.labels))} classes from {self.source}"
        if self.skipped:
            text += f"; skipped {len(self.skipped)} row(s), first {self._first_skipped()}"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "num_images": len(self.paths), "num_classes": len(self.names),
                "num_skipped": self.num_skipped, "skipped": self.skipped[:20]}


@dataclass(frozen=True)
class Request:
    """What a layout's reader is asked for (see `read_labelled_images`)."""

    key: str
    label_column: str
    image_root: str | None
    names: list[str] | None
    num_labels: int | None
    max_bad_fraction: float

    @property
    def split(self) -> str:
        return self.key.rsplit(".", 1)[-1]


def read_labelled_images(path: str, key: str, *, label_column: str = "label", image_root: str | None = None,
                         names: list[str] | None = None, num_labels: int | None = None,
                         max_bad_fraction: float = 0.05) -> LabelledImages:
    """The labelled images at `path` (`key`: the recipe key blamed), in whichever of `LAYOUTS` it is. `names`: the
    classes to map labels onto (the training data's, for held-out splits); unset: found in the data. `num_labels`:
    the head's size, the range of integer labels (unset: up to the largest one found)."""
    if not os.path.exists(path):
        raise RecipeError(key, f"{path!r} does not exist; point it at {_LAYOUT_LIST}")
    request = Request(key, label_column, image_root, names, num_labels, max_bad_fraction)
    for layout in LAYOUTS:
        if layout.claims(Path(path)):
            return layout.read(Path(path), request)
    raise RecipeError(key, f"{path!r}: labelled images are read from {_LAYOUT_LIST}")


def _is_saved_dataset(path: Path) -> bool:
    from vembed.data.tables import HF_SAVED_MARKERS

    return path.is_dir() and any((path / marker).is_file() for marker in HF_SAVED_MARKERS)


def _image_folder(root: Path, request: Request) -> LabelledImages:
    key, names = request.key, request.names
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    if not classes:
        raise RecipeError(key, f"{str(root)!r} has no class folders; lay it out as {root}/<class>/<image>")
    names = list(names) if names is not None else classes
    data = LabelledImages(str(root), names=names)
    for name in classes:
        files = sorted(f for f in (root / name).iterdir() if f.suffix.lower() in IMAGE_EXTENSIONS and f.is_file())
        if not files:
            raise DataError(f"class folder {name!r} has no images ({', '.join(IMAGE_EXTENSIONS)}); add images or "
                            "remove the folder", file=str(root / name))
        if name not in names:
            raise DataError(f"class {name!r} is not one of the training classes ({_short(names)})", file=str(root))
        data.paths += [str(f) for f in files]
        data.labels += [names.index(name)] * len(files)
    return data


def _table(file: Path, request: Request) -> LabelledImages:
    import pandas as pd

    suffix = file.suffix.lower()
    try:
        if suffix in (".jsonl", ".json"):
            table = pd.read_json(file, lines=suffix == ".jsonl", dtype=False)
        else:
            table = pd.read_csv(file, dtype=str, keep_default_na=False)
    except ValueError as err:
        raise DataError(f"cannot read the table: {err}", file=str(file)) from None
    _check_columns(file, list(map(str, table.columns)), request.label_column)
    names, ids = _label_ids([str(v).strip() for v in table[request.label_column]], request, str(file))
    root = Path(request.image_root) if request.image_root else file.parent
    data = LabelledImages(str(file), names=names, num_rows=len(table))
    for position, (image, label) in enumerate(zip(table[IMAGE_COLUMN], ids)):
        image_path = root / str(image)
        if not str(image).strip() or not image_path.is_file():
            data.skip(position, f"image not found: {image_path}")
            continue
        data.add(str(image_path), label, position)
    data.check_bad_fraction(request.max_bad_fraction)
    return data


def _datasets_table(path: Path, request: Request) -> LabelledImages:
    """A `datasets` table: its Image column read undecoded; embedded bytes are checked by their header only."""
    import datasets

    from vembed.data.node_lock import one_builder_per_node
    from vembed.data.tables import _undecoded_images, read_table

    builder = "hf" if path.is_dir() else "parquet"
    with one_builder_per_node(str(path), builder):  # a Parquet file's Arrow cache: one rank of a node builds it
        table = read_table(str(path), builder, request.split)
    _check_columns(path, list(table.column_names), request.label_column)
    feature = table.features.get(request.label_column)
    declared = list(feature.names) if isinstance(feature, datasets.ClassLabel) else None
    values = list(table[request.label_column])
    if declared is not None:  # ids of the feature's names; -1 (no label) or any other outside them is refused
        labels = []
        for position, value in enumerate(values):
            if value is None or not 0 <= value < len(declared):
                raise DataError(f"label {value} is outside the classes 0..{len(declared) - 1} of column "
                                f"{request.label_column!r} (its ClassLabel names); fix the label or drop the row",
                                file=str(path), row=row_number(position))
            labels.append(declared[value])
    else:
        labels = ["" if value is None else str(value).strip() for value in values]
    names, ids = _label_ids(labels, request, str(path), declared)
    images = _undecoded_images(table.select_columns([IMAGE_COLUMN]), [IMAGE_COLUMN])
    files = [str(path)] if path.is_file() else [f["filename"] for f in table.cache_files]
    embedded = EmbeddedImages(str(path), images, files)
    root = Path(request.image_root) if request.image_root else (path if path.is_dir() else path.parent)
    data = LabelledImages(str(path), names=names, num_rows=len(table), embedded=embedded)
    batch_size = 256
    for start in range(0, len(table), batch_size):
        cells = images[start:start + batch_size][IMAGE_COLUMN]
        for position, cell, label in zip(range(start, start + len(cells)), cells, ids[start:start + len(cells)]):
            found, reason = _cell_image(cell, root)
            if found is None:
                data.skip(position, f"column {IMAGE_COLUMN!r}: {reason}")
                continue
            if found == "":
                found = f"{path}#{position}"
                embedded.rows[found] = position
            data.add(found, label, position)
    data.check_bad_fraction(request.max_bad_fraction)
    return data


def _cell_image(cell: Any, root: Path) -> tuple[str | None, str]:
    """("", "") for readable embedded bytes, (file path, "") for an existing file, (None, why) for no image. Only
    the header of embedded bytes is read (PIL's `open`); the pixels are decoded when used."""
    if isinstance(cell, dict) and cell.get("bytes"):
        from PIL import Image

        try:
            Image.open(io.BytesIO(cell["bytes"])).close()
        except Exception as err:  # noqa: BLE001 - PIL raises several types for bad data
            return None, f"embedded bytes are not an image ({type(err).__name__})"
        return "", ""
    value = cell.get("path") if isinstance(cell, dict) else cell
    if not isinstance(value, str) or not value.strip():
        return None, f"no image (cell {cell!r:.60})"
    file = root / os.path.expanduser(value)
    if not file.is_file():
        return None, f"image not found: {file}"
    return str(file), ""


def _check_columns(file: Path, columns: list[str], label_column: str) -> None:
    for column in (IMAGE_COLUMN, label_column):
        if column not in columns:
            raise DataError(f"has no {column!r} column (columns: {', '.join(columns)}); labelled images need "
                            f"{IMAGE_COLUMN!r} and {label_column!r} (data.columns.label)", file=str(file))


def _label_ids(labels: list[str], request: Request, file: str,
               declared: list[str] | None = None) -> tuple[list[str], list[int]]:
    """The class names and each row's label id. `declared`: the table's own class names (a ClassLabel feature),
    in id order; `labels` are then names, even when they look like integers (MNIST's are "0".."9")."""
    names, num_labels = request.names, request.num_labels
    integer = declared is None and all(v.lstrip("-").isdigit() for v in labels)
    if names is None and declared is not None:
        names = declared
    if names is None and integer and num_labels is not None:
        names = [str(i) for i in range(num_labels)]
    if names is None:
        found = sorted(set(labels), key=int if integer else str)
        names = [str(i) for i in range(max(map(int, found)) + 1)] if integer and found else found
    names, ids = list(names), []
    index = {name: i for i, name in enumerate(names)}
    for position, label in enumerate(labels):
        if integer and label not in index:
            if not 0 <= int(label) < len(names):
                raise DataError(f"label {label} is outside the classes 0..{len(names) - 1}; fix the label or the "
                                "number of classes (num_labels)", file=file, row=row_number(position))
            label = names[int(label)]
        if label not in index:
            raise DataError(f"label {label!r} is not one of the training classes ({_short(names)})", file=file,
                            row=row_number(position))
        ids.append(index[label])
    return names, ids


def _short(names: list[str]) -> str:
    return ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")


@dataclass(frozen=True)
class Layout:
    """One way labelled images are laid out: whether a path is in it, and its reader."""

    name: str
    claims: Callable[[Path], bool]
    read: Callable[[Path, Request], LabelledImages]


# Tried in order: a `datasets` folder is a folder too, so it comes before the ImageFolder tree.
LAYOUTS: tuple[Layout, ...] = (
    Layout("a `datasets` folder (save_to_disk)", _is_saved_dataset, _datasets_table),
    Layout("an ImageFolder directory", Path.is_dir, _image_folder),
    Layout("a CSV/JSONL file", lambda p: p.is_file() and p.suffix.lower() in (".csv", ".jsonl", ".json"), _table),
    Layout("a Parquet file as `datasets` writes it",
           lambda p: p.is_file() and p.suffix.lower() == ".parquet", _datasets_table),
)
_LAYOUT_LIST = ", ".join(layout.name for layout in LAYOUTS)
