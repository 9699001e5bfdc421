"""The loop's promises beyond exactness: NaN stops cleanly, checkpoints mirror, text-only data trains CLIP under DDP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ranks import run_on_ranks
from tiny_models import TINY_CLIP_CONFIG

from vembed.components import recipe_from_dict
from vembed.errors import TrainingError
from vembed.tasks.contrastive import ContrastiveObjective
from vembed.training.loop import Trainer


def test_nan_loss_stops_at_once_keeping_the_last_good_checkpoint(tiny_clip_recipe, monkeypatch):
    raw = dict(tiny_clip_recipe, max_steps=8, save_steps=2)
    original = ContrastiveObjective.forward
    calls = {"n": 0}

    def forward_turning_nan(self, batch):
        calls["n"] += 1
        loss = original(self, batch)
        return loss * float("nan") if calls["n"] == 5 else loss

    monkeypatch.setattr(ContrastiveObjective, "forward", forward_turning_nan)
    trainer = Trainer(recipe_from_dict(raw))
    with pytest.raises(TrainingError, match="NaN/Inf at step 5") as info:
        trainer.run()
    assert "checkpoint-4" in str(info.value)
    run = Path(raw["output_dir"])
    assert (run / "checkpoint-4" / "trainer_state.json").is_file()
    assert not (run / "final").exists()
    # The weights were not touched by the bad step.
    for name, param in trainer.accelerator.unwrap_model(trainer.model).named_parameters():
        assert torch.isfinite(param).all(), name


def test_checkpoints_are_mirrored_to_persistent_dir(tiny_clip_recipe, tmp_path):
    raw = dict(tiny_clip_recipe, max_steps=4, save_steps=2, persistent_dir=str(tmp_path / "persistent"))
    Trainer(recipe_from_dict(raw)).run()
    mirrored = tmp_path / "persistent" / "checkpoint-2"
    assert (mirrored / "trainer_state.json").is_file()
    original = Path(raw["output_dir"]) / "checkpoint-2"
    assert sorted(p.name for p in mirrored.iterdir()) == sorted(p.name for p in original.iterdir())


def test_gradient_accumulation_steps_once_on_the_average_of_the_batches_gradients(tiny_clip_recipe):
    """Two accumulated batches of 4: the optimizer steps once, after the second, on the mean of the two batches' own
    gradients (computed by hand below). Not the gradient of one batch of 8: a contrastive loss over 8 also scores
    each pair against the other batch's 4, the negatives that accumulation does not add."""
    from accelerate.utils import send_to_device

    from vembed.training.checkpoint import TrainerState

    config = {**TINY_CLIP_CONFIG, **{tower: {**TINY_CLIP_CONFIG[tower], "dropout": 0.0}  # same masks both ways
                                     for tower in ("text_config", "vision_config")}}
    raw = dict(tiny_clip_recipe, model_config=config, batch_size=4, gradient_accumulation_steps=2,
               learnable_temperature=True, max_grad_norm=None)  # clipping would rescale what the step sees
    trainer = Trainer(recipe_from_dict(raw))
    trainer.build()
    batches = [send_to_device(trainer.loader.collate_fn([trainer.dataset[i] for i in rows]),
                              trainer.accelerator.device) for rows in (range(0, 4), range(4, 8))]
    parameters = dict(trainer.objective.named_parameters())

    by_hand = []
    for batch in batches:
        trainer.objective.zero_grad(set_to_none=True)
        trainer.objective(batch).backward()
        by_hand.append({n: p.grad.clone() for n, p in parameters.items() if p.grad is not None})
    trainer.objective.zero_grad(set_to_none=True)
    expected = {n: (by_hand[0][n] + by_hand[1][n]) / 2 for n in by_hand[0]}

    stepped_on = []
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    optimizer.register_step_pre_hook(lambda *_: stepped_on.append(
        {n: p.grad.clone() for n, p in parameters.items() if p.grad is not None}))
    initial = {n: p.detach().clone() for n, p in parameters.items()}
    state = TrainerState()
    trainer.train_on_batch(batches[0], state)
    assert stepped_on == [] and all(torch.equal(initial[n], p) for n, p in parameters.items())
    trainer.train_on_batch(batches[1], state)
    assert len(stepped_on) == 1
    assert stepped_on[0].keys() == expected.keys() and any(n.startswith("loss.") for n in expected)
    reference = torch.cat([g.flatten() for g in expected.values()])
    actual = torch.cat([stepped_on[0][n].flatten() for n in expected])
    assert ((actual - reference).norm() / reference.norm()).item() <= 1e-6
    assert not all(torch.equal(initial[n], p) for n, p in parameters.items())  # and then it stepped


def test_collation_in_worker_processes_trains_exactly_as_in_process(tiny_clip_recipe, tmp_path):
    """`data.num_workers > 0` moves collation (the adapter's preprocess) into DataLoader workers, across epochs
    (persistent workers keep the per-epoch shuffle); the batches, hence the losses, are the same."""
    histories = []
    for workers in (0, 1):
        raw = dict(tiny_clip_recipe, epochs=2, logging_steps=1, output_dir=str(tmp_path / f"workers{workers}"),
                   data=dict(tiny_clip_recipe["data"], num_workers=workers))
        result = Trainer(recipe_from_dict(raw)).run()
        histories.append([record["loss"] for record in result.metrics["loss_history"]])
    assert len(histories[0]) >= 4
    assert histories[1] == pytest.approx(histories[0], abs=1e-6)


def _text_only_clip_worker(raw_path: str) -> None:
    raw = json.loads(Path(raw_path).read_text())
    trainer = Trainer(recipe_from_dict(raw))
    assert trainer.accelerator.num_processes == 2
    trainer.run()


def test_clip_trains_on_text_only_pairs_under_ddp(tiny_clip_recipe, tmp_path):
    # No images at all: CLIP's vision tower gets no gradient, which plain DDP refuses unless told to expect it.
    rows = [{"query": f"a photo of a red square number {i}", "positive": f"a red square {i}"} for i in range(40)]
    data = tmp_path / "text.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    raw = dict(tiny_clip_recipe, data={"train": str(data)}, max_steps=2, save_steps=None)
    raw_path = tmp_path / "raw.json"
    raw_path.write_text(json.dumps(raw))
    run_on_ranks(_text_only_clip_worker, str(raw_path), world=2)
    assert json.loads((Path(raw["output_dir"]) / "metrics.json").read_text())["train"]["world_size"] == 2


def test_lora_with_gradient_checkpointing_trains_only_adapters_and_saves_merged(tiny_clip_recipe):
    from safetensors.torch import load_file

    raw = dict(tiny_clip_recipe, use_lora=True, lora_r=4, gradient_checkpointing=True, max_steps=3,
               learnable_temperature=True)
    trainer = Trainer(recipe_from_dict(raw))
    trainer.build()
    before = {n: p.detach().clone() for n, p in trainer.objective.named_parameters()}
    trainer = Trainer(recipe_from_dict(raw))
    result = trainer.run()
    after = dict(trainer.objective.named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n].detach())}
    assert changed and all("lora_" in n or n.startswith("loss.") for n in changed), sorted(changed)
    saved = load_file(str(result.final_model_dir / "model.safetensors"))
    assert not any("lora" in k for k in saved)  # merged: a plain CLIPModel state dict


def _bf16_worker(raw_path: str) -> None:
    raw = json.loads(Path(raw_path).read_text())
    trainer = Trainer(recipe_from_dict(raw))
    assert trainer.accelerator.mixed_precision == "bf16"
    trainer.run()


def test_bf16_autocast_trains(tiny_clip_recipe, tmp_path):
    # Its own process: accelerate fixes the precision once per process, and other tests here made an fp32 one.
    raw = dict(tiny_clip_recipe, mixed_precision="bf16", max_steps=3)
    raw_path = tmp_path / "raw.json"
    raw_path.write_text(json.dumps(raw))
    run_on_ranks(_bf16_worker, str(raw_path), world=1)
    history = json.loads((Path(raw["output_dir"]) / "metrics.json").read_text())["loss_history"]
    assert len(history) == 3 and all(torch.isfinite(torch.tensor(h["loss"])) for h in history)


def test_wandb_tracker_works_offline(tiny_clip_recipe, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    (tmp_path / "wandb").mkdir()
    trainer = Trainer(recipe_from_dict(dict(tiny_clip_recipe, max_steps=2, report_to=["wandb"], run_name="offline")))
    try:
        trainer.run()
    finally:
        trainer.accelerator.end_training()
    runs = list((tmp_path / "wandb").rglob("offline-run-*"))
    assert runs, "wandb wrote no offline run"
    assert list(runs[0].rglob("*.wandb")), "the offline run holds no history"


def test_optimizer_is_fused_adamw_where_the_device_has_the_kernel():
    from vembed.training.loop import build_optimizer

    cpu = build_optimizer([{"params": [torch.nn.Parameter(torch.ones(3))], "weight_decay": 0.0}], lr=1e-3)
    assert isinstance(cpu, torch.optim.AdamW) and cpu.defaults["fused"] is True
    meta = build_optimizer([{"params": [torch.nn.Parameter(torch.ones(3, device="meta"))]}], lr=1e-3)
    assert isinstance(meta, torch.optim.AdamW) and not meta.defaults["fused"]


def _schedule_worker(raw_path: str, out_path: str) -> None:
    """On each rank: train the recipes listed in raw_path; rank 0 writes what each run reports."""
    import torch.distributed as dist

    results = []
    for raw in json.loads(Path(raw_path).read_text()):
        trainer = Trainer(recipe_from_dict(raw))
        assert trainer.accelerator.num_processes == 2
        result = trainer.run()
        results.append({"total_steps": trainer.total_steps, "steps": result.state.global_step,
                        "epochs_completed": result.metrics["train"]["epochs_completed"],
                        "last_logged": (result.state.loss_history or [None])[-1],
                        "lr_now": trainer.scheduler.get_last_lr()[0]})
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results))


@pytest.mark.slow
def test_two_ranks_take_every_step_asked_for_and_end_the_schedule(tiny_clip_recipe, tmp_path):
    """The schedule counts the batches each rank really iterates (accelerate shards a drop_last loader into whole
    rounds: 17 batches on 2 ranks are 8 each, not 9), so max_steps and epochs are honoured exactly and a decaying
    schedule ends at 0, whether or not the batch count divides by the world size."""
    runs = [  # (per-device batch, max_steps, epochs, schedule): 68 training rows
        (4, 18, None, "linear"),  # 17 batches: odd; the old count planned 9 per epoch and stopped at 16 of 18
        (4, None, 2, "cosine"),  # 2 epochs of 8 steps each
        (2, None, 1, "linear"),  # 34 batches: even
    ]
    raws = []
    for i, (batch, max_steps, epochs, schedule) in enumerate(runs):
        raws.append(dict(tiny_clip_recipe, batch_size=batch, max_steps=max_steps, epochs=epochs or 1,
                         scheduler_type=schedule, warmup_ratio=0.1, logging_steps=1000, save_steps=None,
                         output_dir=str(tmp_path / f"run{i}"), data={"train": tiny_clip_recipe["data"]["train"]}))
    (tmp_path / "raws.json").write_text(json.dumps(raws))
    run_on_ranks(_schedule_worker, str(tmp_path / "raws.json"), str(tmp_path / "results.json"), world=2)
    results = json.loads((tmp_path / "results.json").read_text())
    rows = len(Path(tiny_clip_recipe["data"]["train"]).read_text().splitlines())
    for (batch, max_steps, epochs, _), result in zip(runs, results):
        per_rank = (rows // batch) // 2
        expected = max_steps or per_rank * epochs
        assert result["total_steps"] == result["steps"] == expected, result
        assert result["last_logged"] is not None, result  # the last step is logged whatever logging_steps says
        assert result["last_logged"]["step"] == expected
        assert result["last_logged"]["lr"] == result["lr_now"] == 0.0  # the schedule ran to its end
        if epochs:
            assert result["epochs_completed"] == epochs


def test_an_infinite_loss_with_finite_gradients_stops_the_run(tiny_clip_recipe, monkeypatch):
    """Adding a constant infinity leaves every gradient finite: the gradient-norm guard alone let the run finish with
    inf in its loss history."""
    raw = dict(tiny_clip_recipe, max_steps=6, save_steps=2)
    original = ContrastiveObjective.forward
    calls = {"n": 0}

    def forward_with_infinite_loss(self, batch):
        calls["n"] += 1
        loss = original(self, batch)
        return loss + float("inf") if calls["n"] == 3 else loss

    monkeypatch.setattr(ContrastiveObjective, "forward", forward_with_infinite_loss)
    trainer = Trainer(recipe_from_dict(raw))
    with pytest.raises(TrainingError, match="the loss became NaN/Inf at step 3") as info:
        trainer.run()
    assert str(Path(raw["output_dir"]) / "checkpoint-2") in str(info.value)
    assert not (Path(raw["output_dir"]) / "final").exists()
    for name, param in trainer.objective.named_parameters():
        assert torch.isfinite(param).all(), name


def _with_corrupt_images(dummy_data_dir: Path, tmp_path: Path, every: int) -> Path:
    """The dummy training rows with every `every`-th positive image replaced by a file that does not decode (it
    exists, so reading the data file keeps the row: only training finds out)."""
    rows = [json.loads(line) for line in (dummy_data_dir / "train.jsonl").read_text().splitlines()]
    for i, row in enumerate(rows):
        row["positive_image"] = str(dummy_data_dir / row["positive_image"])
        if i % every == 0:
            bad = tmp_path / f"corrupt{i}.png"
            bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 20)
            row["positive_image"] = str(bad)
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_images_that_fail_to_decode_in_training_count_against_max_bad_fraction(tiny_clip_recipe, dummy_data_dir,
                                                                                tmp_path):
    """A quarter of the images corrupt used to train to the end (exit 0): they were replaced and counted, and the
    count from DataLoader workers was always 0. Now the run stops, in a worker-fed run, once the share is clearly
    above data.max_bad_fraction."""
    from vembed.errors import DataError

    train = _with_corrupt_images(dummy_data_dir, tmp_path, every=4)
    # Without the image cache the share is only known from the batches (with it: the next test).
    raw = dict(tiny_clip_recipe, data={"train": str(train), "num_workers": 1, "image_cache": False}, max_steps=8,
               save_steps=None)
    with pytest.raises(DataError, match=r"had images that would not decode .* > data.max_bad_fraction=0.05") as info:
        Trainer(recipe_from_dict(raw)).run()
    assert "corrupt" in str(info.value) and "\n" not in str(info.value)
    assert not (Path(raw["output_dir"]) / "final").exists()


def test_with_the_image_cache_too_many_undecodable_images_stop_the_run_before_step_1(tiny_clip_recipe,
                                                                                      dummy_data_dir, tmp_path,
                                                                                      monkeypatch):
    """Building the cache decodes every image, so the exact share is known before training: refused there."""
    from vembed.errors import DataError

    def no_step(*args, **kwargs):
        raise AssertionError("a training step was set up before the refusal")

    monkeypatch.setattr("vembed.training.grad_cache.build_train_step", no_step)
    train = _with_corrupt_images(dummy_data_dir, tmp_path, every=4)  # rows 1, 5, 9, ...: 17 of 68
    raw = dict(tiny_clip_recipe, data={"train": str(train), "image_cache_dir": str(tmp_path / "cache")},
               max_steps=8, save_steps=None)
    with pytest.raises(DataError, match=r"train.jsonl, row 1: 17 of 68 training records have images that do not "
                                        r"decode .* 25% of data.train is unusable > data.max_bad_fraction=0.05\); "
                                        r"this row: .*corrupt0.png") as info:
        Trainer(recipe_from_dict(raw)).run()
    assert "\n" not in str(info.value)


def test_a_few_undecodable_images_below_max_bad_fraction_do_not_stop_the_run(tiny_clip_recipe, dummy_data_dir,
                                                                             tmp_path):
    train = _with_corrupt_images(dummy_data_dir, tmp_path, every=40)  # 2 of 68 rows: 3% < 5%
    raw = dict(tiny_clip_recipe, data={"train": str(train), "num_workers": 1}, epochs=2, save_steps=None)
    result = Trainer(recipe_from_dict(raw)).run()
    assert result.metrics["train"]["decode_failures"] >= 1


def _infinite_loss_on_one_rank_worker(raw_path: str, out_dir: str) -> None:
    import torch.distributed as dist

    raw = json.loads(Path(raw_path).read_text())
    original = ContrastiveObjective.forward
    calls = {"n": 0}

    def forward(self, batch):  # only rank 1's loss turns infinite; gradients stay finite everywhere
        calls["n"] += 1
        loss = original(self, batch)
        return loss + float("inf") if calls["n"] == 2 and dist.get_rank() == 1 else loss

    ContrastiveObjective.forward = forward
    try:
        Trainer(recipe_from_dict(raw)).run()
        outcome = "finished"
    except TrainingError as error:
        outcome = str(error)
    Path(out_dir, f"rank{dist.get_rank()}.txt").write_text(outcome)


@pytest.mark.slow
def test_an_infinite_loss_on_one_rank_stops_every_rank_at_the_same_step(tiny_clip_recipe, tmp_path):
    """Losses are per rank: without summing the flag over ranks, rank 1 would stop alone and rank 0 wait forever."""
    raw = dict(tiny_clip_recipe, max_steps=4, save_steps=None, data={"train": tiny_clip_recipe["data"]["train"]})
    (tmp_path / "raw.json").write_text(json.dumps(raw))
    run_on_ranks(_infinite_loss_on_one_rank_worker, str(tmp_path / "raw.json"), str(tmp_path), world=2, timeout=120)
    for rank in (0, 1):
        assert "the loss became NaN/Inf at step 2" in (tmp_path / f"rank{rank}.txt").read_text()


# --- pinned figures --------------------------------------------------------------------------------------------------
# The tests above compare two ways of computing one thing (A == B); a change that moves both sides alike (the loss, the
# schedule, the optimizer, how randomness is drawn, the data order, the metrics) passes them all. These are the figures
# of one small run, pinned, as torchtune's recipe tests pin their loss curves.
#
# Re-pinning: when a change moves these figures ON PURPOSE, run
#     pytest tests/training/test_loop.py -k pinned
# copy the `actual` dict the failure prints over PINNED_TINY_CLIP_RUN, and say in the commit message why the figures
# moved (which change, and why the new ones are right). A move nobody can explain is a bug, not a re-pin.
# Pinned on CPU, torch 2.13.0, transformers 5.24, accelerate 1.15 (1 and 2 torch threads agree to ~1e-7).
PINNED_TINY_CLIP_RUN = {
    "loss": [14.461320877075195, 8.754480361938477, 5.240792751312256, 3.638715982437134, 3.582127571105957,
             4.8679704666137695],
    "lr": [0.0009330127018922195, 0.00075, 0.0005, 0.0002500000000000001, 6.698729810778065e-05, 0.0],
    "validation": {
        "q2d/accuracy@1": 0.07142857142857142, "q2d/accuracy@5": 0.42857142857142855,
        "q2d/accuracy@10": 0.9285714285714286,
        "q2d/mrr": 0.24246031746031746, "q2d/ndcg@10": 0.3561594124683013,
        "d2q/accuracy@1": 0.21428571428571427, "d2q/accuracy@5": 0.5, "d2q/accuracy@10": 1.0,
        "d2q/mrr": 0.38202947845804985, "d2q/ndcg@10": 0.41598974098431923,
        "num_queries": 14.0, "num_documents": 14.0,
        # the dummy data's negatives are captions and its positives images: a caption of another colour is always
        # nearer the query caption than its image (the modality gap), so 0.0 is this data's real figure
        "triplet/cosine_accuracy": 0.0,
    },
}


def test_pinned_loss_curve_and_metrics_of_a_tiny_clip_run(tiny_clip_recipe):
    """6 steps of tiny CLIP (seed 0, attention dropout 0.1, cosine schedule) on the dummy data, then the validation
    split: every step's loss and learning rate and every final metric within 1e-4 (relative) of the pinned ones."""
    config = tiny_clip_recipe["model_config"]
    towers = {tower: {**config[tower], "attention_dropout": 0.1} for tower in ("text_config", "vision_config")}
    raw = dict(tiny_clip_recipe, model_config={**config, **towers}, max_steps=6, save_steps=None,
               data=dict(tiny_clip_recipe["data"], test=None))
    metrics = Trainer(recipe_from_dict(raw)).run().metrics
    actual = {"loss": [record["loss"] for record in metrics["loss_history"]],
              "lr": [record["lr"] for record in metrics["loss_history"]],
              "validation": metrics["validation"]}
    pinned, message = PINNED_TINY_CLIP_RUN, f"actual = {actual!r}"
    assert actual["validation"].keys() == pinned["validation"].keys(), message
    for part in ("loss", "lr", "validation"):
        assert actual[part] == pytest.approx(pinned[part], rel=1e-4, abs=1e-9), message


def test_the_old_name_of_accuracy_at_k_picks_the_best_checkpoint_by_the_new_one(tmp_path, tiny_tokenizer_dir, caplog):
    """`q2d/recall@1` (the pair hit rate's name before it became accuracy@1) still names the metric, with one note."""
    import logging

    from corpora import make_corpus_folder, text_model_keys, write_pairs

    pairs = str(write_pairs(make_corpus_folder(tmp_path / "corpus"), tmp_path / "pairs.jsonl"))
    raw = {**text_model_keys(tiny_tokenizer_dir), "data": {"train": pairs, "validation": pairs},
           "output_dir": str(tmp_path / "run"), "batch_size": 4, "max_steps": 4, "eval_steps": 2, "save_steps": 2,
           "learning_rate": 1e-3, "seed": 0, "metric_for_best_model": "q2d/recall@1"}
    with caplog.at_level(logging.WARNING):
        metrics = Trainer(recipe_from_dict(raw)).run().metrics
    notes = [record.getMessage() for record in caplog.records if "q2d/recall@1" in record.getMessage()]
    assert len(notes) == 1 and "now named q2d/accuracy@1" in notes[0]
    assert metrics["best"]["metric"] == "q2d/accuracy@1"
    assert metrics["best"]["value"] == max(entry["q2d/accuracy@1"] for entry in metrics["eval_history"])
