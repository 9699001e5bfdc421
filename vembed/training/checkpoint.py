"""Checkpoints: atomic save (temporary name, then rename), a manifest to verify them, rotation that keeps the best,
resume from the newest good one, persistent mirror.

Model, optimizer, scheduler and RNG states go through `accelerator.save_state` (safetensors for weights; accelerate
loads the rest with `weights_only=True`), or, for FSDP, through torch.distributed.checkpoint (vembed/training/fsdp.py);
our own state is JSON. Every rank takes part in saving and loading: a rank-0-only save of sharded weights hangs.

`manifest.json`, written last (after every rank's files are on disk), records each file's size and checksum and the
identity of the run; a checkpoint is used only when every file matches it.
"""

from __future__ import annotations

import errno
import json
import math
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vembed.errors import CheckpointError
from vembed.files import write_json_atomic
from vembed.training.run_dir import fingerprint, identity_differences

if TYPE_CHECKING:
    from accelerate import Accelerator

STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = 1
_NAME = re.compile(r"^checkpoint-(\d+)$")
_HASH_CHUNK = 8 << 20


@dataclass
class TrainerState:
    """Where training is, in JSON: enough to continue exactly."""

    global_step: int = 0  # optimizer steps taken
    epoch: int = 0  # epoch in progress (of the current curriculum stage)
    batches_in_epoch: int = 0  # micro-batches of `epoch` already consumed (per process)
    stage: int = 0  # curriculum stage in progress (recipe `stages:`; 0 without them)
    samples_seen: int = 0  # across all processes
    best_metric: float | None = None
    best_checkpoint: str | None = None
    loss_history: list[dict[str, float]] = field(default_factory=list)
    step_losses: list[dict[str, float]] = field(default_factory=list)  # {"step", "loss"} of every optimizer step
    eval_history: list[dict[str, float]] = field(default_factory=list)
    # Streamed data only: every rank's position in `epoch` (vembed/training/streamed.py, `StreamedEpochs.state`).
    stream: dict[str, Any] | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_file(cls, path: Path) -> "TrainerState":
        return cls(**json.loads(path.read_text()))


# --- the manifest ----------------------------------------------------------------------------------------------------


def file_checksum(path: Path) -> str:
    """xxh3-128 of a file. Not sha256: this guards against torn, zeroed or overwritten files, not forgery, and xxh3
    hashes ~4.4 GB/s on one core of this machine against sha256's 0.75 GB/s, so verifying a 100 GB checkpoint takes
    seconds, not minutes. xxhash comes with `datasets`."""
    import xxhash

    digest = xxhash.xxh3_128()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(directory: Path, step: int, identity: dict[str, Any]) -> None:
    """Every file under `directory` (all ranks' shards and RNG states: call it after a barrier) with its size and
    checksum, and the run's identity. Written last: a checkpoint without it is not finished."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        relative = path.relative_to(directory).as_posix()
        if relative != MANIFEST_FILE:
            files[relative] = {"size": path.stat().st_size, "xxh3_128": file_checksum(path)}
    payload = {"format": MANIFEST_FORMAT, "step": step, "run": fingerprint(identity), "identity": identity,
               "files": files}
    write_json_atomic(directory / MANIFEST_FILE, payload)


def read_manifest(directory: Path) -> dict[str, Any]:
    return json.loads((directory / MANIFEST_FILE).read_text())


def checkpoint_problem(directory: Path) -> str | None:
    """None when every file of the checkpoint matches its manifest; else what is wrong, naming the file."""
    try:
        manifest = read_manifest(directory)
        files = manifest["files"]
        expected = {name: (int(entry["size"]), str(entry["xxh3_128"])) for name, entry in files.items()}
    except FileNotFoundError:
        return f"{MANIFEST_FILE} is missing (an unfinished checkpoint, or one written by an older vembed)"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"{MANIFEST_FILE} is unreadable"
    if STATE_FILE not in expected:
        return f"{MANIFEST_FILE} lists no {STATE_FILE}"
    for name, (size, _) in expected.items():  # sizes first: cheap, and they catch truncation
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        actual = path.stat().st_size
        if actual != size:
            return f"{name} has {actual} bytes, {size} were written"
    for name, (_, checksum) in expected.items():
        if file_checksum(directory / name) != checksum:
            return f"{name} does not match the checksum recorded when it was written"
    return None


# --- finding checkpoints ---------------------------------------------------------------------------------------------


def list_checkpoints(directory: str | Path) -> list[Path]:
    """`checkpoint-N` folders that say they are finished (have a manifest), oldest first; not yet verified."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if _NAME.match(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def _check_same_run(path: Path, identity: dict[str, Any] | None) -> None:
    if identity is None:
        return
    stored = read_manifest(path).get("identity") or {}
    differences = identity_differences(stored, identity)
    if differences:
        raise CheckpointError(f"{path} is a checkpoint of another run ({'; '.join(differences)}); resume from a "
                              "checkpoint of this recipe, or drop resume_from to start a new run")


def resolve_resume(resume_from: str | None, output_dir: str | Path, identity: dict[str, Any] | None = None,
                   warn: Callable[[str], None] | None = None) -> Path | None:
    """The verified checkpoint to resume from, or None to start fresh.

    `auto`: the newest good checkpoint in output_dir; each damaged one newer than it is skipped with one warning
    naming the bad file; none left → one `CheckpointError` naming each; none at all → None (a fresh run). A path: that
    checkpoint, which must be good. Either must be of this run (`identity`), or the differing keys are named.
    """
    warn = warn or (lambda line: print(line, file=sys.stderr))
    if resume_from is None:
        return None
    if resume_from != "auto":
        path = Path(resume_from)
        if not path.is_dir():
            raise CheckpointError(f"resume_from: {resume_from!r} is not a folder; point it at a checkpoint-N folder "
                                  "or use resume_from: auto")
        problem = checkpoint_problem(path)
        if problem:
            raise CheckpointError(f"resume_from: {path} cannot be used: {problem}")
        _check_same_run(path, identity)
        return path
    skipped = []
    for path in reversed(list_checkpoints(output_dir)):
        problem = checkpoint_problem(path)
        if problem is None:
            _check_same_run(path, identity)
            for bad in skipped:  # one line each, only when there is something to resume from; else one error
                warn(f"warning: skipping {Path(output_dir) / bad}")
            return path
        skipped.append(f"{path.name}: {problem}")
    if skipped:
        raise CheckpointError(f"no usable checkpoint in {output_dir} ({'; '.join(skipped)}); restore one (e.g. from "
                              "persistent_dir), or set overwrite_output_dir: true to start again")
    return None


def _atomic_copytree(src: Path, dst: Path) -> None:
    tmp = dst.with_name(f".tmp-{dst.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)


class CheckpointManager:
    """Saves `checkpoint-<step>` folders under `output_dir`, keeps the last `keep` plus the best one."""

    def __init__(self, accelerator: "Accelerator", output_dir: str | Path, keep: int, persistent_dir: str | None,
                 sharded: tuple[Any, Any, Any] | None = None, identity: dict[str, Any] | None = None):
        """`sharded`: (model, optimizer, scheduler) of an FSDP run, saved with torch.distributed.checkpoint by
        every rank (accelerate does not know the model: vembed shards it). `identity`: the run's (run_dir.py),
        stored in every manifest so a resume can tell whose checkpoint it is."""
        self.accelerator = accelerator
        self.sharded = sharded
        self.output_dir = Path(output_dir)
        self.keep = keep
        self.persistent_dir = Path(persistent_dir) if persistent_dir else None
        self.identity = identity or {}
        self.last_good: Path | None = None  # the newest checkpoint this launch saved or verified and resumed from

    def save(self, state: TrainerState) -> Path:
        """Collective: every rank must call it. Returns the final checkpoint path. A failed write (a full disk) removes
        the partial checkpoint and raises one `CheckpointError` naming the last complete one."""
        acc = self.accelerator
        final = self.output_dir / f"checkpoint-{state.global_step}"
        tmp = self.output_dir / f".tmp-checkpoint-{state.global_step}"
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        acc.wait_for_everyone()
        with self._writing(final.name, tmp):
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
            with self._writing(final.name, tmp):
                (tmp / STATE_FILE).write_text(state.to_json())
                write_manifest(tmp, state.global_step, self.identity)  # last: its presence marks it complete
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            self.last_good = final
            self._rotate(state)
            if self.persistent_dir is not None:
                mirror = self.persistent_dir / final.name
                with self._writing(f"the copy of {final.name}", mirror.with_name(f".tmp-{final.name}"),
                                   directory=self.persistent_dir):
                    self.persistent_dir.mkdir(parents=True, exist_ok=True)
                    _atomic_copytree(final, mirror)
        acc.wait_for_everyone()
        self.last_good = final
        return final

    def save_verified(self, state: TrainerState) -> Path:
        """`save`, then every file read back against the manifest (by the main process) before the run relies on it:
        the checkpoint a stopped run leaves must be one its resume accepts. Collective."""
        acc = self.accelerator
        path = self.save(state)
        problem = [checkpoint_problem(path) if acc.is_main_process else None]
        if acc.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            broadcast_object_list(problem)
        if problem[0] is not None:
            raise CheckpointError(f"{path} was written but does not verify: {problem[0]}; the last complete "
                                  "checkpoint before it is the one to resume from")
        return path

    def _writing(self, what: str, partial: Path, directory: Path | None = None):
        return writing_checkpoint_files(what, directory or self.output_dir, self.last_good, partial)

    def _rotate(self, state: TrainerState) -> None:
        # Only checkpoints up to this step count: newer ones belong to a timeline this run went back from (damaged
        # ones skipped on resume); each is replaced when training reaches its step again.
        found = [p for p in list_checkpoints(self.output_dir) if _step(p) <= state.global_step]
        protected = {state.best_checkpoint} if state.best_checkpoint else set()
        recent = {p.name for p in found[-self.keep :]}
        for path in found:
            if path.name not in recent and path.name not in protected:
                shutil.rmtree(path, ignore_errors=True)

    def load(self, path: Path) -> TrainerState:
        """Collective: restores model, optimizer, scheduler and RNG states; returns our trainer state. The checkpoint
        was verified (`resolve_resume`); a model that still cannot take it is one line, not a traceback."""
        try:
            if self.sharded is not None:
                from vembed.training.fsdp import load_sharded

                load_sharded(path, self.accelerator, *self.sharded)
            else:
                self.accelerator.load_state(str(path))
        except (RuntimeError, KeyError, ValueError, OSError) as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            raise CheckpointError(f"{path} does not fit this model and launch: {type(error).__name__}: "
                                  f"{first[:300]}") from error
        self.last_good = path
        return TrainerState.from_file(path / STATE_FILE)


def _step(path: Path) -> int:
    return int(_NAME.match(path.name).group(1))


class writing_checkpoint_files:  # noqa: N801 - used as a `with` block
    """Turns a failed write into one `CheckpointError` (exit 2: the run's environment, not its training, failed):
    "disk full" (with where and how much is free) when the disk is full, else the error's first line; removes the
    partial output first, and names the last complete checkpoint. Every write of a run (checkpoints, final/, metrics,
    the model card) goes through it."""

    def __init__(self, what: str, directory: Path, last_good: Path | None, partial: Path | None = None):
        self.what, self.directory, self.last_good, self.partial = what, Path(directory), last_good, partial

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, traceback) -> bool:
        if error is None or not isinstance(error, _write_errors()):
            return False
        free = _free_bytes(self.directory)  # before the partial files are removed
        if self.partial is not None:
            shutil.rmtree(self.partial, ignore_errors=True)
        last = f"the last complete checkpoint is {self.last_good}" if self.last_good else "no checkpoint was saved yet"
        if _disk_full(error, free):
            left = f" ({_human_bytes(free)} left on its file system)" if free is not None else ""
            raise CheckpointError(f"disk full: could not write {self.what} in {self.directory}{left}; {last}; free "
                                  "space and relaunch with resume_from: auto") from error
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise CheckpointError(f"could not write {self.what} in {self.directory}: {type(error).__name__}: "
                              f"{first[:300]}; {last}") from error


def _write_errors() -> tuple[type[BaseException], ...]:
    """What a failed write raises: OSError; torch's C++ writer a RuntimeError; safetensors' Rust writer (model
    weights, in checkpoints and final/) its own SafetensorError, which is neither and carries no errno."""
    from safetensors import SafetensorError

    return OSError, RuntimeError, SafetensorError


_FULL_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
_LOW_SPACE_BYTES = 64 << 20


def _disk_full(error: BaseException, free: int | None) -> bool:
    """ENOSPC/EDQUOT anywhere in the chain; or (torch's C++ writer loses the errno: "unexpected pos 17984 vs 17876")
    almost nothing left on the file system at the moment of the failure."""
    seen: BaseException | None = error
    while seen is not None:
        if getattr(seen, "errno", None) in _FULL_ERRNOS or "No space left on device" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return free is not None and free < _LOW_SPACE_BYTES


def _human_bytes(size: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size} B"


def _free_bytes(directory: Path) -> int | None:
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def is_better(value: float | None, best: float | None) -> bool:
    return value is not None and not math.isnan(value) and (best is None or value > best)

