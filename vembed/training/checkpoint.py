"""Checkpoints: atomic save (temporary name, then rename), rotation that keeps the best, resume, persistent mirror.

Model, optimizer, scheduler and RNG states go through `accelerator.save_state` (safetensors for weights; accelerate
loads the rest with `weights_only=True`), or, for FSDP, through torch.distributed.checkpoint (vembed/training/fsdp.py);
our own state is JSON. Every rank takes part in saving and loading: a rank-0-only save of sharded weights hangs.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vembed.errors import RecipeError

if TYPE_CHECKING:
    from accelerate import Accelerator

STATE_FILE = "trainer_state.json"
_NAME = re.compile(r"^checkpoint-(\d+)$")


@dataclass
class TrainerState:
    """Where training is, in JSON: enough to continue exactly."""

    global_step: int = 0  # optimizer steps taken
    epoch: int = 0  # epoch in progress
    batches_in_epoch: int = 0  # micro-batches of `epoch` already consumed (per process)
    samples_seen: int = 0  # across all processes
    best_metric: float | None = None
    best_checkpoint: str | None = None
    loss_history: list[dict[str, float]] = field(default_factory=list)
    eval_history: list[dict[str, float]] = field(default_factory=list)
    # Streamed data only: every rank's position in `epoch` (vembed/training/streamed.py, `StreamedEpochs.state`).
    stream: dict[str, Any] | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_file(cls, path: Path) -> "TrainerState":
        return cls(**json.loads(path.read_text()))


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Complete checkpoints (those with a state file), oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if _NAME.match(p.name) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def resolve_resume(resume_from: str | None, output_dir: str | Path) -> Path | None:
    """`auto` → the latest complete checkpoint in output_dir (None on a fresh run); a path → that checkpoint."""
    if resume_from is None:
        return None
    if resume_from == "auto":
        found = list_checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(resume_from)
    if not (path / STATE_FILE).is_file():
        raise RecipeError("resume_from", f"{resume_from!r} is not a complete vembed checkpoint (no {STATE_FILE})")
    return path


def _atomic_copytree(src: Path, dst: Path) -> None:
    tmp = dst.with_name(f".tmp-{dst.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)


class CheckpointManager:
    """Saves `checkpoint-<step>` folders under `output_dir`, keeps the last `keep` plus the best one."""

    def __init__(self, accelerator: "Accelerator", output_dir: str | Path, keep: int, persistent_dir: str | None,
                 sharded: tuple[Any, Any, Any] | None = None):
        """`sharded`: (model, optimizer, scheduler) of an FSDP run, saved with torch.distributed.checkpoint by
        every rank (accelerate does not know the model: vembed shards it)."""
        self.accelerator = accelerator
        self.sharded = sharded
        self.output_dir = Path(output_dir)
        self.keep = keep
        self.persistent_dir = Path(persistent_dir) if persistent_dir else None

    def save(self, state: TrainerState) -> Path:
        """Collective: every rank must call it. Returns the final checkpoint path."""
        acc = self.accelerator
        final = self.output_dir / f"checkpoint-{state.global_step}"
        tmp = self.output_dir / f".tmp-checkpoint-{state.global_step}"
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        acc.wait_for_everyone()
        if self.sharded is not None:
            from vembed.training.fsdp import save_sharded

            if acc.is_main_process:
                tmp.mkdir(parents=True)
            acc.wait_for_everyone()
            save_sharded(tmp, acc, *self.sharded)
        else:
            acc.save_state(str(tmp), safe_serialization=True)
        acc.wait_for_everyone()
        if acc.is_main_process:
            (tmp / STATE_FILE).write_text(state.to_json())  # written last: its presence marks the checkpoint complete
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            self._rotate(state)
            if self.persistent_dir is not None:
                self.persistent_dir.mkdir(parents=True, exist_ok=True)
                _atomic_copytree(final, self.persistent_dir / final.name)
        acc.wait_for_everyone()
        return final

    def _rotate(self, state: TrainerState) -> None:
        found = list_checkpoints(self.output_dir)
        protected = {state.best_checkpoint} if state.best_checkpoint else set()
        recent = {p.name for p in found[-self.keep :]}
        for path in found:
            if path.name not in recent and path.name not in protected:
                shutil.rmtree(path, ignore_errors=True)

    def load(self, path: Path) -> TrainerState:
        """Collective: restores model, optimizer, scheduler and RNG states; returns our trainer state."""
        if self.sharded is not None:
            from vembed.training.fsdp import load_sharded

            load_sharded(path, self.accelerator, *self.sharded)
        else:
            self.accelerator.load_state(str(path))
        return TrainerState.from_file(path / STATE_FILE)


def is_better(value: float | None, best: float | None) -> bool:
    return value is not None and not math.isnan(value) and (best is None or value > best)


def write_json_atomic(path: str | Path, payload: Any) -> None:
    path = Path(path)
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=False))
    tmp.replace(path)
