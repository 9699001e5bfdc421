"""Labelled images for classification: an ImageFolder tree (`<dir>/<class>/*.png`) or a CSV/JSONL file with an
`image` column (a path, relative to data.image_root or the file's folder) and a `label` column (data.columns.label).

Labels become ids through the class names: folder names or the label column's distinct values (sorted; integer
labels are ids already, 0..num_labels-1). Rows whose image file is missing are skipped and counted; above
data.max_bad_fraction the run stops.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vembed.data.images import IMAGE_EXTENSIONS
from vembed.errors import DataError, RecipeError

IMAGE_COLUMN = "image"


@dataclass
class LabelledImages:
    """Image paths, their label ids and what was skipped; `names` are the classes in id order."""

    source: str
    paths: list[str] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)

    def summary(self) -> str:
        text = f"{len(self.paths)} images of {len(set(self.labels))} classes from {self.source}"
        if self.skipped:
            first = self.skipped[0]
            text += f"; skipped {len(self.skipped)} row(s), first row {first['row']}: {first['reason']}"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "num_images": len(self.paths), "num_classes": len(self.names),
                "num_skipped": self.num_skipped, "skipped": self.skipped[:20]}


def read_labelled_images(path: str, key: str, *, label_column: str = "label", image_root: str | None = None,
                         names: list[str] | None = None, num_labels: int | None = None,
                         max_bad_fraction: float = 0.05) -> LabelledImages:
    """The labelled images at `path` (`key`: the recipe key blamed). `names`: the classes to map labels onto (the
    training data's, for held-out splits); unset: found in the data. `num_labels`: the head's size, the range of
    integer labels (unset: up to the largest one found)."""
    if os.path.isdir(path):
        return _image_folder(Path(path), key, names)
    if not os.path.isfile(path):
        raise RecipeError(key, f"{path!r} does not exist; point it at a CSV/JSONL file or an ImageFolder directory")
    return _table(Path(path), key, label_column, image_root, names, num_labels, max_bad_fraction)


def _image_folder(root: Path, key: str, names: list[str] | None) -> LabelledImages:
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


def _table(file: Path, key: str, label_column: str, image_root: str | None, names: list[str] | None,
           num_labels: int | None, max_bad_fraction: float) -> LabelledImages:
    import pandas as pd

    suffix = file.suffix.lower()
    try:
        if suffix in (".jsonl", ".json"):
            table = pd.read_json(file, lines=suffix == ".jsonl", dtype=False)
        elif suffix == ".csv":
            table = pd.read_csv(file, dtype=str, keep_default_na=False)
        else:
            raise RecipeError(key, f"{str(file)!r}: classification reads .csv, .jsonl or an ImageFolder directory")
    except ValueError as err:
        raise DataError(f"cannot read the table: {err}", file=str(file)) from None
    for column in (IMAGE_COLUMN, label_column):
        if column not in table.columns:
            raise DataError(f"has no {column!r} column (columns: {', '.join(map(str, table.columns))}); "
                            f"labelled images need {IMAGE_COLUMN!r} and {label_column!r} (data.columns.label)",
                            file=str(file))
    labels = [str(v).strip() for v in table[label_column]]
    integer = all(v.lstrip("-").isdigit() for v in labels)
    if names is None and integer and num_labels is not None:
        names = [str(i) for i in range(num_labels)]
    if names is None:
        found = sorted(set(labels), key=int if integer else str)
        names = [str(i) for i in range(max(map(int, found)) + 1)] if integer and found else found
    root = Path(image_root) if image_root else file.parent
    data = LabelledImages(str(file), names=list(names))
    for row, (image, label) in enumerate(zip(table[IMAGE_COLUMN], labels)):
        if integer and label not in names:
            if not 0 <= int(label) < len(names):
                raise DataError(f"label {label} is outside the classes 0..{len(names) - 1}; fix the label or the "
                                "number of classes (num_labels)", file=str(file), row=row)
            label = names[int(label)]
        if label not in names:
            raise DataError(f"label {label!r} is not one of the training classes ({_short(names)})",
                            file=str(file), row=row)
        image_path = root / str(image)
        if not str(image).strip() or not image_path.is_file():
            data.skipped.append({"row": row, "reason": f"image not found: {image_path}"})
            continue
        data.paths.append(str(image_path))
        data.labels.append(names.index(label))
    if len(table) and data.num_skipped / len(table) > max_bad_fraction:
        raise DataError(f"{data.num_skipped} of {len(table)} rows have no image file (more than data."
                        f"max_bad_fraction={max_bad_fraction}); first: {data.skipped[0]['reason']}; check the paths "
                        "and data.image_root", file=str(file))
    return data


def _short(names: list[str]) -> str:
    return ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")
