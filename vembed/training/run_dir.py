"""The output folder of a run: whose run it holds (the recipe's identity), whether this launch may write there, and a
lock that keeps a second launch out while one is running.

A launch is refused, before anything is built, when `output_dir` is a file or cannot be written, when it holds another
run (the keys that differ are named), or when it holds this run's work and the recipe neither resumes
(`resume_from: auto`) nor asks to start again (`overwrite_output_dir: true`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vembed.errors import LaunchError, RecipeError
from vembed.files import write_json_atomic

if TYPE_CHECKING:
    from vembed.recipe import Recipe

RUN_FILE = "run.json"  # the identity of the run this folder holds
RECIPE_FILE = "recipe.yaml"
LOCK_FILE = ".vembed.lock"
CHECKPOINT_PREFIX = "checkpoint-"

# Keys that do not change what is trained: where it is written, how it is logged, evaluated, checked and saved. Every
# other key (model, data.train, optimisation, loss, schedule length, seed, strategy) is part of the run's identity.
NOT_IDENTITY = frozenset({
    "output_dir", "persistent_dir", "resume_from", "overwrite_output_dir", "report_to", "run_name", "logging_steps",
    "save_steps", "save_total_limit", "eval_steps", "eval_before_training", "metric_for_best_model", "eval_batch_size",
    "profile", "data.validation", "data.test", "data.eval_max_samples", "data.num_workers", "data.max_bad_fraction",
    "data.qrels_splits.validation", "data.qrels_splits.test", "data.first_stage_run",  # what a reranker evaluates
    "compile",  # how the towers run, not what they compute (the compiled step is the eager one to 1e-5)
})
# What a run writes into output_dir; `overwrite_output_dir: true` removes these and nothing else.
RUN_OUTPUTS = ("final", "metrics.json", RUN_FILE, RECIPE_FILE, "loss_curve.png")


# --- identity --------------------------------------------------------------------------------------------------------


def identity_of(recipe_dict: dict[str, Any]) -> dict[str, Any]:
    """The training-relevant keys of a recipe (as `Recipe.to_dict()` or a saved recipe.yaml holds them), flattened."""
    flat = _flatten(recipe_dict)
    return {key: value for key, value in flat.items()
            if key not in NOT_IDENTITY and not any(key.startswith(f"{k}.") for k in NOT_IDENTITY)}


def run_identity(recipe: "Recipe") -> dict[str, Any]:
    return identity_of(recipe.to_dict())


def fingerprint(identity: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


def identity_differences(stored: dict[str, Any], ours: dict[str, Any], limit: int = 4) -> list[str]:
    """`key: stored → ours` for each key both know and disagree on (a key one side lacks came from another vembed
    version and is not counted)."""
    differing = [key for key in sorted(stored.keys() & ours.keys()) if stored[key] != ours[key]]
    shown = [f"{key}: {_short(stored[key])} → {_short(ours[key])}" for key in differing[:limit]]
    if len(differing) > limit:
        shown.append(f"and {len(differing) - limit} more")
    return shown


# Sub-sections of the schema, compared key by key (so NOT_IDENTITY can name one of their keys); free-form dicts
# (model_config) are compared as a whole.
FLATTENED = ("data", "data.columns", "data.qrels_splits", "dit", "flow", "profile")


def _flatten(raw: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and name in FLATTENED:
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _short(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= 40 else text[:37] + "..."


# --- what a folder holds ---------------------------------------------------------------------------------------------


def stored_identity(output_dir: Path) -> dict[str, Any] | None:
    """The identity of the run `output_dir` holds: from run.json, else (older vembed) from its recipe.yaml."""
    run_file = output_dir / RUN_FILE
    if run_file.is_file():
        with contextlib.suppress(OSError, ValueError):
            content = json.loads(run_file.read_text())
            if isinstance(content, dict) and isinstance(content.get("identity"), dict):
                return content["identity"]
    recipe_file = output_dir / RECIPE_FILE
    if recipe_file.is_file():
        import yaml

        with contextlib.suppress(OSError, ValueError, yaml.YAMLError):
            raw = yaml.safe_load(recipe_file.read_text())
            if isinstance(raw, dict):
                return identity_of(raw)
    return None


def work_in(output_dir: Path) -> list[str]:
    """The names of what a run left that a new run would lose: checkpoints and the final model."""
    if not output_dir.is_dir():
        return []
    found = sorted((p.name for p in output_dir.iterdir() if p.name.startswith(CHECKPOINT_PREFIX) and p.is_dir()),
                   key=lambda name: (len(name), name))
    if (output_dir / "final").exists():
        found.append("final/")
    return found


def write_run_file(output_dir: Path, identity: dict[str, Any]) -> None:
    write_json_atomic(output_dir / RUN_FILE, {"fingerprint": fingerprint(identity), "identity": identity})


def clear_previous_run(output_dir: Path) -> None:
    """`overwrite_output_dir: true`: remove what an earlier run wrote (checkpoints, final model, metrics, its recipe),
    so neither rotation nor a later `resume_from: auto` can mix the two runs. Anything else is left alone."""
    if not output_dir.is_dir():
        return
    for path in output_dir.iterdir():
        ours = path.name in RUN_OUTPUTS or path.name.startswith((CHECKPOINT_PREFIX, ".tmp-"))
        if not ours:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


# --- the check before anything is built ------------------------------------------------------------------------------


def check_output_dir(recipe: "Recipe") -> None:
    """Refuse, in one line, a launch that could not write its results (output_dir, persistent_dir, the image cache)
    or would overwrite a run's work. The one place every folder a run writes is checked, before anything is built."""
    output_dir = Path(recipe.output_dir)
    _check_writable(output_dir, "output_dir")
    if recipe.persistent_dir is not None:  # else found out at the first mirror, after training for it
        _check_writable(Path(recipe.persistent_dir), "persistent_dir")
    image_cache = image_cache_folder(recipe)
    if image_cache is not None:  # else found out once the model is built, when the cache is opened
        _check_writable(image_cache, "data.image_cache_dir", or_else=" (or set data.image_cache: false)")
    if recipe.overwrite_output_dir and recipe.resume_from is not None:
        raise RecipeError("overwrite_output_dir", "and resume_from both set: overwrite_output_dir starts the run "
                                                  "again from scratch; remove one of them")
    work = work_in(output_dir)
    stored = stored_identity(output_dir) if output_dir.is_dir() else None
    if recipe.overwrite_output_dir or (stored is None and not work):
        return
    ways = "choose another output_dir, or set overwrite_output_dir: true to replace it"
    if stored is None:
        raise RecipeError("output_dir", f"{output_dir} holds {', '.join(work[:3])} of a run whose recipe is not there "
                                        f"(no {RUN_FILE} or {RECIPE_FILE}); {ways}")
    differences = identity_differences(stored, run_identity(recipe))
    if differences:
        raise RecipeError("output_dir", f"{output_dir} holds another run ({'; '.join(differences)}); {ways}")
    if recipe.resume_from is None and work:
        raise RecipeError("output_dir", f"{output_dir} already holds this recipe's run ({', '.join(work[-3:])}); "
                                        "set resume_from: auto to continue it, or overwrite_output_dir: true to "
                                        "start it again")


def image_cache_folder(recipe: "Recipe") -> Path | None:
    """Where this run will write its training images' cache (vembed/data/image_cache.py), or None when it has none:
    the cache is off, the adapter has no fixed image size, or the data streams."""
    from vembed.data.image_cache import default_cache_dir
    from vembed.data.streaming import wants_streaming
    from vembed.models import MODELS

    data = recipe.data
    if not data.image_cache or recipe.model_type not in MODELS or not MODELS.get(recipe.model_type).image_cache:
        return None
    if wants_streaming(data):
        return None
    return Path(data.image_cache_dir) if data.image_cache_dir else default_cache_dir()


def _check_writable(folder: Path, key: str, or_else: str = "") -> None:
    """`folder`, or the folder it would be created in, accepts a file: tried with a probe file, since permission bits
    say nothing of read-only mounts and full quotas (and root ignores them)."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        where = "is a file" if existing == folder else f"cannot be created: {existing} is a file"
        raise RecipeError(key, f"{folder} {where}; choose a folder{or_else}")
    try:
        handle, probe = tempfile.mkstemp(prefix=".vembed-write-test-", dir=existing)
    except OSError as error:
        raise RecipeError(key, f"cannot write in {existing}: {error.strerror}; choose a writable {key}{or_else}") \
            from None
    os.close(handle)
    os.unlink(probe)


# --- the run lock ----------------------------------------------------------------------------------------------------


class RunLock:
    """An exclusive lock on output_dir while a run writes there, held by the launcher (run.py / `vembed train`) or, when
    the training processes were started otherwise, by rank 0.

    It is a kernel lock (`flock`) on `output_dir/.vembed.lock`: the kernel drops it when its holder dies, however it
    dies, so a stale lock never blocks. The file also names the holder (pid, host, command) for the refusal message;
    `filelock` is not used because it truncates the file on open, erasing that information for whoever is refused.
    A process started by the holder (a rank of the launcher that holds it) may write without the lock.
    """

    def __init__(self, output_dir: str | Path):
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / LOCK_FILE
        self._fd: int | None = None
        self._created: list[Path] = []

    def acquire(self) -> "RunLock":
        import fcntl

        self._created = _missing_parents(self.output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                os.close(fd)
                if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):  # a file system without locks
                    print(f"warning: cannot lock {self.path} ({error.strerror}); a second launch into this "
                          "output_dir would not be stopped", file=sys.stderr)
                    return self
                holder = _read_holder(self.path)
                if _started_us(holder):
                    return self
                self._remove_created()
                raise LaunchError(_in_use_message(self.output_dir, holder)) from None
            # The holder we waited on may have removed the file after we opened it: lock the file that is there.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                                 "command": " ".join(sys.argv)[:300]}).encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                self.path.unlink()
            os.close(self._fd)
            self._fd = None
        self._remove_created()

    def _remove_created(self) -> None:
        """A launch that failed before writing anything leaves no empty folders behind."""
        for path in reversed(self._created):
            with contextlib.suppress(OSError):
                path.rmdir()  # only when empty
        self._created = []

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _missing_parents(path: Path) -> list[Path]:
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return list(reversed(missing))  # outermost first


def _read_holder(path: Path) -> dict[str, Any]:
    with contextlib.suppress(OSError, ValueError):
        holder = json.loads(path.read_text() or "{}")
        if isinstance(holder, dict):
            return holder
    return {}


def _started_us(holder: dict[str, Any]) -> bool:
    """The holder is this process or one of its ancestors on this host (the launcher of this rank)."""
    if holder.get("host") != socket.gethostname():
        return False
    return holder.get("pid") in _ancestors()


def _ancestors() -> set[int]:
    pids, pid = {os.getpid(), os.getppid()}, os.getppid()
    while pid > 1:  # Linux: follow the parent chain; elsewhere the parent is all we know
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        pids.add(pid)
    return pids


def _in_use_message(output_dir: Path, holder: dict[str, Any]) -> str:
    who = f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}"
    if isinstance(holder.get("started"), (int, float)):
        who += f", started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder['started']))}"
    return (f"output_dir {output_dir} is in use by another vembed run ({who}); wait for it to end or stop it, or "
            "choose another output_dir")
