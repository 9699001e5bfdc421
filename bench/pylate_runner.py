"""Run PyLate on its own pinned stack (`scripts/setup.sh dev` installs it into .venv/pylate-stack: PyLate 1.6 does not
run on this venv's sentence-transformers 6 / transformers 5.2x). `run_pylate` starts this file in a child process
with that stack in front of the venv's packages; the child imports PyLate only, never vembed.

    encode: load `pylate.models.ColBERT(model)`, encode queries and documents as PyLate does, and save (torch.save)
            their token vectors and MaxSim scores (`pylate.scores.colbert_scores`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
STACK = Path(os.environ.get("VEMBED_PYLATE_STACK", ROOT / ".venv" / "pylate-stack"))


def pylate_available() -> bool:
    return (STACK / "pylate").is_dir()


def run_pylate(command: str, job: dict[str, Any], work: Path, timeout: float = 600) -> None:
    """Run `command` on `job` (written to `work/job.json`) in a child process on PyLate's stack."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "job.json").write_text(json.dumps(job))
    env = {**os.environ, "PYTHONPATH": str(STACK), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, __file__, command, str(work / "job.json")], env=env, timeout=timeout,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"PyLate {command} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")


def encode(job: dict[str, Any]) -> None:
    """For each `(model, out)` of `job["models"]`: token vectors of `job["queries"]` and `job["documents"]` and
    their MaxSim scores, as PyLate gives them, saved to `out`."""
    import pylate
    import torch
    from pylate import models, scores

    for model_dir, out in job["models"]:
        model = models.ColBERT(model_dir, device="cpu")
        queries, documents = (model.encode(job[key], is_query=key == "queries", convert_to_numpy=False,
                                           batch_size=job.get("batch_size", 32)) for key in ("queries", "documents"))
        # One document at a time: PyLate's padded scoring multiplies padding by 0 before the max, which makes a
        # query token's best match 0 when all of a shorter document's similarities are negative (vembed leaves
        # padding out of the max); unpadded, the two definitions agree.
        stacked = torch.stack(list(queries))
        scored = torch.cat([scores.colbert_scores(stacked, document[None]) for document in documents], dim=1)
        torch.save({"queries": [q.float() for q in queries], "documents": [d.float() for d in documents],
                    "scores": scored.float(), "pylate": pylate.__version__}, out)


COMMANDS = {"encode": encode}

if __name__ == "__main__":
    COMMANDS[sys.argv[1]](json.loads(Path(sys.argv[2]).read_text()))
