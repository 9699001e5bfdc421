"""Resume exactness: a run interrupted after a checkpoint and resumed ends with the same weights as one that wasn't."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from interrupts import stop_after_checkpoint
from safetensors.torch import load_file

from vembed.components import recipe_from_dict
from vembed.training import checkpoint as checkpoint_module
from vembed.training.loop import Trainer


def _weights(run_dir: Path) -> dict:
    found = sorted(Path(run_dir, "final").rglob("*.safetensors"))
    assert found, f"no safetensors under {run_dir}/final"
    merged = {}
    for file in found:
        merged.update({f"{file.relative_to(run_dir)}:{k}": v for k, v in load_file(str(file)).items()})
    return merged


def _train(raw: dict) -> Trainer:
    trainer = Trainer(recipe_from_dict(raw))
    trainer.run()
    return trainer


# 8 steps per epoch: mid first epoch, exactly at the epoch boundary, mid second epoch.
@pytest.mark.parametrize("interrupt_at", [3, 8, 10])
def test_resumed_run_ends_with_the_same_weights(tiny_clip_recipe, tmp_path, monkeypatch, interrupt_at):
    raw = dict(tiny_clip_recipe, max_steps=11, save_steps=interrupt_at, save_total_limit=1, epochs=1)
    reference = _train(dict(raw, output_dir=str(tmp_path / "reference")))
    assert reference.steps_per_epoch < 10, "the test must cross an epoch boundary"

    # Kill the second run right after its checkpoint at `interrupt_at` is on disk.
    interrupted_dir = tmp_path / "interrupted"
    stop_after_checkpoint(lambda: _train(dict(raw, output_dir=str(interrupted_dir))), interrupt_at)
    assert (interrupted_dir / f"checkpoint-{interrupt_at}" / "trainer_state.json").is_file()
    assert not (interrupted_dir / "final").exists()

    resumed = _train(dict(raw, output_dir=str(interrupted_dir), resume_from="auto"))
    assert resumed.total_steps == reference.total_steps

    expected, actual = _weights(tmp_path / "reference"), _weights(interrupted_dir)
    assert expected.keys() == actual.keys()
    for key, value in expected.items():
        assert (value - actual[key]).abs().max().item() == 0.0, key
    history = json.loads((interrupted_dir / "metrics.json").read_text())["loss_history"]
    assert [h["step"] for h in history] == list(range(1, 12))


def test_checkpoints_are_rotated_and_half_written_ones_ignored(tiny_clip_recipe, tmp_path):
    data = dict(tiny_clip_recipe["data"], validation=None)  # no validation: no best checkpoint to protect
    raw = dict(tiny_clip_recipe, data=data, max_steps=6, save_steps=2, save_total_limit=1)
    _train(raw)
    run = Path(raw["output_dir"])
    names = sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint-"))
    assert names == ["checkpoint-4"]  # saved at 2 and 4 (6 is the end: final/ instead); only the last is kept
    assert not list(run.glob(".tmp-*"))
    # A half-written checkpoint (no trainer_state.json) is never picked by resume_from: auto.
    (run / "checkpoint-99").mkdir()
    assert checkpoint_module.resolve_resume("auto", run).name != "checkpoint-99"


def test_resume_from_a_path_that_is_not_a_checkpoint_is_a_checkpoint_error(tmp_path):
    from vembed.errors import CheckpointError

    with pytest.raises(CheckpointError, match="resume_from.*manifest.json is missing"):
        checkpoint_module.resolve_resume(str(tmp_path), tmp_path)
    with pytest.raises(CheckpointError, match="is not a folder"):
        checkpoint_module.resolve_resume(str(tmp_path / "nowhere"), tmp_path)
