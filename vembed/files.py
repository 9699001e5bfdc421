"""Writing a file so that a reader never sees half of it: under a temporary name beside it, then renamed."""

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
