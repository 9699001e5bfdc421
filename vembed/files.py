"""Writing a file so that a reader never sees half of it: under a temporary name beside it, then renamed."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


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
