"""Every optimizer step's loss reaches `metrics.json` (`step_losses`) unrounded, whatever `logging_steps` is, with
gradient accumulation, and across a resume; the meter keeps each step apart from the log line's window mean."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from interrupts import stop_after_checkpoint
from tiny_models import tiny_clip_run

from vembed.components import recipe_from_dict
from vembed.training.log_meter import LogMeter
from vembed.training.loop import Trainer


class _Throughput:
    """ThroughputMeter's interface, doing nothing: these tests are about the losses."""

    def reset(self) -> None:
        pass

    def add(self, batch) -> None:
        pass

    def record(self, seconds: float) -> dict[str, float]:
        return {}


class _OneProcess:
    """What the meter asks of an Accelerator, for one process: the device, and a reduce over one rank."""

    device = torch.device("cpu")
    num_processes = 1

    def reduce(self, tensor: torch.Tensor, reduction: str) -> torch.Tensor:
        return tensor


def test_the_meter_keeps_each_optimizer_step_apart_from_the_window_mean():
    """Micro-batches 1, 2 | 4 | 8, 16 (two accumulated, one, two): steps 1.5, 4 and 12 of a window ending at step 9,
    handed over once; the log line's loss is the mean over the window's micro-batches; a reset starts afresh."""
    meter = LogMeter(samples_per_batch=2, throughput=_Throughput())
    for step in ([1.0, 2.0], [4.0], [8.0, 16.0]):
        for loss in step:
            meter.add(torch.tensor(loss), {})
        meter.end_step()
    assert meter.take_step_records(_OneProcess(), last_step=9) == [
        {"step": 7, "loss": 1.5}, {"step": 8, "loss": 4.0}, {"step": 9, "loss": 12.0}]
    assert meter.take_step_records(_OneProcess(), last_step=9) == [], "each step is handed over once"
    assert meter.record(_OneProcess(), step=9, lr=0.1)["loss"] == pytest.approx(31.0 / 5, abs=1e-6)
    meter.add(torch.tensor(3.0), {})
    meter.end_step()
    meter.reset()
    assert meter.take_step_records(_OneProcess(), last_step=10) == [], "a reset starts an empty window"
    meter.add(torch.tensor(5.0), {})
    meter.end_step()
    assert meter.take_step_records(_OneProcess(), last_step=11) == [{"step": 11, "loss": 5.0}]


def test_the_step_losses_are_not_rounded_nor_read_in_another_precision():
    """The float32 loss as the step computed it, as a Python float: 1/3 in float32 is 0.3333333432674408."""
    meter = LogMeter(samples_per_batch=1, throughput=_Throughput())
    meter.add(torch.tensor(1.0) / 3, {})
    meter.end_step()
    (record,) = meter.take_step_records(_OneProcess(), last_step=1)
    assert record["loss"] == float(torch.tensor(1.0, dtype=torch.float32) / 3) == 0.3333333432674408


def _run(raw: dict) -> dict:
    Trainer(recipe_from_dict(raw)).run()
    return json.loads(Path(raw["output_dir"], "metrics.json").read_text())


@pytest.fixture(scope="module")
def every_step_logged(dummy_data_dir, tmp_path_factory) -> tuple[dict, dict]:
    """5 optimizer steps of 2 accumulated micro-batches of tiny CLIP (no dropout: every run computes the same),
    a log line at every step: the recipe and its metrics.json."""
    raw = tiny_clip_run(dummy_data_dir, tmp_path_factory.mktemp("every-step") / "run", max_steps=5, save_steps=None,
                        batch_size=4, gradient_accumulation_steps=2, logging_steps=1)
    return raw, _run(raw)


def test_every_step_loss_is_in_metrics_json_whatever_logging_steps_is(every_step_logged, tmp_path):
    """With a log line every 3 steps (the last at step 5, the end), metrics.json still holds the loss of each of the
    5 steps, equal to what a run logging every step logged, bit for bit; the log lines hold window means."""
    raw, reference = every_step_logged
    expected = [{"step": record["step"], "loss": record["loss"]} for record in reference["loss_history"]]
    assert [record["step"] for record in expected] == [1, 2, 3, 4, 5]
    assert reference["step_losses"] == expected

    sparse = _run(dict(raw, output_dir=str(tmp_path / "sparse"), logging_steps=3))
    assert [record["step"] for record in sparse["loss_history"]] == [3, 5]
    assert sparse["step_losses"] == expected
    losses = [record["loss"] for record in expected]
    assert sparse["loss_history"][0]["loss"] == pytest.approx(sum(losses[:3]) / 3, rel=1e-6)
    assert sparse["loss_history"][1]["loss"] == pytest.approx(sum(losses[3:]) / 2, rel=1e-6)
    assert any(loss != round(loss, 6) for loss in losses), "full precision, not the progress bar's rounding"


def test_step_losses_survive_a_resume_from_a_checkpoint_between_log_lines(every_step_logged, tmp_path):
    """Logging every 3 steps, stopped after its checkpoint at step 2 (before the first log line) and resumed: steps
    1-2 come from the checkpoint, 3-5 from the resumed run, each once, with the uninterrupted run's losses."""
    raw, reference = every_step_logged
    raw = dict(raw, output_dir=str(tmp_path / "interrupted"), save_steps=2, logging_steps=3)
    stop_after_checkpoint(lambda: Trainer(recipe_from_dict(raw)).run(), 2)
    resumed = _run(dict(raw, resume_from="auto"))
    assert resumed["step_losses"] == reference["step_losses"]
