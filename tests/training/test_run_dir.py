"""output_dir under misuse: a launch into a folder holding another run (or this run's work, unasked) is refused in one
line before anything is built, a refused or failed launch changes nothing there, and a second launch while one runs
is kept out by a lock that a dead holder never leaves behind."""

from __future__ import annotations

import hashlib
import json
import os
import re
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


# --- identity, a folder's contents and its clearing, without a run (fast: what mutation testing reruns) -------------

NOT_TRAINING = {  # a key that changes where or how a run is written, logged or checked, with another value
    "output_dir": "elsewhere", "persistent_dir": "/mirror", "resume_from": "auto", "overwrite_output_dir": True,
    "report_to": "wandb", "run_name": "other", "logging_steps": 7, "save_steps": 9, "save_total_limit": 5,
    "eval_steps": 3, "eval_before_training": True, "metric_for_best_model": "r@5", "eval_batch_size": 3,
    "profile": {"steps": 2}, "data.validation": "v.jsonl", "data.test": "t.jsonl", "data.eval_max_samples": 3,
    "data.num_workers": 4, "data.max_bad_fraction": 0.5, "data.qrels_splits.validation": "dev",
    "data.qrels_splits.test": "eval", "data.first_stage_run": "bm25.trec", "compile": True,
}


def _recipe_dict(**changes) -> dict:
    raw = {"model_type": "clip", "model_config": {"projection_dim": 16}, "learning_rate": 1e-3, "seed": 0,
           "data": {"train": "train.jsonl", "columns": {"text": "caption"}, "qrels_splits": {}}}
    for dotted, value in changes.items():
        *parents, key = dotted.split(".")
        section = raw
        for parent in parents:
            section = section.setdefault(parent, {})
        section[key] = value
    return raw


@pytest.mark.parametrize("key", sorted(NOT_TRAINING))
def test_keys_that_do_not_change_what_is_trained_are_not_part_of_the_identity(key):
    from vembed.training.run_dir import NOT_IDENTITY, identity_of

    assert identity_of(_recipe_dict(**{key: NOT_TRAINING[key]})) == identity_of(_recipe_dict())
    assert set(NOT_TRAINING) == NOT_IDENTITY  # a new such key gets a case here


def test_a_recipe_that_evaluates_on_other_qrels_may_write_into_its_runs_folder(dummy_data_dir, tmp_path):
    from vembed.training.run_dir import run_identity, write_run_file

    raw = _recipe(dummy_data_dir, tmp_path / "run")
    (tmp_path / "run").mkdir()
    write_run_file(tmp_path / "run", run_identity(recipe_from_dict(raw)))
    check_output_dir(recipe_from_dict(dict(raw, data={**raw["data"], "qrels_splits": {"validation": "test"}})))
    with pytest.raises(RecipeError, match=r"another run \(data.qrels_splits.train: train → dev\)"):
        check_output_dir(recipe_from_dict(dict(raw, data={**raw["data"], "qrels_splits": {"train": "dev"}})))


@pytest.mark.parametrize("key, value", [("learning_rate", 5e-4), ("seed", 1), ("data.train", "other.jsonl"),
                                        ("data.columns.text", "title"), ("model_config.projection_dim", 8)])
def test_keys_that_change_what_is_trained_are_part_of_the_identity(key, value):
    from vembed.training.run_dir import identity_of

    assert identity_of(_recipe_dict(**{key: value})) != identity_of(_recipe_dict())


def test_sections_are_compared_key_by_key_and_free_form_dicts_as_a_whole():
    from vembed.training.run_dir import identity_differences, identity_of

    for section in ("data", "data.columns", "dit", "flow"):
        ours = identity_of(_recipe_dict(**{f"{section}.size": 2}))
        stored = identity_of(_recipe_dict(**{f"{section}.size": 1}))
        assert identity_differences(stored, ours) == [f"{section}.size: 1 → 2"]
        del stored[f"{section}.size"]  # a key an older vembed did not write is not a difference
        assert identity_differences(stored, ours) == []
    ours, stored = identity_of(_recipe_dict(**{"model_config.size": 2})), identity_of(_recipe_dict())
    assert identity_differences(stored, ours) == [
        'model_config: {"projection_dim": 16} → {"projection_dim": 16, "size": 2}']


@pytest.mark.parametrize("differing, shown", [(3, 3), (4, 4), (5, 4)])
def test_at_most_four_differences_are_named_and_the_rest_counted(differing, shown):
    from vembed.training.run_dir import identity_differences

    stored = {f"key{i}": 0 for i in range(differing)}
    lines = identity_differences(stored, {key: 1 for key in stored})
    assert lines[:shown] == [f"key{i}: 0 → 1" for i in range(shown)]
    assert lines[shown:] == ([f"and {differing - shown} more"] if differing > shown else [])


@pytest.mark.parametrize("length, shown", [(39, "a" * 39), (40, "a" * 40), (41, "a" * 37 + "...")])
def test_a_long_value_is_cut_to_forty_characters(length, shown):
    from vembed.training.run_dir import identity_differences

    assert identity_differences({"k": "a" * length}, {"k": "b"}) == [f"k: {shown} → b"]


def test_the_stored_identity_comes_from_run_json_else_the_saved_recipe(tmp_path):
    from vembed.training.run_dir import RECIPE_FILE, RUN_FILE, identity_of, stored_identity, write_run_file

    assert stored_identity(tmp_path) is None
    (tmp_path / RECIPE_FILE).write_text("- not a recipe\n")
    assert stored_identity(tmp_path) is None
    import yaml

    (tmp_path / RECIPE_FILE).write_text(yaml.safe_dump(_recipe_dict(logging_steps=3)))
    assert stored_identity(tmp_path) == identity_of(_recipe_dict())
    for broken in ("{not json", "[]", '{"fingerprint": "x"}', '{"identity": 3}'):  # a damaged run.json: the recipe says
        (tmp_path / RUN_FILE).write_text(broken)
        assert stored_identity(tmp_path) == identity_of(_recipe_dict())
    write_run_file(tmp_path, {"seed": 5})
    assert stored_identity(tmp_path) == {"seed": 5}


def test_work_lists_checkpoints_in_step_order_then_the_final_model(tmp_path):
    from vembed.training.run_dir import work_in

    assert work_in(tmp_path / "missing") == []
    for name in ("checkpoint-10", "checkpoint-9", "checkpoint-100"):
        (tmp_path / name).mkdir()
    (tmp_path / "checkpoint-5").write_text("a file, not a checkpoint")
    (tmp_path / "xcheckpoint-1").mkdir()
    assert work_in(tmp_path) == ["checkpoint-9", "checkpoint-10", "checkpoint-100"]
    (tmp_path / "final").mkdir()
    assert work_in(tmp_path) == ["checkpoint-9", "checkpoint-10", "checkpoint-100", "final/"]


def test_clearing_a_previous_run_removes_its_outputs_and_nothing_else(tmp_path):
    from vembed.training.run_dir import RUN_OUTPUTS, clear_previous_run

    run, outside = tmp_path / "run", tmp_path / "outside"
    outside.mkdir()
    (outside / "kept.txt").write_text("x")
    run.mkdir()
    for name in RUN_OUTPUTS:
        (run / name).write_text("old")
    (run / "final").unlink()
    (run / "final").mkdir()
    (run / "final" / "model.safetensors").write_text("old")
    for name in ("checkpoint-2", ".tmp-checkpoint-4"):
        (run / name).mkdir()
    (run / "checkpoint-6").symlink_to(outside, target_is_directory=True)  # unlinked, its target left alone
    for name in ("notes.txt", "data", "tmp-x"):
        (run / name).write_text("the user's")
    clear_previous_run(run)
    assert sorted(p.name for p in run.iterdir()) == ["data", "notes.txt", "tmp-x"]
    assert (outside / "kept.txt").read_text() == "x"
    clear_previous_run(tmp_path / "missing")  # nothing to clear


def test_a_folder_with_work_is_refused_unless_resumed_or_overwritten_naming_that_work(dummy_data_dir, tmp_path):
    from vembed.training.run_dir import RUN_FILE, run_identity, write_run_file

    run = tmp_path / "run"
    raw = _recipe(dummy_data_dir, run)
    for step in (2, 4, 6, 10):
        (run / f"checkpoint-{step}").mkdir(parents=True)
    with pytest.raises(RecipeError, match=r"holds checkpoint-2, checkpoint-4, checkpoint-6 of a run whose recipe is "
                                          r"not there \(no run.json or recipe.yaml\); choose another output_dir, or "
                                          r"set overwrite_output_dir: true to replace it$"):
        check_output_dir(recipe_from_dict(raw))
    write_run_file(run, run_identity(recipe_from_dict(raw)))
    (run / "final").mkdir()
    with pytest.raises(RecipeError, match=r"already holds this recipe's run \(checkpoint-6, checkpoint-10, final/\)"):
        check_output_dir(recipe_from_dict(raw))
    check_output_dir(recipe_from_dict(dict(raw, resume_from="auto")))
    check_output_dir(recipe_from_dict(dict(raw, learning_rate=5e-4, overwrite_output_dir=True)))
    (run / RUN_FILE).unlink()
    shutil.rmtree(run / "final")
    for step in (2, 4, 6, 10):
        (run / f"checkpoint-{step}").rmdir()
    check_output_dir(recipe_from_dict(raw))  # an empty folder takes any run


def _lock_held_by(folder: Path, holder: dict) -> int:
    """Lock `folder` as a run `holder` names would (a second open file description conflicts even in this process)."""
    import fcntl

    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, json.dumps(holder).encode())
    return fd


def test_a_held_lock_keeps_out_a_launch_it_did_not_start_naming_the_holder(tmp_path):
    import socket
    import time

    host, started = socket.gethostname(), time.mktime((2026, 1, 2, 3, 4, 5, 0, 0, -1))
    fd = _lock_held_by(tmp_path / "run", {"pid": 999_999_999, "host": host, "started": started})
    try:
        with pytest.raises(LaunchError) as info:
            RunLock(tmp_path / "run").acquire()
        assert str(info.value) == (f"launch error: output_dir {tmp_path / 'run'} is in use by another vembed run "
                                   f"(pid 999999999 on {host}, started 2026-01-02 03:04:05); wait for it to end or "
                                   "stop it, or choose another output_dir")
        for holder, who in (({"pid": os.getpid(), "host": "elsewhere"}, f"pid {os.getpid()} on elsewhere"),
                            ([], "pid ? on ?")):  # the same pid on another host is another process
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(holder).encode(), 0)
            with pytest.raises(LaunchError, match=rf"in use by another vembed run \({re.escape(who)}\); wait"):
                RunLock(tmp_path / "run").acquire()
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getppid(), "host": host}).encode(), 0)  # our launcher: let in
        lock = RunLock(tmp_path / "run").acquire()
        lock.release()
        assert (tmp_path / "run" / LOCK_FILE).is_file()  # the holder's file, not ours to remove
    finally:
        os.close(fd)


def test_a_lock_names_its_holder_in_its_file_and_lets_in_the_process_that_holds_it(tmp_path, monkeypatch):
    import socket
    import stat
    import time

    monkeypatch.setattr(sys, "argv", ["vembed", "train", "x" * 400])
    path = tmp_path / "run" / LOCK_FILE
    lock = RunLock(tmp_path / "run").acquire()
    try:
        holder = json.loads(path.read_text())
        assert (holder["pid"], holder["host"]) == (os.getpid(), socket.gethostname())
        assert abs(holder["started"] - time.time()) < 600 and holder["command"] == ("vembed train " + "x" * 400)[:300]
        umask = os.umask(0)
        os.umask(umask)
        assert stat.S_IMODE(path.stat().st_mode) == 0o644 & ~umask
        RunLock(tmp_path / "run").acquire().release()  # as a rank of this launcher: let in, and nothing released
        assert json.loads(path.read_text()) == holder
        path.unlink()  # removed under the holder (a user cleaning the folder): releasing still works
    finally:
        lock.release()
    assert not path.exists()


def test_a_file_system_without_locks_warns_and_lets_the_launch_in(tmp_path, monkeypatch, capsys):
    import errno
    import fcntl

    def no_locks(*args):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    RunLock(tmp_path / "run").acquire().release()
    assert capsys.readouterr().err == (f"warning: cannot lock {tmp_path / 'run' / LOCK_FILE} (No locks available); a "
                                       "second launch into this output_dir would not be stopped\n")


def test_an_unreadable_holder_is_unknown_and_a_value_json_cannot_write_is_shown_as_text(tmp_path):
    import datetime

    from vembed.training.run_dir import _read_holder, identity_differences

    assert _read_holder(tmp_path / "missing") == {}
    day = datetime.date(2026, 1, 2)  # as YAML reads an unquoted date in a saved recipe.yaml
    assert identity_differences({"k": [day]}, {"k": "b"}) == ['k: ["2026-01-02"] → b']


def test_the_run_fingerprint_is_sixteen_hex_digits_of_the_identity_whatever_its_key_order(tmp_path):
    import datetime

    from vembed.training.run_dir import RUN_FILE, fingerprint, write_run_file

    ours = {"seed": 0, "learning_rate": 1e-3}
    assert fingerprint(ours) == fingerprint(dict(reversed(ours.items()))) != fingerprint(dict(ours, seed=1))
    assert re.fullmatch("[0-9a-f]{16}", fingerprint(ours))
    assert fingerprint({"when": datetime.date(2026, 1, 2)}) == fingerprint({"when": "2026-01-02"})
    write_run_file(tmp_path, ours)
    assert json.loads((tmp_path / RUN_FILE).read_text()) == {"fingerprint": fingerprint(ours), "identity": ours}


def test_an_unreadable_or_broken_run_file_or_recipe_is_no_identity(tmp_path, monkeypatch):
    from vembed.training.run_dir import RECIPE_FILE, RUN_FILE, stored_identity, write_run_file

    write_run_file(tmp_path, {"seed": 5})
    (tmp_path / RECIPE_FILE).write_text("seed: [")  # not YAML
    assert stored_identity(tmp_path) == {"seed": 5}
    real_read_text = Path.read_text

    def unreadable(path, *args, **kwargs):
        if path.name in unreadable.names:
            raise PermissionError(13, "Permission denied")
        return real_read_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", unreadable)
    unreadable.names = {RUN_FILE}
    assert stored_identity(tmp_path) is None  # the recipe is broken too
    (tmp_path / RECIPE_FILE).write_text("seed: 6\n")
    assert stored_identity(tmp_path) == {"seed": 6}
    unreadable.names = {RUN_FILE, RECIPE_FILE}
    assert stored_identity(tmp_path) is None


def test_releasing_twice_or_unacquired_is_harmless_and_a_created_folder_holding_results_is_kept(tmp_path):
    RunLock(tmp_path / "never").release()
    lock = RunLock(tmp_path / "new" / "run").acquire()
    (tmp_path / "new" / "run" / "metrics.json").write_text("{}")  # what the run wrote
    lock.release()
    lock.release()
    assert (tmp_path / "new" / "run" / "metrics.json").is_file() and not (tmp_path / "new" / "run" / LOCK_FILE).exists()


def test_the_ancestors_follow_the_parent_chain_even_through_odd_process_names(monkeypatch):
    from vembed.training.run_dir import _ancestors

    stats = {"/proc/100/stat": "100 (a) b (c) S 50 100 1", "/proc/50/stat": "50 (launcher) S 1 50 1"}
    real_read_text = Path.read_text

    def proc(path, *args, **kwargs):
        if str(path).startswith("/proc/"):
            if str(path) not in stats:
                raise FileNotFoundError(str(path))  # a process that ended, or no /proc at all
            return stats[str(path)]
        return real_read_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", proc)
    monkeypatch.setattr(os, "getppid", lambda: 100)
    assert _ancestors() == {os.getpid(), 100, 50, 1}
    del stats["/proc/50/stat"]
    assert _ancestors() == {os.getpid(), 100, 50}
