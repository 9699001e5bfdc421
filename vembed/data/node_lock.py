"""One rank per node reads a file through `datasets` (building its Arrow cache) and checks its rows; the others wait,
then map what it built. A file lock, not a barrier: ranks read their data before the process group exists.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator

from vembed.data.tables import is_small_json


@contextlib.contextmanager
def one_builder_per_node(file: str, builder: str) -> Iterator[None]:
    """Around reading a file through `datasets` and checking its rows: the first rank of a node to get here builds
    the Arrow cache and the checks; the others wait, then find both built and map them. A file lock, not a barrier:
    ranks read their data before the accelerator (and the process group) exists. Small JSON files need none."""
    if builder == "json" and is_small_json(file):
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
