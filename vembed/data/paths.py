"""The files a recipe's data keys name: a path, a glob, a directory or a list of them, each checked to exist before
anything is built, and the format (the `datasets` builder) each one is read as.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from vembed.errors import RecipeError, did_you_mean

if TYPE_CHECKING:
    from vembed.recipe import DataConfig

# The extensions `format: auto` recognises, and the `datasets` builder each one is read with.
BUILDER_BY_EXTENSION = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
EXTENSIONS_BY_FORMAT = {
    "auto": tuple(BUILDER_BY_EXTENSION),
    "jsonl": (".jsonl", ".json"),
    "json": (".json", ".jsonl"),
    "csv": (".csv",),
    "parquet": (".parquet",),
}


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
