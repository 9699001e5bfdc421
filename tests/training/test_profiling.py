"""The recipe's profile: block: a Chrome trace per rank and a step-time breakdown, over the configured window."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from vembed.components import recipe_from_dict
from vembed.errors import RecipeError
from vembed.training.loop import Trainer


def test_profile_block_writes_a_chrome_trace_and_prints_the_breakdown(tiny_clip_recipe, tmp_path, capsys):
    out = tmp_path / "traces"
    raw = dict(tiny_clip_recipe, max_steps=4, data={"train": tiny_clip_recipe["data"]["train"]},
               profile={"enabled": True, "wait": 1, "warmup": 1, "active": 2, "output_dir": str(out)})
    Trainer(recipe_from_dict(raw)).run()
    trace = json.loads((out / "trace_rank0.json").read_text())
    names = {event.get("name", "") for event in trace["traceEvents"]}
    assert any(name.startswith("aten::") for name in names) and "ProfilerStep#2" in names  # the first active batch
    assert "ProfilerStep#1" not in names  # wait and warmup batches are not in the trace

    breakdown = json.loads((out / "breakdown_rank0.json").read_text())
    assert breakdown["batches"] == 2
    ms = breakdown["ms_per_batch"]
    measured = ("data_wait", "forward", "backward", "optimizer")  # each timed on its own, not as a remainder
    assert all(ms[phase] > 0 for phase in measured), ms
    # Disjoint intervals of one batch: together at most its wall time ("other" is the rest, never negative).
    assert sum(ms[phase] for phase in measured) <= ms["total"] * (1 + 1e-9)
    assert ms["other"] == pytest.approx(ms["total"] - sum(ms[phase] for phase in measured), abs=1e-6)
    assert breakdown["communication_ms_per_batch"] is None  # one process: no collectives
    printed = capsys.readouterr().out
    assert "step-time breakdown (rank 0, mean of 2 batches)" in printed and "  backward " in printed


@pytest.mark.filterwarnings("ignore:Profiler won't be using warmup")
def test_breakdown_puts_a_known_delay_in_each_phase(tiny_clip_recipe, tmp_path, monkeypatch):
    """A sleep added inside each phase (before the batch, in a tower's forward, in accelerator.backward, in the
    optimizer step) is found in that phase: the phases are measured, not inferred from one another."""
    from accelerate import Accelerator

    from vembed.training.checkpoint import TrainerState
    from vembed.training.profiling import StepProfiler

    delay = {"data_wait": 0.03, "forward": 0.04, "backward": 0.05, "optimizer": 0.06}
    backward = Accelerator.backward

    def slow_backward(self, loss, **kwargs):
        time.sleep(delay["backward"])
        return backward(self, loss, **kwargs)

    monkeypatch.setattr(Accelerator, "backward", slow_backward)
    raw = dict(tiny_clip_recipe, max_steps=2, data={"train": tiny_clip_recipe["data"]["train"]},
               profile={"enabled": True, "wait": 0, "warmup": 0, "active": 2, "output_dir": str(tmp_path)})
    trainer = Trainer(recipe_from_dict(raw))
    trainer.build()
    profiler = StepProfiler(trainer.recipe.profile, trainer.accelerator, trainer.adapter, trainer.optimizer, tmp_path)
    # Registered after the profiler's own hooks, so these sleeps fall inside its intervals.
    first_child = next(trainer.adapter.towers()[0].children())
    first_child.register_forward_pre_hook(lambda *_: time.sleep(delay["forward"]))
    trainer.optimizer.optimizer.register_step_pre_hook(lambda *_: time.sleep(delay["optimizer"]))
    state = TrainerState()
    for batch, _ in zip(trainer.loader, range(2)):
        time.sleep(delay["data_wait"])
        trainer.train_on_batch(batch, state)
        profiler.step()
    ms = profiler.breakdown["ms_per_batch"]
    for phase, seconds in delay.items():
        assert ms[phase] >= 1000 * seconds, (phase, ms)
    assert ms["other"] >= 0, ms
    assert "backward" not in trainer.accelerator.__dict__  # the window's patch is gone


@pytest.mark.filterwarnings("ignore:Profiler won't be using warmup")  # warmup 0 on purpose: profile from batch 0
def test_training_that_ends_inside_the_window_reports_what_was_recorded(tiny_clip_recipe):
    raw = dict(tiny_clip_recipe, max_steps=2, data={"train": tiny_clip_recipe["data"]["train"]},
               profile={"enabled": True, "wait": 0, "warmup": 0, "active": 5})
    Trainer(recipe_from_dict(raw)).run()
    profile = Path(raw["output_dir"]) / "profile"  # default: under output_dir
    assert json.loads((profile / "breakdown_rank0.json").read_text())["batches"] == 2
    assert (profile / "trace_rank0.json").is_file()


def test_profile_keys_are_checked():
    with pytest.raises(RecipeError, match="did you mean active") as info:
        recipe_from_dict({"profile": {"actve": 3}})
    assert info.value.key == "profile.actve"
    with pytest.raises(RecipeError) as info:
        recipe_from_dict({"profile": {"active": 0}})
    assert info.value.key == "profile.active"
