"""Checkpoints under faults: a damaged one is never trusted (resume walks back to the newest good one, naming the bad
file), one of another run is refused naming what differs, and a full disk is one line naming the last good one."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import tiny_clip_run

from vembed.components import recipe_from_dict
from vembed.errors import CheckpointError
from vembed.training import checkpoint as checkpoint_module
from vembed.training.checkpoint import resolve_resume
from vembed.training.loop import Trainer
from vembed.training.run_dir import run_identity


def _recipe(data_dir: Path, output_dir: Path, **changes) -> dict:
    return tiny_clip_run(data_dir, output_dir, **{"max_steps": 6, **changes})


@pytest.fixture(scope="module")
def finished_run(dummy_data_dir, tmp_path_factory) -> dict:
    """A finished run with checkpoint-2 and checkpoint-4 (6 is the end: final/). Tests damage copies of it."""
    raw = _recipe(dummy_data_dir, tmp_path_factory.mktemp("finished") / "run")
    Trainer(recipe_from_dict(raw)).run()
    return raw


def _copy(finished_run: dict, tmp_path: Path) -> tuple[dict, Path]:
    run = tmp_path / "run"
    shutil.copytree(finished_run["output_dir"], run)
    return dict(finished_run, output_dir=str(run)), run


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _overwrite(path: Path, data: bytes, offset: int = 256) -> None:
    with open(path, "r+b") as handle:  # same size: only a checksum can tell
        handle.seek(offset)
        handle.write(data)


DAMAGE = {  # the fault, the file it hits, what the warning says about it
    "truncated weights": ("model.safetensors", _truncate, "bytes"),
    "4 KiB of zeros in the weights": ("model.safetensors", lambda p: _overwrite(p, bytes(4096)), "checksum"),
    "0xFF over the weights": ("model.safetensors", lambda p: _overwrite(p, b"\xff" * 4096), "checksum"),
    "deleted RNG state": ("random_states_0.pkl", Path.unlink, "missing"),
    "deleted trainer state": ("trainer_state.json", Path.unlink, "missing"),
    "truncated optimizer": ("optimizer.bin", _truncate, "bytes"),
    "scheduler overwritten": ("scheduler.bin", lambda p: _overwrite(p, b"\x00" * 64, offset=0), "checksum"),
    "deleted manifest": ("manifest.json", Path.unlink, "manifest.json is missing"),
    "garbage manifest": ("manifest.json", lambda p: p.write_text("{not json"), "manifest.json is unreadable"),
}


@pytest.mark.parametrize("fault", list(DAMAGE))
def test_a_damaged_newest_checkpoint_is_skipped_naming_the_bad_file(finished_run, tmp_path, fault):
    raw, run = _copy(finished_run, tmp_path)
    name, damage, says = DAMAGE[fault]
    damage(run / "checkpoint-4" / name)
    warnings = []
    found = resolve_resume("auto", run, run_identity(recipe_from_dict(raw)), warn=warnings.append)
    assert found == run / "checkpoint-2"
    assert len(warnings) == 1 and all(part in warnings[0] for part in ("checkpoint-4", name, says)), warnings
    # A path naming the damaged checkpoint is refused outright, in one line.
    with pytest.raises(CheckpointError, match=f"checkpoint-4 cannot be used: .*{name}") as info:
        resolve_resume(str(run / "checkpoint-4"), run)
    assert "\n" not in str(info.value)


def test_no_good_checkpoint_left_is_one_line_naming_each(finished_run, tmp_path):
    raw, run = _copy(finished_run, tmp_path)
    _truncate(run / "checkpoint-4" / "model.safetensors")
    (run / "checkpoint-2" / "random_states_0.pkl").unlink()
    warnings = []
    with pytest.raises(CheckpointError) as info:
        resolve_resume("auto", run, warn=warnings.append)
    message = str(info.value)
    assert "\n" not in message and not warnings
    assert "checkpoint-4: model.safetensors has" in message
    assert "checkpoint-2: random_states_0.pkl is missing" in message


def test_resume_walks_back_to_the_good_checkpoint_and_ends_as_an_uninterrupted_run(finished_run, tmp_path, capsys):
    """Zeros in the newest checkpoint's weights used to train on (final weights off by 0.40); now the run resumes
    from checkpoint-2 and, resume being exact, ends with the uninterrupted run's weights bit for bit."""
    raw, run = _copy(finished_run, tmp_path)
    _overwrite(run / "checkpoint-4" / "model.safetensors", bytes(4096))
    shutil.rmtree(run / "final")
    Trainer(recipe_from_dict(dict(raw, resume_from="auto"))).run()
    out = capsys.readouterr().out
    assert "skipping" in out and "checkpoint-4" in out and "resumed from" in out and "checkpoint-2" in out
    expected = load_file(str(Path(finished_run["output_dir"]) / "final" / "model.safetensors"))
    actual = load_file(str(run / "final" / "model.safetensors"))
    assert expected.keys() == actual.keys()
    assert all((expected[k] - actual[k]).abs().max().item() == 0.0 for k in expected)
    # The damaged checkpoint was replaced by a good one when training reached step 4 again.
    assert checkpoint_module.checkpoint_problem(run / "checkpoint-4") is None


def test_a_checkpoint_of_another_run_is_refused_naming_what_differs(finished_run, tmp_path):
    raw, run = _copy(finished_run, tmp_path)
    ours = run_identity(recipe_from_dict(dict(raw, learning_rate=5e-4, model_config={"projection_dim": 8})))
    with pytest.raises(CheckpointError) as info:
        resolve_resume(str(run / "checkpoint-4"), run, ours)
    message = str(info.value)
    assert "another run" in message and "learning_rate: 0.001 → 0.0005" in message and "model_config" in message


def _make_foreign(checkpoint: Path, **changes) -> None:
    """Turn `checkpoint` into one of another recipe, as if copied in from that run's folder: whose run a checkpoint
    is, is what its manifest says (the weights of a same-architecture run would load without complaint)."""
    from vembed.training.run_dir import fingerprint

    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["identity"] = {**manifest["identity"], **changes}
    manifest["run"] = fingerprint(manifest["identity"])
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def test_resume_auto_refuses_a_newest_checkpoint_of_another_run(finished_run, tmp_path):
    raw, run = _copy(finished_run, tmp_path)
    _make_foreign(run / "checkpoint-4", learning_rate=5e-4)
    with pytest.raises(CheckpointError, match="checkpoint-4 is a checkpoint of another run .*learning_rate"):
        resolve_resume("auto", run, run_identity(recipe_from_dict(raw)))


@pytest.mark.parametrize("folder", ["this run's folder", "an older run's folder without run.json"])
def test_a_foreign_checkpoint_in_the_folder_stops_a_resume_auto_launch_before_anything_is_written(
        finished_run, tmp_path, folder):
    """The folder passes the output_dir check (its run.json, or an older vembed's recipe.yaml, is this recipe's), but
    its newest checkpoint came from another recipe: `resume_from: auto` must refuse it, not train on from it."""
    raw, run = _copy(finished_run, tmp_path)
    shutil.rmtree(run / "final")  # an interrupted run
    if folder != "this run's folder":
        (run / "run.json").unlink()  # older vembed wrote only recipe.yaml
    _make_foreign(run / "checkpoint-4", learning_rate=5e-4, weight_decay=0.5)
    written = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    with pytest.raises(CheckpointError, match="checkpoint of another run") as info:
        Trainer(recipe_from_dict(dict(raw, resume_from="auto")))
    message = str(info.value)
    assert "\n" not in message and "learning_rate: 0.0005 → 0.001" in message and "weight_decay" in message
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == written


def _fill_the_disk_while_saving_step_4(monkeypatch, error: Exception, free: int | None) -> None:
    """accelerate writes the optimizer with torch.save; make that write fail as on a full disk, from step 4 on."""
    import accelerate.checkpointing

    original = accelerate.checkpointing.save

    def save(obj, path, *args, **kwargs):
        if "checkpoint-4" in str(path):
            Path(path).write_bytes(b"\0" * 1000)  # a partial file, as the failed write leaves one
            raise error
        return original(obj, path, *args, **kwargs)

    monkeypatch.setattr(accelerate.checkpointing, "save", save)
    if free is not None:
        usage = shutil.disk_usage("/")
        monkeypatch.setattr(checkpoint_module.shutil, "disk_usage", lambda path: usage._replace(free=free))


@pytest.mark.parametrize("error, free, says", [
    (RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 17984 vs 17876"), 12 << 10,
     "disk full"),  # torch's C++ writer loses the errno; the free space tells
    (OSError(errno.ENOSPC, "No space left on device"), None, "disk full"),
    (RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 17984 vs 17876"), 50 << 30,
     "could not write checkpoint-4"),  # plenty of space: not called a full disk, still one line
], ids=["torch-short-write", "enospc", "other-write-failure"])
def test_a_failed_checkpoint_write_is_one_line_naming_the_last_complete_checkpoint(
        dummy_data_dir, tmp_path, monkeypatch, error, free, says):
    raw = _recipe(dummy_data_dir, tmp_path / "run")
    _fill_the_disk_while_saving_step_4(monkeypatch, error, free)
    with pytest.raises(CheckpointError) as info:
        Trainer(recipe_from_dict(raw)).run()
    message = str(info.value)
    assert "\n" not in message and says in message and "checkpoint-4" in message
    assert f"the last complete checkpoint is {tmp_path / 'run' / 'checkpoint-2'}" in message
    left = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert left == ["checkpoint-2", "recipe.yaml", "run.json"], left  # no partial checkpoint, no lock


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 900 KiB file system (root only): one tiny-CLIP checkpoint fits, a second does not."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=900k", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root (the patched-write test covers the same path)")
    yield mount
    subprocess.run(["umount", "--lazy", str(mount)], check=False)  # lazy: a file still open must not keep it


def test_a_really_full_disk_is_one_line_and_the_run_resumes_once_there_is_room(dummy_data_dir, small_tmpfs):
    raw = _recipe(dummy_data_dir, small_tmpfs / "run")
    with pytest.raises(CheckpointError, match="disk full: could not write checkpoint-4") as info:
        Trainer(recipe_from_dict(raw)).run()
    assert f"the last complete checkpoint is {small_tmpfs / 'run' / 'checkpoint-2'}" in str(info.value)
    assert not list((small_tmpfs / "run").glob(".tmp-*"))
    subprocess.run(["mount", "-o", "remount,size=8m", str(small_tmpfs)], check=True)
    result = Trainer(recipe_from_dict(dict(raw, resume_from="auto"))).run()
    assert result.state.global_step == 6 and (small_tmpfs / "run" / "final" / "model.safetensors").is_file()
    assert json.loads((small_tmpfs / "run" / "metrics.json").read_text())["train"]["steps"] == 6


def _safetensors_full_disk() -> Exception:
    """What safetensors' Rust writer raises on a full disk (seen on a full tmpfs): not an OSError, no errno."""
    from safetensors import SafetensorError

    return SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


@pytest.mark.parametrize("error", [_safetensors_full_disk, lambda: OSError(errno.ENOSPC, "No space left on device")],
                         ids=["safetensors", "enospc"])
def test_a_full_disk_while_final_is_written_is_one_line_exit_2_and_keeps_the_previous_final(
        finished_run, tmp_path, monkeypatch, capsys, error):
    """final/ goes through the checkpoints' write guard: one line and exit 2 from `vembed train`, the partial
    `.tmp-final/` removed, and the final/ of the earlier launch untouched (it is replaced only once the new one is
    whole). safetensors' own error used to pass the guard: a 40-line traceback, `.tmp-final/` left behind."""
    import transformers.modeling_utils
    import yaml

    from vembed.entrypoints.train import main

    raw, run = _copy(finished_run, tmp_path)
    before = load_file(str(run / "final" / "model.safetensors"))

    def full_disk(tensors, filename, *args, **kwargs):
        Path(filename).write_bytes(b"\0" * 1000)  # a partial file, as the failed write leaves one
        raise error()

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full_disk)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(dict(raw, resume_from="auto")))  # trains steps 5-6 again, then writes final/
    capsys.readouterr()
    assert main([str(recipe)]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(lines) == 1, lines
    assert lines[0].startswith("checkpoint error: disk full: could not write the final model"), lines
    assert f"the last complete checkpoint is {run / 'checkpoint-4'}" in lines[0]
    assert not list(run.glob(".tmp-*"))
    after = load_file(str(run / "final" / "model.safetensors"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
