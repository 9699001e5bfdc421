"""The recipe's profile: block: a Chrome trace per rank and a step-time breakdown, over the configured window."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vembed.errors import RecipeError
from vembed.recipe import recipe_from_dict
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
    assert ms["forward"] > 0 and ms["optimizer"] > 0 and ms["data_wait"] > 0 and ms["backward_and_rest"] > 0
    parts = ms["data_wait"] + ms["forward"] + ms["backward_and_rest"] + ms["optimizer"]
    assert parts == pytest.approx(ms["total"], rel=1e-6)
    assert breakdown["communication_ms_per_batch"] is None  # one process: no collectives
    printed = capsys.readouterr().out
    assert "step-time breakdown (rank 0, mean of 2 batches)" in printed and "backward + rest" in printed


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
