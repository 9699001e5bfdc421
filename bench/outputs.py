"""Where a bench script writes its JSON and plots: `bench/results/` (the committed figures docs/benchmarks.md cites)
for a real run; for a `--smoke` run, which only checks that the script runs, a fresh temporary folder, so a smoke run
never overwrites a measurement. `--out DIR` overrides both."""

from __future__ import annotations

import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def output_dir(out: str | None, smoke: bool) -> Path:
    """The folder to write to (created): `out` when given, else a temporary one for smoke runs, else RESULTS."""
    if out:
        path = Path(out)
    elif smoke:
        path = Path(tempfile.mkdtemp(prefix="vembed-bench-smoke-"))
    else:
        path = RESULTS
    path.mkdir(parents=True, exist_ok=True)
    return path
