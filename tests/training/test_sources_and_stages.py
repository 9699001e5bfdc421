"""Named sources mixed in one run (one source per step, losses and metrics per source) and curriculum stages (own
data mix, max_length, steps and learning rate), through the real loop; resuming either mid-way is exact."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from interrupts import stop_after_checkpoint
from safetensors.torch import load_file

from vembed.components import recipe_from_dict
from vembed.training.loop import Trainer


def _sources(recipe: dict, **extra) -> dict:
    """The dummy shapes as two named sources: `shapes` (2 hard negatives per record) and `plain` (the same rows,
    no negatives, a query prompt), 68 records each: 8 batches of 8 per source and epoch."""
    train = recipe["data"]["train"]
    plain = {"files": train, "num_hard_negatives": 0, "query_prompt": "a photo: "}
    data = {**recipe["data"], "train": {"shapes": train, "plain": plain},
            "validation": {"shapes": recipe["data"]["validation"], "plain": recipe["data"]["validation"]},
            "test": None}
    return dict(recipe, data=data, **extra)


STAGES = [
    {"name": "warm-up", "sources": ["shapes"], "epochs": 1, "learning_rate": 1e-3, "max_length": 8},
    {"name": "mix", "sources": {"shapes": 1, "plain": 3}, "max_steps": 6, "learning_rate": 5e-4},
]


def _run(raw: dict) -> Trainer:
    trainer = Trainer(recipe_from_dict(raw))
    trainer.run()
    return trainer


def test_each_batch_comes_from_one_source_and_losses_and_metrics_are_per_source(tiny_clip_recipe):
    raw = _sources(tiny_clip_recipe, max_steps=12, logging_steps=4, eval_before_training=True)
    trainer = Trainer(recipe_from_dict(raw))
    trainer.build()
    trainer.loader.set_epoch(0)
    seen = {}
    for batch in trainer.loader:
        seen.setdefault(batch["source"], []).append(batch["num_negatives"])
    assert seen == {"shapes": [2] * 8, "plain": [0] * 8}  # by size: every record once; each source its own k
    first = trainer.dataset[0]
    plain = trainer.dataset[trainer.dataset.source_ranges()[1][1]]
    assert plain.query.text == "a photo: " + first.query.text  # the source's prompt

    result = Trainer(recipe_from_dict(raw)).run().metrics
    logged = [set(entry) for entry in result["loss_history"]]
    assert all({"loss/shapes", "loss/plain"} <= keys for keys in logged), logged
    validation = result["validation"]
    for key in ("q2d/accuracy@1", "d2q/mrr"):
        mean = (validation[f"shapes/{key}"] + validation[f"plain/{key}"]) / 2
        assert validation[key] == pytest.approx(mean)
    assert result["train"]["data"]["sources"]["plain"]["num_hard_negatives"] == 0


def test_stages_run_their_own_sources_inputs_and_learning_rate(tiny_clip_recipe):
    raw = _sources(tiny_clip_recipe, stages=STAGES, logging_steps=1, scheduler_type="linear", warmup_ratio=0.25,
                   save_steps=None)
    trainer = Trainer(recipe_from_dict(raw))
    sources_by_stage, lengths = [], []
    original = trainer.task.train_dataset

    def recording_collate(objective):
        dataset, collate = original(objective)

        def recording(examples):
            batch = collate(examples)
            lengths.append(objective.adapter.settings.max_length)
            sources_by_stage.append(batch["source"])
            return batch

        return dataset, recording

    trainer.task.train_dataset = recording_collate
    result = trainer.run().metrics
    warm, mix = trainer.stages
    assert (warm.first_step, warm.total_steps, mix.first_step, mix.total_steps) == (0, 8, 8, 6)
    assert trainer.total_steps == 14
    assert sources_by_stage[:8] == ["shapes"] * 8 and lengths[:8] == [8] * 8
    # (accelerate's loader collates one batch ahead: the 15th is the prefetched one)
    assert sorted(sources_by_stage[8:14]) == ["plain"] * 4 + ["shapes"] * 2  # 6 steps split 1:3, largest remainder
    assert lengths[8:14] == [32] * 6  # back to the model's own limit (the tiny CLIP's 32 positions)

    # Each stage: linear warm-up over a quarter of its steps to its peak, then linear decay to 0.
    def expected(step: int) -> float:  # the learning rate in effect for optimizer step `step` (1-based)
        stage_first, total, peak = (0, 8, 1e-3) if step <= 8 else (8, 6, 5e-4)
        local, warmup = step - 1 - stage_first, int(0.25 * total)
        factor = local / warmup if local < warmup else max(0.0, (total - local) / (total - warmup))
        return peak * factor

    logged = {entry["step"]: entry["lr"] for entry in result["loss_history"]}
    # the log after step s shows the rate of step s + 1 (the scheduler has stepped)
    for step in range(1, 14):
        assert logged[step] == pytest.approx(expected(step + 1), abs=1e-12), step
    assert result["train"]["epochs_completed"] == 1  # the warm-up epoch; the mix stopped mid-epoch at its 6 steps


def _weights(run_dir: Path) -> dict:
    found = sorted(Path(run_dir, "final").rglob("*.safetensors"))
    return {f"{file.name}:{key}": value for file in found for key, value in load_file(str(file)).items()}


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """The uninterrupted run of the resume tests, trained once for all of them."""
    runs = {}

    def run(raw: dict) -> Path:
        key = json.dumps({k: v for k, v in raw.items() if k != "output_dir"}, sort_keys=True)
        if key not in runs:
            output = tmp_path_factory.mktemp("reference") / "run"
            _run(dict(raw, output_dir=str(output)))
            runs[key] = output
        return runs[key]

    return run


# 8 steps in the first stage (one source), 6 in the second (two sources, no duplicates in a batch): mid first stage,
# at the boundary, and mid second stage (mid-epoch).
@pytest.mark.parametrize("interrupt_at", [3, 8, 11])
def test_resume_mid_stage_with_mixed_sources_ends_with_the_same_weights(tiny_clip_recipe, tmp_path, monkeypatch,
                                                                         reference_run, interrupt_at):
    raw = _sources(tiny_clip_recipe, stages=STAGES, save_total_limit=1, eval_before_training=False)
    raw["data"] = {**raw["data"], "validation": None, "no_duplicates": True}
    reference = reference_run(dict(raw, save_steps=100))
    raw = dict(raw, save_steps=interrupt_at)

    interrupted = tmp_path / "interrupted"
    stop_after_checkpoint(lambda: _run(dict(raw, output_dir=str(interrupted))), interrupt_at)
    state = json.loads((interrupted / f"checkpoint-{interrupt_at}" / "trainer_state.json").read_text())
    assert state["stage"] == (0 if interrupt_at <= 8 else 1)

    _run(dict(raw, output_dir=str(interrupted), resume_from="auto"))
    expected, actual = _weights(reference), _weights(interrupted)
    assert expected.keys() == actual.keys() and expected
    for key, value in expected.items():
        assert (value - actual[key]).abs().max().item() == 0.0, key
    history = json.loads((interrupted / "metrics.json").read_text())["loss_history"]
    assert [entry["step"] for entry in history] == list(range(1, 15))
    assert math.isfinite(history[-1]["loss"])


def test_the_shipped_mixed_sources_recipe_trains_offline(tmp_path, monkeypatch):
    """configs/mixed_sources.yaml, with the data its header's commands make, trains and reports per source."""
    from vembed.components import load_recipe
    from vembed.data.synthetic import make_digits_dataset, make_dummy_dataset
    from vembed.recipe_checks import check_recipe

    config = Path(__file__).resolve().parents[2] / "configs" / "mixed_sources.yaml"
    monkeypatch.chdir(tmp_path)
    make_digits_dataset("runs/mixed/digits")
    make_dummy_dataset("runs/mixed/shapes", 200, seed=0, image_size=32)
    recipe = load_recipe(config, ["max_steps=6", "logging_steps=3", "batch_size=16", "eval_before_training=false"])
    check_recipe(recipe)
    result = Trainer(recipe).run().metrics
    assert {"loss/digits", "loss/shapes"} <= set(result["loss_history"][-1]) | set(result["loss_history"][0])
    assert {"digits/q2d/accuracy@1", "shapes/q2d/accuracy@1", "q2d/accuracy@1"} <= set(result["validation"])
    assert result["train"]["data"]["sources"]["shapes"]["num_hard_negatives"] == 1


def _rank_batches(raw: dict, out_dir: str) -> None:
    """One rank: the index batches its sharded loader yields for epoch 1, then a short run (per-source losses are
    reduced across ranks in the log)."""
    import torch.distributed as dist

    trainer = Trainer(recipe_from_dict(raw))
    trainer.build()
    trainer.loader.set_epoch(1)
    trainer.stages[0].batch_sampler.set_epoch(1)
    batches = [list(batch) for batch in trainer.loader.batch_sampler]
    ranges = trainer.dataset.source_ranges()
    result = Trainer(recipe_from_dict(raw)).run().metrics
    record = {"batches": batches, "ranges": ranges, "history": result["loss_history"]}
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(record))


@pytest.mark.slow
def test_two_ranks_draw_the_same_source_each_step_with_disjoint_rows(tiny_clip_recipe, tmp_path):
    from ranks import run_on_ranks

    raw = _sources(tiny_clip_recipe, max_steps=4, logging_steps=2, eval_before_training=False, batch_size=4)
    raw["data"] = {**raw["data"], "validation": None}
    run_on_ranks(_rank_batches, raw, str(tmp_path), world=2)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    ranges = ranks[0]["ranges"]

    def source(index: int) -> str:
        return next(name for name, start, stop in ranges if start <= index < stop)

    assert len(ranks[0]["batches"]) == len(ranks[1]["batches"]) == 8 + 8  # 68 records / (4 x 2) per source
    for mine, theirs in zip(ranks[0]["batches"], ranks[1]["batches"]):
        assert len({source(i) for i in mine + theirs}) == 1  # one source per step, on both ranks
        assert not set(mine) & set(theirs)
    losses = [[{k: v for k, v in entry.items() if k.startswith("loss")} for entry in r["history"]] for r in ranks]
    assert losses[0] == losses[1]  # losses (overall and per source) reduced alike on every rank
    assert {"loss/shapes", "loss/plain"} & set(ranks[0]["history"][-1])
