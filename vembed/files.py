"""Writing a file so that a reader never sees half of it (under a temporary name beside it, then renamed), and the one
rule for when a command may replace an output that is already there."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def replace_atomically(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """`write(tmp)` fills a temporary file beside `path`, which then replaces `path` in one rename (the temporary file
    is removed if writing fails). The name carries the process id, so two processes never share a temporary file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_json_atomic(path: str | os.PathLike, payload: Any) -> Path:
    """`payload` as indented JSON at `path`, written whole (`replace_atomically`): manifests, run.json, metrics."""
    text = json.dumps(payload, indent=2)  # before anything is written: a payload that is not JSON leaves no file
    return replace_atomically(path, lambda tmp: tmp.write_text(text))


OVERWRITE_FLAG = "--overwrite"


def check_output_file(path: str | os.PathLike, overwrite: bool, key: str, kind: str) -> None:
    """A command's output file can be written: it is not a folder, its folder exists or can be made (no file stands
    in the way), and an existing file is replaced only with --overwrite. `kind` names what to give (a JSON file)."""
    from vembed.errors import RecipeError

    path = Path(path)
    if path.is_dir():
        raise RecipeError(key, f"{path} is a folder; name {kind}")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise RecipeError(key, f"{path} cannot be written: {parent} is a file")
    check_replaceable(path, overwrite, key=key)


def check_replaceable(path: str | os.PathLike, overwrite: bool, key: str = "--out") -> None:
    """The one rule for a command's named output (`vembed export --out`, `vembed mine --out`): an existing file, or a
    folder with anything in it, is replaced only when the user passed --overwrite; otherwise one line names it.
    Called before any work, so a refusal costs nothing."""
    from vembed.errors import RecipeError

    path = Path(path)
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        return
    if not overwrite:
        raise RecipeError(key, f"{path} exists; pass {OVERWRITE_FLAG} to replace it, or choose another {key}")
