"""One bench run in its own process (its own peak RSS, its own imports): the parent writes the run's spec to
`WORK/TAG.spec.json` and starts `SCRIPT --child TOOL SPEC`; the child runs `tools[TOOL](spec)` and writes the result
to `WORK/TAG.result.json`, which the parent reads back. Used by bench/colbert_vs_pylate.py and bench/rerank_vs_st.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def run_in_child(script: str, tool: str, spec: dict[str, Any], pythonpath: str, what: str) -> dict[str, Any]:
    """Run `tool` of `script` on `spec` (its "work" folder and "tag" name the files) in a child process."""
    work, tag = Path(spec["work"]), spec["tag"]
    (work / f"{tag}.spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": pythonpath, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
           "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, script, "--child", tool, str(work / f"{tag}.spec.json")], env=env,
                          capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{what} run failed:\n{done.stderr[-4000:]}")
    return json.loads((work / f"{tag}.result.json").read_text())


def serve_child(child: list[str], tools: dict[str, Callable[[dict[str, Any]], dict[str, Any]]]) -> int:
    """The child's side: `child` is (TOOL, SPEC file) from `--child`."""
    tool, spec_file = child
    spec = json.loads(Path(spec_file).read_text())
    Path(spec["work"], f"{spec['tag']}.result.json").write_text(json.dumps(tools[tool](spec)))
    return 0
