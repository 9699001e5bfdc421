"""Preemption (vembed/training/preemption.py): a real SIGTERM or SIGUSR1 stops a run after the step in progress, on
every rank at the same step, with one verified checkpoint and exit code 75; the resumed run ends with the weights of
one that was never stopped, bit for bit, dropout on. Launched runs (run.py, and the per-node launcher the SLURM
examples use) pass the signal on to their ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
import yaml
from deadline import limit
from launching import ENV, ROOT, final_weights, free_port
from ranks import run_on_ranks
from tiny_models import tiny_clip_run

from vembed.components import recipe_from_dict
from vembed.training.checkpoint import TrainerState, checkpoint_problem, list_checkpoints
from vembed.training.loop import Trainer
from vembed.training.preemption import PREEMPTED_EXIT_CODE, Preempted


def _with_dropout(raw: dict, p: float = 0.1) -> dict:
    """Attention dropout in both towers: what draws random numbers in a tiny CLIP step, so a resume that restored the
    RNG state wrongly would show in the weights."""
    config = raw["model_config"]
    return dict(raw, model_config={**config, **{tower: {**config[tower], "attention_dropout": p}
                                                for tower in ("text_config", "vision_config")}})


def _run(raw: dict) -> Trainer:
    trainer = Trainer(recipe_from_dict(raw))
    trainer.run()
    return trainer


def _signalling_at(step: int, signum: int, rank: int | None = None):
    """Patch the loop so that this process sends itself a real `signum` during optimizer step `step` (on `rank` only,
    when given): the handler runs between two Python instructions, wherever the step is."""
    original = Trainer.train_on_batch

    def train_on_batch(self, batch, state):
        if state.global_step == step - 1 and (rank is None or self.accelerator.process_index == rank):
            os.kill(os.getpid(), signum)
        return original(self, batch, state)

    return mock.patch.object(Trainer, "train_on_batch", train_on_batch)


def _tensors(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in trainer.objective.state_dict().items()}


def _assert_bitwise_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(actual[name], value), f"{name}: max difference {(actual[name] - value).abs().max():.2e}"


@pytest.fixture
def run_raw(dummy_data_dir, tmp_path) -> dict:
    """9 steps of a tiny CLIP with dropout, 8 per epoch, checkpoints every 4 (so the stop's checkpoint is its own)."""
    return _with_dropout(tiny_clip_run(dummy_data_dir, tmp_path / "run", max_steps=9, save_steps=4,
                                       save_total_limit=3))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_mid_epoch_stops_after_the_step_with_a_verified_checkpoint_and_resumes_bitwise(run_raw, tmp_path,
                                                                                               signum):
    reference = _tensors(_run(dict(run_raw, output_dir=str(tmp_path / "reference"))))
    before = signal.getsignal(signum)
    with _signalling_at(3, signum), pytest.raises(Preempted) as stopped:
        _run(run_raw)
    out = Path(run_raw["output_dir"])
    line = str(stopped.value)
    assert line == (f"preempted at step 3 ({signal.Signals(signum).name}); checkpoint {out / 'checkpoint-3'} "
                    "verified; resume with: the same command plus --config_override resume_from=auto; exit code 75")
    assert stopped.value.exit_code == PREEMPTED_EXIT_CODE == 75
    assert signal.getsignal(signum) is before  # the run's handler is gone with the run
    assert [path.name for path in list_checkpoints(out)] == ["checkpoint-3"]
    assert checkpoint_problem(out / "checkpoint-3") is None
    state = TrainerState.from_file(out / "checkpoint-3" / "trainer_state.json")
    assert (state.global_step, state.epoch, state.batches_in_epoch) == (3, 0, 3)  # mid-epoch
    assert [entry["step"] for entry in state.loss_history] == [1, 2, 3]
    assert not (out / "final").exists()

    resumed = _run(dict(run_raw, resume_from="auto"))
    _assert_bitwise_equal(_tensors(resumed), reference)
    history = json.loads((out / "metrics.json").read_text())["loss_history"]
    assert [entry["step"] for entry in history] == list(range(1, 10))


def test_a_streamed_run_with_workers_and_accumulation_stops_and_resumes_bitwise(tiny_clip_recipe, dummy_data_dir,
                                                                               tmp_path):
    """The stream's position goes into the stop's checkpoint; a signal during a micro-batch that only accumulates
    stops after the optimizer step; DataLoader workers forked while the handler is installed keep SIGTERM's default."""
    pytest.importorskip("webdataset")
    from streams import tar_shards

    data = dict(tiny_clip_recipe["data"], train=tar_shards(dummy_data_dir, tmp_path / "shards"), num_workers=2,
                shuffle_buffer=8, validation=None, test=None, streaming=True)
    raw = _with_dropout(dict(tiny_clip_recipe, data=data, batch_size=4, max_steps=6, save_steps=None,
                             gradient_accumulation_steps=2, save_total_limit=1))
    reference = _tensors(_run(dict(raw, output_dir=str(tmp_path / "reference"))))
    with _signalling_at(3, signal.SIGTERM), pytest.raises(Preempted, match="preempted at step 3 "):
        _run(raw)
    saved = TrainerState.from_file(Path(raw["output_dir"]) / "checkpoint-3" / "trainer_state.json")
    assert saved.batches_in_epoch == 6 and saved.stream["ranks"][0]["positions"]
    _assert_bitwise_equal(_tensors(_run(dict(raw, resume_from="auto"))), reference)


def test_a_signal_at_the_last_step_lets_the_run_finish(run_raw, capsys):
    with _signalling_at(9, signal.SIGTERM):
        trainer = _run(run_raw)
    assert trainer.accelerator.num_processes == 1
    assert (Path(run_raw["output_dir"]) / "final").is_dir()
    assert "note: SIGTERM arrived at the last step; the run finishes" in capsys.readouterr().out


def test_the_message_says_a_recipe_with_resume_from_auto_needs_no_flag(tmp_path):
    line = str(Preempted(7, "SIGUSR1", tmp_path / "checkpoint-7", resumes_by_itself=True))
    assert "resume with: the same command (resume_from is auto already)" in line
    assert "--config_override" not in line


def _stop_on_one_rank_worker(raw_path: str) -> None:
    """Rank 1 alone gets SIGTERM during step 2; both ranks must stop after step 2, and the resumption must end where
    the uninterrupted run does."""
    raw = json.loads(Path(raw_path).read_text())
    reference = _run(dict(raw, output_dir=raw["output_dir"] + "/reference"))
    stopped = dict(raw, output_dir=raw["output_dir"] + "/stopped")
    with _signalling_at(2, signal.SIGTERM, rank=1), pytest.raises(Preempted) as preempted:
        _run(stopped)
    heard = "SIGTERM" if reference.accelerator.process_index == 1 else "a stop signal on another rank"
    assert f"preempted at step 2 ({heard})" in str(preempted.value)
    resumed = _run(dict(stopped, resume_from="auto"))
    assert resumed.accelerator.num_processes == 2
    _assert_bitwise_equal(_tensors(resumed), _tensors(reference))


@pytest.mark.slow
def test_a_signal_that_reaches_one_rank_stops_every_rank_after_the_same_step(run_raw, tmp_path):
    """SLURM's --signal without B: and a `kill` of one process reach some ranks only: the flag travels in the step's
    all-reduce, so the other rank does not go on into a collective its peer never joins."""
    raw = dict(run_raw, data={"train": run_raw["data"]["train"]}, max_steps=4, save_steps=None, batch_size=4,
               output_dir=str(tmp_path))
    (tmp_path / "raw.json").write_text(json.dumps(raw))
    run_on_ranks(_stop_on_one_rank_worker, str(tmp_path / "raw.json"), world=2)
    assert [path.name for path in list_checkpoints(tmp_path / "stopped")] == ["checkpoint-2"]
    assert checkpoint_problem(tmp_path / "stopped" / "checkpoint-2") is None


# --- launched runs: the launcher gets the signal, its ranks act on it ------------------------------------------------

LAUNCH_TIMEOUT = 600


def _launcher(command: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _wait(process: subprocess.Popen, log: Path) -> int:
    try:
        return process.wait(timeout=limit(LAUNCH_TIMEOUT))
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"the launch did not end within {limit(LAUNCH_TIMEOUT):.0f} s:\n{log.read_text()[-3000:]}")


def _signal_once_checkpointed(process: subprocess.Popen, out: Path, step: int, signum: int, log: Path) -> None:
    """Send `signum` to the launcher alone once checkpoint-`step` is on disk (training is then under way)."""
    deadline = time.monotonic() + limit(LAUNCH_TIMEOUT)
    while not (out / f"checkpoint-{step}" / "manifest.json").is_file():
        if process.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"checkpoint-{step} never appeared (exit {process.poll()}):\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    process.send_signal(signum)


def _stopped_at(out: Path, log: Path, after: int) -> int:
    """The step of the stop's checkpoint, checked: verified, mid-epoch, the launch's last line saying so."""
    text = log.read_text()
    stop = max(int(path.name.split("-")[1]) for path in list_checkpoints(out))
    assert stop > after, text[-3000:]
    assert checkpoint_problem(out / f"checkpoint-{stop}") is None
    state = TrainerState.from_file(out / f"checkpoint-{stop}" / "trainer_state.json")
    assert (state.global_step, state.epoch, state.batches_in_epoch) == (stop, 0, stop), state  # 17 steps an epoch
    last = text.strip().splitlines()[-1]
    endings = ("resume_from=auto; exit code 75", "(resume_from is auto already); exit code 75")
    assert last.startswith(f"preempted at step {stop} (SIG") and last.endswith(endings), text[-3000:]
    assert f"checkpoint {out / f'checkpoint-{stop}'} verified" in last, text[-3000:]
    assert "failed" not in text and "Traceback" not in text, text[-3000:]
    return stop


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the ranks are found as the launcher's children")
def test_two_launched_ranks_stop_on_the_launchers_signal_and_resume_bitwise(dummy_data_dir, tmp_path):
    """SIGUSR1 to run.py, then SIGTERM to the per-node launcher of the SLURM examples: the ranks (in their own
    sessions, out of reach of a signal to the launcher's group) get it passed on, stop together mid-epoch with one
    verified checkpoint, and each launcher exits 75 with the ranks' line. torch's agent used to answer SIGTERM by
    killing the ranks after 30 s and SIGUSR1 not at all (its default action killed the launcher, and the ranks with
    it). Resumed, the run ends with the uninterrupted run's weights, bit for bit."""
    raw = _with_dropout(tiny_clip_run(dummy_data_dir, tmp_path / "run", batch_size=2, max_steps=16, save_steps=2,
                                      save_total_limit=8))
    recipes = {}
    for name in ("reference", "run"):
        recipes[name] = tmp_path / f"{name}.yaml"
        recipes[name].write_text(yaml.safe_dump(dict(raw, output_dir=str(tmp_path / name))))
    out, run_py = tmp_path / "run", [sys.executable, "run.py"]
    accelerate_args = ["--config_file", "accelerate_configs/ddp_cpu.yaml", "--num_processes", "2",
                       "--main_process_port", str(free_port()), "vembed/entrypoints/train.py", str(recipes["run"])]
    resume = ["--config_override", "resume_from=auto"]

    log = tmp_path / "first.log"
    first = _launcher([*run_py, str(recipes["run"]), "--accelerate_config", "ddp_cpu"], log)
    _signal_once_checkpointed(first, out, 2, signal.SIGUSR1, log)
    assert _wait(first, log) == PREEMPTED_EXIT_CODE, log.read_text()[-3000:]
    stop = _stopped_at(out, log, after=2)

    log = tmp_path / "second.log"
    second = _launcher([sys.executable, "-m", "vembed.entrypoints.accelerate_launch", *accelerate_args, *resume], log)
    _signal_once_checkpointed(second, out, stop + 2 - stop % 2, signal.SIGTERM, log)
    assert _wait(second, log) == PREEMPTED_EXIT_CODE, log.read_text()[-3000:]
    _stopped_at(out, log, after=stop)

    log = tmp_path / "last.log"
    assert _wait(_launcher([*run_py, str(recipes["run"]), "--accelerate_config", "ddp_cpu", *resume], log), log) == 0
    log = tmp_path / "reference.log"
    assert _wait(_launcher([*run_py, str(recipes["reference"]), "--accelerate_config", "ddp_cpu"], log), log) == 0
    _assert_bitwise_equal(final_weights(out), final_weights(tmp_path / "reference"))
    history = json.loads((out / "metrics.json").read_text())["loss_history"]
    assert [entry["step"] for entry in history] == list(range(1, 17))
