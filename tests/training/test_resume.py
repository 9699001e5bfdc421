"""Resume exactness: a run interrupted after a checkpoint and resumed ends with the same weights as one that wasn't."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from interrupts import stop_after_checkpoint
from ranks import run_on_ranks
from safetensors.torch import load_file
from tiny_models import tiny_clip_run

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


def _with_attention_dropout(raw: dict, p: float = 0.1) -> dict:
    """CLIP's towers ignore `dropout`; attention dropout is what draws random numbers during a tiny CLIP step, so it is
    what makes a resumed run depend on the RNG state being restored exactly."""
    config = raw["model_config"]
    towers = {tower: {**config[tower], "attention_dropout": p} for tower in ("text_config", "vision_config")}
    return dict(raw, model_config={**config, **towers})


@pytest.fixture(scope="module")
def dropout_reference(dummy_data_dir, tmp_path_factory) -> tuple[dict, dict]:
    """An 11-step tiny-CLIP run with attention dropout (8 steps per epoch, validation at each epoch end), trained
    once without interruption: its recipe and final weights."""
    out = tmp_path_factory.mktemp("reference") / "run"
    data = {split: str(dummy_data_dir / f"{split}.jsonl") for split in ("train", "validation", "test")}
    raw = _with_attention_dropout(tiny_clip_run(dummy_data_dir, out, data=data, max_steps=11, epochs=1,
                                                save_total_limit=1))
    _train(raw)
    return raw, _weights(out)


# 8 steps per epoch: mid first epoch, exactly at the epoch boundary, mid second epoch; and with a DataLoader worker.
@pytest.mark.parametrize("interrupt_at, num_workers", [(3, 0), (8, 0), (10, 0), (10, 1)])
def test_resumed_run_ends_with_the_same_weights(dropout_reference, tmp_path, interrupt_at, num_workers):
    """With attention dropout on: starting a DataLoader iterator used to draw the workers' seed from the global RNG,
    and the resumed run starts one more (to skip the trained batches) after restoring it, which shifted every dropout
    mask after the resume (final weights 6e-3 apart). Workers (`num_workers` is not part of the run's identity) load
    what the main process loads."""
    reference_raw, expected = dropout_reference
    raw = dict(reference_raw, save_steps=interrupt_at, data=dict(reference_raw["data"], num_workers=num_workers))

    # Kill the second run right after its checkpoint at `interrupt_at` is on disk.
    interrupted_dir = tmp_path / "interrupted"
    stop_after_checkpoint(lambda: _train(dict(raw, output_dir=str(interrupted_dir))), interrupt_at)
    assert (interrupted_dir / f"checkpoint-{interrupt_at}" / "trainer_state.json").is_file()
    assert not (interrupted_dir / "final").exists()

    resumed = _train(dict(raw, output_dir=str(interrupted_dir), resume_from="auto"))
    assert resumed.steps_per_epoch < 10, "the test must cross an epoch boundary"

    actual = _weights(interrupted_dir)
    assert expected.keys() == actual.keys()
    for key, value in expected.items():
        assert (value - actual[key]).abs().max().item() == 0.0, key
    history = json.loads((interrupted_dir / "metrics.json").read_text())["loss_history"]
    assert [h["step"] for h in history] == list(range(1, 12))


def _resume_on_two_ranks_worker(raw_path: str) -> None:
    """On each rank: the uninterrupted run, the run stopped after its checkpoint at step 2, and its resumption."""
    raw = json.loads(Path(raw_path).read_text())
    _train(dict(raw, output_dir=raw["output_dir"] + "/reference"))
    stop_after_checkpoint(lambda: _train(dict(raw, output_dir=raw["output_dir"] + "/interrupted")), 2)
    trainer = _train(dict(raw, output_dir=raw["output_dir"] + "/interrupted", resume_from="auto"))
    assert trainer.accelerator.num_processes == 2


@pytest.mark.slow
def test_two_ranks_resume_with_dropout_to_the_same_weights(tiny_clip_recipe, tmp_path):
    """Each rank restores its own RNG state (and starts its DataLoader iterators from the loader's own generator), so
    a 2-rank run with attention dropout resumed at step 2 of 4 ends where the uninterrupted one does."""
    raw = _with_attention_dropout(dict(tiny_clip_recipe, data={"train": tiny_clip_recipe["data"]["train"]},
                                       max_steps=4, save_steps=2, output_dir=str(tmp_path)))
    (tmp_path / "raw.json").write_text(json.dumps(raw))
    run_on_ranks(_resume_on_two_ranks_worker, str(tmp_path / "raw.json"), world=2)
    expected, actual = _weights(tmp_path / "reference"), _weights(tmp_path / "interrupted")
    assert expected.keys() == actual.keys()
    difference = max((value - actual[key]).abs().max().item() for key, value in expected.items())
    print(f"2 ranks, attention dropout: resumed vs uninterrupted, max weight difference {difference:.1e}")
    assert difference <= 1e-6


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


def test_measuring_the_mfu_ceiling_draws_nothing_from_the_global_rng(monkeypatch):
    """The ceiling is measured when no cache has it, or again when a log line beats it (timing): its random matrices
    must not come from the generator dropout draws from, or a run's masks, and resume, would depend on when."""
    import torch

    from vembed.training import throughput

    monkeypatch.setitem(throughput._CEILING_SIZE, "cpu", 64)
    before = torch.get_rng_state()
    throughput._time_matmul(torch.device("cpu"), torch.float32, repeats=1)
    assert torch.equal(torch.get_rng_state(), before)
