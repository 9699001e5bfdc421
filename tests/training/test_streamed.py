"""Streamed training (vembed/training/streamed.py): a run killed mid-epoch and resumed ends with the same weights as
one that was not, with and without DataLoader workers, for tar shards and JSONL files; on 2 ranks the streams are
disjoint, deterministic, and stop together even when one rank runs short."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("webdataset")  # the streaming extra (in dev)

from interrupts import stop_after_checkpoint
from ranks import run_on_ranks  # noqa: E402
from streams import jsonl_shards, png_bytes, tar_shards, write_tar

from vembed.components import recipe_from_dict
from vembed.training.loop import Trainer


def _weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    found = sorted(Path(run_dir, "final").rglob("*.safetensors"))
    assert found
    return {f"{f.name}:{k}": v for f in found for k, v in load_file(str(f)).items()}


def _train(raw: dict) -> Trainer:
    trainer = Trainer(recipe_from_dict(raw))
    trainer.run()
    return trainer


def _streamed_recipe(tiny_clip_recipe: dict, train: str, workers: int) -> dict:
    data = dict(tiny_clip_recipe["data"], train=train, num_workers=workers, shuffle_buffer=8, test=None,
                streaming=True)  # chosen by itself for tar shards; JSONL files are read whole unless asked
    return dict(tiny_clip_recipe, data=data, batch_size=4, max_steps=21, save_total_limit=1, logging_steps=1)


# 68 samples in 7 shards of <= 10, batches of 4: 17 batches per epoch with one reader (16 with two, each batching its
# own shards). Interrupts: after an odd number of batches (the next batch is the other worker's) and mid second epoch;
# with accumulation over 2 batches, an epoch is 8 optimizer steps.
@pytest.mark.parametrize("kind, workers, accumulation, interrupts", [
    ("tar", 0, 1, (5,)),
    ("tar", 2, 1, (5, 19)),
    ("jsonl", 2, 2, (7, 13)),
])
def test_resumed_stream_ends_with_the_same_weights(tiny_clip_recipe, dummy_data_dir, tmp_path, monkeypatch, kind,
                                                   workers, accumulation, interrupts):
    shards = (tar_shards if kind == "tar" else jsonl_shards)(dummy_data_dir, tmp_path / "shards")
    raw = dict(_streamed_recipe(tiny_clip_recipe, shards, workers), gradient_accumulation_steps=accumulation)
    reference = _train(dict(raw, output_dir=str(tmp_path / "reference")))
    assert reference.steps_per_epoch < reference.total_steps, "the test must cross an epoch boundary"

    run = tmp_path / "interrupted"
    for number, step in enumerate(interrupts):
        stop_after_checkpoint(lambda step=step, number=number: _train(
            dict(raw, output_dir=str(run), save_steps=step, resume_from="auto" if number else None)), step)
        saved = json.loads((run / f"checkpoint-{step}" / "trainer_state.json").read_text())["stream"]
        assert saved["ranks"][0]["positions"], "the checkpoint holds the stream position"
    _train(dict(raw, output_dir=str(run), resume_from="auto"))

    expected, actual = _weights(tmp_path / "reference"), _weights(run)
    assert expected.keys() == actual.keys()
    for key, value in expected.items():
        assert (value - actual[key]).abs().max().item() == 0.0, key
    history = json.loads((run / "metrics.json").read_text())["loss_history"]
    assert [h["step"] for h in history] == list(range(1, 22))


def test_resuming_with_other_workers_is_refused_in_one_line(tiny_clip_recipe, dummy_data_dir, tmp_path, monkeypatch):
    from vembed.errors import RecipeError

    raw = dict(_streamed_recipe(tiny_clip_recipe, tar_shards(dummy_data_dir, tmp_path / "shards"), 0),
               max_steps=4, save_steps=2, output_dir=str(tmp_path / "run"))
    stop_after_checkpoint(lambda: _train(raw))
    resumed = dict(raw, data=dict(raw["data"], num_workers=2), resume_from="auto")
    with pytest.raises(RecipeError, match=r"resume_from.*readers per rank .* 1 then, 2 now"):
        _train(resumed)


# --- 2 ranks -------------------------------------------------------------------------------------------------------


def _keys_collate(examples):
    return [f"{Path(e.source).name}:{e.row}" for e in examples]


def _read_two_epochs(shards: str, out: str) -> None:
    """On each rank: the sample keys of every batch of 2 epochs, through the loop's StreamedEpochs."""
    import multiprocessing

    import torch.distributed as dist
    from accelerate import Accelerator

    from vembed.data.stream_samples import SampleDecoder
    from vembed.data.streaming import ShardStream, StreamReport, open_stream
    from vembed.training.streamed import StreamedEpochs

    # DataLoader workers fork, as under torchrun and accelerate launch (run_on_ranks' ranks are spawned, and their
    # children would spawn too: seconds of imports per worker and epoch).
    multiprocessing.set_start_method("fork", force=True)
    recipe = recipe_from_dict({"model_type": "clip", "model_config": {}, "batch_size": 2, "seed": 0,
                               "data": {"train": shards, "num_workers": 2, "shuffle_buffer": 4,
                                        "max_bad_fraction": 0.5}})
    accelerator = Accelerator(cpu=True)

    def read() -> dict:  # from fresh objects: nothing carries over but the seed
        backend, found = open_stream(recipe.data)
        decoder = SampleDecoder(recipe.data.columns.model_dump(), None, 0, 1)
        stream = ShardStream(backend, found, decoder, _keys_collate, batch_size=2, seed=0, shuffle_buffer=4)
        report = StreamReport(split="train", files=stream.files, planned_samples=stream.planned_samples())
        epochs = StreamedEpochs(stream, report, recipe, accelerator)
        result = {"planned": [], "batches": []}
        for epoch in range(2):
            result["planned"].append(epochs.planned_batches(epoch))
            result["batches"].append(list(epochs.epoch_batches(epoch, 0, None)))
        result["skipped"] = dict(report.skipped)
        return result

    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps([read(), read()]))


@pytest.mark.slow
def test_two_ranks_read_disjoint_samples_deterministically_and_stop_together(tmp_path):
    shards = tmp_path / "shards"
    for number in range(5):  # 5 shards for 2 ranks x 2 workers: one slot reads two
        samples = {f"s{number}-{i}": {"png": png_bytes(), "txt": f"shard {number} sample {i}".encode()}
                   for i in range(6)}
        samples[f"s{number}-0"] = {"png": b"corrupt", "txt": b"bad"}  # the index promises 6 good ones: there are 5
        write_tar(shards / f"d-{number}.tar", samples)
    (shards / "sizes.json").write_text(json.dumps({f"d-{number}.tar": 6 for number in range(5)}))
    out = tmp_path / "out"
    out.mkdir()

    run_on_ranks(_read_two_epochs, str(shards / "d-*.tar"), str(out))
    runs, again = ({rank: json.loads((out / f"rank{rank}.json").read_text())[i] for rank in (0, 1)} for i in (0, 1))
    assert again == runs  # determinism: the same seed reads the same batches on each rank again
    for epoch in range(2):
        batches = {rank: runs[rank]["batches"][epoch] for rank in (0, 1)}
        keys = {rank: [key for batch in batches[rank] for key in batch] for rank in (0, 1)}
        assert not set(keys[0]) & set(keys[1]) and len(set(keys[0])) == len(keys[0])  # disjoint, none twice
        # By the index the rank without the two-shard slot has 3 + 3 batches of 2; one corrupt sample per shard
        # leaves it 2 + 2, and the other rank (5 + 2) stops there too, instead of training on while it waits.
        assert runs[0]["planned"][epoch] == 6
        assert len(batches[0]) == len(batches[1]) == 4
    assert runs[0]["skipped"] == runs[1]["skipped"] == {"bad_image": 5}  # every rank's counts, summed


# --- the loop's checks and the shipped example ---------------------------------------------------------------------


def test_too_many_corrupt_samples_stop_the_run_naming_the_shard(tiny_clip_recipe, dummy_data_dir, tmp_path):
    from vembed.errors import DataError

    shards = tar_shards(dummy_data_dir, tmp_path / "shards")
    write_tar(tmp_path / "shards" / "train-00099.tar", {f"bad{i}": {"png": b"corrupt", "txt": b"x"} for i in range(10)})
    sizes = json.loads((tmp_path / "shards" / "sizes.json").read_text())
    (tmp_path / "shards" / "sizes.json").write_text(json.dumps({**sizes, "train-00099.tar": 10}))
    raw = _streamed_recipe(tiny_clip_recipe, shards, 0)
    with pytest.raises(DataError, match=r"train-00099.tar, row \d+: .*bad_image.*data.max_bad_fraction=0.05"):
        _train(dict(raw, max_steps=None, epochs=1))
    assert not (Path(raw["output_dir"]) / "final").exists()


def test_the_webdataset_example_recipe_trains_on_generated_shards(tmp_path):
    from vembed.components import load_recipe
    from vembed.data.shard_writer import write_shards, write_webdataset
    from vembed.recipe_checks import check_recipe

    made = write_webdataset(tmp_path / "wds", "dummy", num_samples=80, shard_size=8)
    # The validation split in shards too, as img2dataset users have it: evaluated in the run like a JSONL split.
    validation = [json.loads(line) for line in Path(made["validation"]).read_text().splitlines() if line.strip()]
    write_shards(validation, Path(made["validation"]).parent, tmp_path / "wds" / "val", prefix="val", shard_size=4)
    recipe = load_recipe(Path(__file__).resolve().parents[2] / "configs" / "clip_webdataset.yaml", [
        f"data.train={made['train']}", f"data.validation={tmp_path / 'wds' / 'val'}", "data.test=null",
        f"tokenizer_name={made['tokenizer']}", f"output_dir={tmp_path / 'run'}", "batch_size=8", "epochs=2",
        "data.shuffle_buffer=16"])
    check_recipe(recipe)
    trainer = Trainer(recipe)
    result = trainer.run()
    assert trainer.steps_per_epoch == 56 // 8 and result.metrics["train"]["steps"] == 2 * 7
    assert result.metrics["train"]["data"]["total"] == 56 and "q2d/accuracy@1" in result.metrics["validation"]
    assert result.metrics["train"]["data"]["unread_per_epoch"] == [0, 0]  # 7 shards of 8, batches of 8, one reader
    assert trainer.task.split_report("validation")["evaluated"] == len(validation) == 12
