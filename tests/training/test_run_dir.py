"""output_dir under misuse: a launch into a folder holding another run (or this run's work, unasked) is refused in one
line before anything is built, a refused or failed launch changes nothing there, and a second launch while one runs
is kept out by a lock that a dead holder never leaves behind."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import TINY_CLIP_CONFIG, tiny_clip_run

from vembed.components import recipe_from_dict
from vembed.errors import CheckpointError, LaunchError, RecipeError
from vembed.training.loop import Trainer
from vembed.training.run_dir import LOCK_FILE, RunLock, check_output_dir

_recipe = tiny_clip_run


@pytest.fixture(scope="module")
def finished_run(dummy_data_dir, tmp_path_factory) -> dict:
    raw = _recipe(dummy_data_dir, tmp_path_factory.mktemp("finished") / "run")
    Trainer(recipe_from_dict(raw)).run()
    return raw


def _snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` with a hash of its bytes: what "nothing changed" compares."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def used_folder(finished_run, tmp_path) -> tuple[dict, Path]:
    run = tmp_path / "run"
    shutil.copytree(finished_run["output_dir"], run)
    return dict(finished_run, output_dir=str(run)), run


def _refuse_before_building(monkeypatch) -> None:
    """Make any model build fail the test: the refusal must come first."""
    from vembed.models.clip import ClipAdapter

    def built(*args, **kwargs):
        raise AssertionError("a model was built before the refusal")

    monkeypatch.setattr(ClipAdapter, "from_recipe", classmethod(built))


@pytest.mark.parametrize("resume_from", [None, "auto"])
def test_another_recipe_into_a_used_folder_is_refused_naming_what_differs(used_folder, monkeypatch, resume_from):
    raw, run = used_folder
    before = _snapshot(run)
    _refuse_before_building(monkeypatch)
    with pytest.raises(RecipeError) as info:
        Trainer(recipe_from_dict(dict(raw, learning_rate=5e-4, resume_from=resume_from)))
    message = str(info.value)
    assert info.value.key == "output_dir" and "another run" in message and "learning_rate: 0.001 → 0.0005" in message
    assert "overwrite_output_dir" in message and "\n" not in message
    assert _snapshot(run) == before


def test_the_same_recipe_again_must_say_resume_or_overwrite(used_folder, monkeypatch):
    raw, run = used_folder
    before = _snapshot(run)
    _refuse_before_building(monkeypatch)
    with pytest.raises(RecipeError, match="already holds this recipe's run .*resume_from: auto.*overwrite_output_dir"):
        Trainer(recipe_from_dict(raw))
    assert _snapshot(run) == before


def test_overwrite_output_dir_replaces_the_previous_run_and_nothing_else(used_folder):
    raw, run = used_folder
    (run / "notes.txt").write_text("the user's own file")
    (run / "checkpoint-8").mkdir()  # a checkpoint of the old run this one never reaches: must not survive
    result = Trainer(recipe_from_dict(dict(raw, learning_rate=5e-4, overwrite_output_dir=True))).run()
    assert result.state.global_step == 4
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-2"]
    assert (run / "notes.txt").read_text() == "the user's own file"
    import yaml

    assert yaml.safe_load((run / "recipe.yaml").read_text())["learning_rate"] == pytest.approx(5e-4)


@pytest.mark.parametrize("resume_from", ["nowhere", "another-architecture"])
def test_a_launch_refused_for_its_checkpoint_writes_nothing(finished_run, tmp_path, resume_from):
    out = tmp_path / "fresh"
    if resume_from == "another-architecture":  # the checkpoint of a model with other sizes
        resume_from = str(Path(finished_run["output_dir"]) / "checkpoint-2")
        raw = dict(finished_run, model_config={**TINY_CLIP_CONFIG, "projection_dim": 8})
    else:
        raw = finished_run
    with pytest.raises(CheckpointError):
        Trainer(recipe_from_dict(dict(raw, output_dir=str(out), resume_from=resume_from))).run()
    assert not out.exists()


def test_output_dir_that_is_a_file_or_not_writable_is_refused_before_anything_is_built(
        dummy_data_dir, tmp_path, monkeypatch):
    _refuse_before_building(monkeypatch)
    a_file = tmp_path / "taken"
    a_file.write_text("x")
    for output_dir, says in ((a_file, "is a file"), (a_file / "run", "taken is a file")):
        with pytest.raises(RecipeError, match=says):
            Trainer(recipe_from_dict(_recipe(dummy_data_dir, output_dir)))
    with pytest.raises(RecipeError, match="persistent_dir: .*taken is a file"):  # else found at the first mirror
        Trainer(recipe_from_dict(_recipe(dummy_data_dir, tmp_path / "run", persistent_dir=str(a_file))))

    def read_only(*args, **kwargs):  # as on a read-only mount (root ignores permission bits, so patched)
        raise PermissionError(13, "Read-only file system")

    monkeypatch.setattr("vembed.training.run_dir.tempfile.mkstemp", read_only)
    with pytest.raises(RecipeError, match="cannot write in .*Read-only file system"):
        Trainer(recipe_from_dict(_recipe(dummy_data_dir, tmp_path / "ro" / "run")))
    assert not (tmp_path / "ro").exists()


def test_an_image_cache_dir_that_is_a_file_or_not_writable_is_refused_before_anything_is_built(
        dummy_data_dir, tmp_path, monkeypatch):
    _refuse_before_building(monkeypatch)  # it was found only when the cache opened: FileExistsError, PermissionError
    a_file = tmp_path / "taken"
    a_file.write_text("x")
    for cache_dir, says in ((a_file, "taken is a file"), (a_file / "images", "cannot be created: .*taken is a file")):
        raw = _recipe(dummy_data_dir, tmp_path / "run", data={"train": str(dummy_data_dir / "train.jsonl"),
                                                               "image_cache_dir": str(cache_dir)})
        with pytest.raises(RecipeError, match=f"data.image_cache_dir: .*{says}"):
            Trainer(recipe_from_dict(raw))
    import tempfile

    real_mkstemp = tempfile.mkstemp

    def read_only(*args, dir=None, **kwargs):  # the default folder (~/.cache, here the tests') on a read-only mount
        if str(dir).startswith(os.environ["VEMBED_IMAGE_CACHE_DIR"]):
            raise PermissionError(13, "Read-only file system")
        return real_mkstemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr("vembed.training.run_dir.tempfile.mkstemp", read_only)
    with pytest.raises(RecipeError, match=r"data.image_cache_dir: cannot write in .*Read-only file system; choose a "
                                          r"writable data.image_cache_dir \(or set data.image_cache: false\)"):
        Trainer(recipe_from_dict(_recipe(dummy_data_dir, tmp_path / "run")))
    raw = _recipe(dummy_data_dir, tmp_path / "run", data={"train": str(dummy_data_dir / "train.jsonl"),
                                                           "image_cache": False})
    check_output_dir(recipe_from_dict(raw))  # no cache, nothing to write there
    assert not (tmp_path / "run").exists()


def test_overwrite_and_resume_together_are_refused(dummy_data_dir, tmp_path):
    with pytest.raises(RecipeError, match="overwrite_output_dir"):
        check_output_dir(recipe_from_dict(_recipe(dummy_data_dir, tmp_path, overwrite_output_dir=True,
                                                   resume_from="auto")))


# --- the lock ---------------------------------------------------------------------------------------------------------

HOLD = """
import sys, time
from vembed.training.run_dir import RunLock
lock = RunLock(sys.argv[1]).acquire()
print("held", flush=True)
if sys.argv[2] == "child":  # a process the holder started (a rank of its launcher) may write
    import subprocess
    code = "import sys; from vembed.training.run_dir import RunLock; RunLock(sys.argv[1]).acquire(); print('ok')"
    print(subprocess.run([sys.executable, "-c", code, sys.argv[1]], capture_output=True, text=True).stdout, flush=True)
time.sleep(60)
"""


def _holder(folder: Path, mode: str = "hold") -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(folder), mode], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    return process


def test_a_second_launch_is_kept_out_while_the_first_runs_and_let_in_once_it_is_killed(dummy_data_dir, tmp_path):
    out = tmp_path / "run"
    holder = _holder(out)
    try:
        with pytest.raises(LaunchError, match=f"in use by another vembed run \\(pid {holder.pid} on "):
            Trainer(recipe_from_dict(_recipe(dummy_data_dir, out, max_steps=1, save_steps=None))).run()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (out / LOCK_FILE).is_file()  # a SIGKILLed holder leaves its file; the kernel dropped its lock
    result = Trainer(recipe_from_dict(_recipe(dummy_data_dir, out, max_steps=1, save_steps=None))).run()
    assert result.state.global_step == 1
    assert not (out / LOCK_FILE).exists()  # released at the end


def test_a_process_started_by_the_holder_may_write(tmp_path):
    holder = _holder(tmp_path / "run", mode="child")
    try:
        assert holder.stdout.readline().strip() == "ok"
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


def test_a_lock_taken_and_released_leaves_no_folder_it_created(tmp_path):
    lock = RunLock(tmp_path / "a" / "b").acquire()
    assert (tmp_path / "a" / "b" / LOCK_FILE).is_file()
    lock.release()
    assert not (tmp_path / "a").exists()
    os.makedirs(tmp_path / "kept")
    with RunLock(tmp_path / "kept"):
        pass
    assert (tmp_path / "kept").is_dir()
