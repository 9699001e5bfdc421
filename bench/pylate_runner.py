"""Run PyLate on its own pinned stack (`scripts/setup.sh dev` installs it into .venv/pylate-stack: PyLate 1.6 does not
run on this venv's sentence-transformers 6 / transformers 5.2x). `run_pylate` starts this file in a child process
with that stack in front of the venv's packages; the child imports PyLate only, never vembed.

A job is a JSON object whose keys name the steps to run, in the order of `COMMANDS`:

    encode:  load `pylate.models.ColBERT(model)`, encode queries and documents as PyLate does, and save (torch.save)
             their token vectors and MaxSim scores (`pylate.scores.colbert_scores`);
    snippet: run Python code (a model card's PyLate example) and save the `scores` it leaves;
    distill: `pylate.losses.Distillation` on given token vectors and teacher scores (no model: a stand-in encoder
             hands the vectors over), with and without its min-max score normalisation; saves the losses and the
             gradients with respect to the vectors.
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


def run_pylate(job: dict[str, Any], work: Path, timeout: float = 600) -> None:
    """Run `job` (written to `work/job.json`) in one child process on PyLate's stack."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "job.json").write_text(json.dumps(job))
    env = {**os.environ, "PYTHONPATH": str(STACK), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, __file__, str(work / "job.json")], env=env, timeout=timeout,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"PyLate job {sorted(job)} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")


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


def snippet(job: dict[str, Any]) -> None:
    import torch

    namespace: dict[str, Any] = {}
    exec(job["code"], namespace)
    torch.save(torch.as_tensor(namespace["scores"]), job["out"])


def distill(job: dict[str, Any]) -> None:
    """`job["inputs"]` (torch.save'd): queries (B, Tq, d), documents (B, c, Td, d) every token real, teacher (B, c)."""
    import torch
    from pylate import losses

    data = torch.load(job["inputs"])
    queries, documents, teacher = data["queries"], data["documents"], data["teacher"]

    class StandIn(torch.nn.Module):  # what Distillation calls as its model: returns the given vectors
        skiplist: list[int] = []
        do_query_expansion = True  # every query token scored, as vembed's expanded queries

        def forward(self, features: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {"token_embeddings": features["vectors"]}

    results = {}
    for normalize in (False, True):
        q, d = queries.clone().requires_grad_(), documents.clone().requires_grad_()
        flat = d.flatten(0, 1)
        features = [{"input_ids": torch.ones(q.shape[:2], dtype=torch.long),
                     "attention_mask": torch.ones(q.shape[:2], dtype=torch.long), "vectors": q},
                    {"input_ids": torch.ones(flat.shape[:2], dtype=torch.long),
                     "attention_mask": torch.ones(flat.shape[:2], dtype=torch.long), "vectors": flat}]
        loss = losses.Distillation(StandIn(), normalize_scores=normalize)(features, teacher)
        loss.backward()
        results["min_max" if normalize else "none"] = {"loss": loss.detach(), "queries": q.grad, "documents": d.grad}
    torch.save(results, job["out"])


COMMANDS = {"encode": encode, "snippet": snippet, "distill": distill}

if __name__ == "__main__":
    steps = json.loads(Path(sys.argv[1]).read_text())
    for name, step in COMMANDS.items():
        if name in steps:
            step(steps[name])
