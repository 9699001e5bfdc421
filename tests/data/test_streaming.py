"""vembed/data/streaming.py: which slot reads which shard, the seeded order, skipping and counting bad samples, the
column mapping of tar samples, the shard index, and the recipe checks."""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("webdataset")  # the streaming extra (in dev)

from streams import jsonl_shards, png_bytes, tar_shards, write_tar

from vembed.components import recipe_from_dict
from vembed.data.stream_samples import SampleDecoder
from vembed.data.streaming import ShardStream, SlotPosition, StreamLayout, open_stream
from vembed.errors import DataError, RecipeError
from vembed.recipe import ColumnMap, DataConfig


def _stream(train: str, batch_size: int = 4, shuffle_buffer: int = 8, seed: int = 0, **data) -> ShardStream:
    cfg = DataConfig(train=train, **data)
    backend, shards = open_stream(cfg)
    decoder = SampleDecoder(cfg.columns.model_dump(), cfg.image_root, cfg.num_hard_negatives or 0, 1)
    return ShardStream(backend, shards, decoder, list, batch_size=batch_size, seed=seed,
                       shuffle_buffer=shuffle_buffer)


def _keys_by_slot(stream: ShardStream, epoch: int) -> dict[int, list[str]]:
    stream.start_epoch(epoch)
    errors = []
    keys = {slot: [f"{Path(r.file).name}:{r.row}" for r in stream.slot_samples(slot, errors.append)]
            for slot in range(stream.layout.slots)}
    assert not errors
    return keys


@pytest.mark.parametrize("kind", ["tar", "jsonl"])
def test_slots_read_disjoint_shards_in_an_order_fixed_by_seed_and_epoch(dummy_data_dir, tmp_path, kind):
    train = (tar_shards if kind == "tar" else jsonl_shards)(dummy_data_dir, tmp_path / "shards")
    stream = _stream(train)
    stream.set_layout(StreamLayout(world=2, rank=0, workers=2))  # 4 slots, 7 shards
    first = _keys_by_slot(stream, epoch=0)
    everything = [key for keys in first.values() for key in keys]
    assert len(everything) == len(set(everything)) == 68  # every sample once, no slot shares one
    files = {slot: {key.split(":")[0] for key in keys} for slot, keys in first.items()}
    assert all(not files[a] & files[b] for a in files for b in files if a < b)  # whole shards per slot

    assert _keys_by_slot(stream, epoch=0) == first  # same seed and epoch: same order
    second = _keys_by_slot(stream, epoch=1)
    assert second != first and sorted(k for v in second.values() for k in v) == sorted(everything)
    other_seed = _stream(train, seed=1)
    other_seed.set_layout(stream.layout)
    assert _keys_by_slot(other_seed, epoch=0) != first


def test_the_shard_order_changes_with_the_epoch(tmp_path):
    # Issue 23: the test above passes when only the shuffle buffer changes with the epoch. With a buffer of 1 the
    # samples come in shard order, so here only the epoch's shuffle and dealing of the shards can differ.
    shards = tmp_path / "shards"
    for number in range(8):
        write_tar(shards / f"o-{number}.tar", {f"k{number}-{i}": _good() for i in range(2)})
    (shards / "sizes.json").write_text(json.dumps({f"o-{number}.tar": 2 for number in range(8)}))
    stream = _stream(str(shards / "o-*.tar"), batch_size=1, shuffle_buffer=1)

    def shards_read(epoch: int, layout: StreamLayout) -> list[tuple[str, ...]]:
        stream.set_layout(layout)
        return [tuple(dict.fromkeys(key.split(":")[0] for key in keys))
                for keys in _keys_by_slot(stream, epoch).values()]

    one_reader = [shards_read(epoch, StreamLayout(world=1, rank=0, workers=1)) for epoch in range(3)]
    assert len(set(map(tuple, one_reader))) == 3, one_reader  # the order of the shards differs every epoch
    four_readers = [shards_read(epoch, StreamLayout(world=2, rank=0, workers=2)) for epoch in range(3)]
    assert len({tuple(frozenset(slot) for slot in epoch) for epoch in four_readers}) == 3  # and who reads which


def test_ranks_are_dealt_equal_shares_of_the_samples():
    import random

    from vembed.data.streaming import Shard, deal_shards, planned_batches

    layout = StreamLayout(world=2, rank=0, workers=2)
    equal = [Shard(f"s{i}.tar", 7) for i in range(10)]  # 10 shards for 4 readers: round-robin gave ranks 6 and 4
    for epoch in range(4):
        slots = deal_shards(equal, seed=0, epoch=epoch, layout=layout)
        assert sorted(s.path for slot in slots for s in slot) == sorted(s.path for s in equal)
        assert [len(slots[0]) + len(slots[1]), len(slots[2]) + len(slots[3])] == [5, 5]
        assert planned_batches(equal, 0, epoch, layout, batch_size=2) == 10 + 7  # 21 and 14 samples per reader

    sizes = random.Random(0).choices(range(1, 60), k=13)  # unequal: within one shard's size of each other
    uneven = [Shard(f"u{i}.tar", size) for i, size in enumerate(sizes)]
    three = StreamLayout(world=3, rank=0, workers=2)
    for epoch in range(6):
        slots = deal_shards(uneven, seed=1, epoch=epoch, layout=three)
        per_rank = [sum(s.num_samples for slot in slots[r * 2:r * 2 + 2] for s in slot) for r in range(3)]
        assert max(per_rank) - min(per_rank) <= max(sizes), per_rank


def _rank_batches(stream: ShardStream, rank: int, epoch: int, take: int) -> list[list[str]]:
    """What one rank trains on in `epoch`: its workers' batches taken round-robin as its DataLoader does (a worker
    that has run out is passed over), the first `take` of them (every rank stops at the plan)."""
    stream.set_layout(StreamLayout(world=stream.layout.world, rank=rank, workers=stream.layout.workers))
    stream.start_epoch(epoch)
    per_worker = [[[f"{Path(e.source).name}:{e.row}" for e in batch]
                   for _, batch in stream._slot_batches(stream.slot_of_worker(worker), None) if batch is not None]
                  for worker in range(stream.layout.workers)]
    interleaved = [batches[i] for i in range(max(map(len, per_worker))) for batches in per_worker if i < len(batches)]
    return interleaved[:take]


def test_each_epoch_leaves_only_the_planned_remainder_unread_and_epochs_read_every_sample(tmp_path):
    from vembed.data.streaming import planned_batches

    shards = tmp_path / "shards"
    for number in range(10):
        write_tar(shards / f"e-{number}.tar", {f"k{number}-{i}": _good(f"{number}-{i}") for i in range(7)})
    (shards / "sizes.json").write_text(json.dumps({f"e-{number}.tar": 7 for number in range(10)}))
    stream = _stream(str(shards / "e-*.tar"), batch_size=2, shuffle_buffer=4)
    layout = StreamLayout(world=2, rank=0, workers=2)
    everything = {f"e-{number}.tar:{i}" for number in range(10) for i in range(1, 8)}
    seen: set[str] = set()
    for epoch in range(4):
        stream.set_layout(layout)
        take = planned_batches(stream.shards, 0, epoch, layout, 2)
        read = [key for rank in (0, 1) for batch in _rank_batches(stream, rank, epoch, take) for key in batch]
        assert len(read) == len(set(read))
        unread = len(everything) - len(read)
        assert unread == 70 - 2 * take * 2 == 2  # the readers' incomplete last batches only (it was 14 of 70)
        seen |= set(read)
    assert seen == everything  # each epoch leaves another remainder unread, so 4 epochs read all 70


def test_the_start_line_says_how_many_samples_each_epoch_leaves_unread():
    from vembed.data.streaming import StreamReport

    report = StreamReport(split="train", files=["a.tar", "b.tar"], planned_samples=70, batches_per_rank=17,
                          unread_per_epoch=[2, 4, 2])
    assert "17 batches per rank; 2-4 samples (up to 5.7%) unread per epoch: ranks' surplus" in report.summary()
    assert report.to_dict()["unread_per_epoch"] == [2, 4, 2]
    report.unread_per_epoch = [16]
    assert "; 16 samples (22.9%) unread in epoch 0" in report.summary()
    report.unread_per_epoch = [0, 0]
    assert "17 batches per rank; every sample read each epoch;" in report.summary()


def _good(text: str = "a caption") -> dict[str, bytes]:
    return {"png": png_bytes(), "txt": text.encode()}


def test_corrupt_samples_are_skipped_and_counted_with_their_shard_and_row(tmp_path):
    shards = tmp_path / "shards"
    write_tar(shards / "a-0.tar", {
        "s0": _good(),
        "s1": {"png": b"not a png at all", "txt": b"bad image"},  # bad image bytes
        "s2": {"png": png_bytes()},  # no text: empty query
        "s3": _good(),
        "s4": {"png": png_bytes()[:40], "txt": b"truncated png"},  # opens, fails to decode
        "s5": {"png": png_bytes(), "txt": b"\xff\xfe"},  # not UTF-8
        "s6": {**_good(), "json": b"{not json"},
    })
    write_tar(shards / "a-1.tar", {f"t{i}": _good(f"caption {i}") for i in range(5)})
    (shards / "a-2.tar").write_bytes(b"this is not a tar file" * 40)  # a whole corrupt shard
    stream = _stream(str(shards / "a-*.tar"), batch_size=1, shuffle_buffer=1)
    stream.start_epoch(0)
    items = list(stream)
    position = SlotPosition.from_dict(items[-1][0])  # the end-of-slot item: counts after the last batch too

    assert [batch is None for _, batch in items] == [False] * (2 + 5) + [True]  # only good samples are batched
    assert position.ended
    assert position.drawn == 12 and position.skipped == {"bad_image": 2, "empty_query": 1, "bad_text": 1,
                                                          "bad_json": 1, "bad_shard": 1}
    rows = {(Path(row["file"]).name, row["row"], row["reason"]) for row in position.bad_rows}
    assert ("a-0.tar", 2, "bad_image") in rows and ("a-0.tar", 3, "empty_query") in rows
    assert all(Path(row["file"]).name in ("a-0.tar", "a-2.tar") for row in position.bad_rows)


def _truncated(path: Path, keep_bytes: int) -> None:
    path.write_bytes(path.read_bytes()[:keep_bytes])


def test_a_broken_shard_counts_every_sample_it_should_have_held(tmp_path):
    shards = tmp_path / "shards"
    for number in range(5):  # 5 shards of 20 listed in sizes.json: 100 samples per epoch
        write_tar(shards / f"b-{number}.tar", {f"s{number}-{i}": _good() for i in range(20)})
    _truncated(shards / "b-1.tar", 6700)  # cut inside sample 4's image (2048 bytes a sample): webdataset raises
    _truncated(shards / "b-3.tar", 10240)  # cut between samples 5 and 6: no error at all
    (shards / "sizes.json").write_text(json.dumps({f"b-{number}.tar": 20 for number in range(5)}))
    stream = _stream(str(shards / "b-*.tar"), batch_size=1, shuffle_buffer=1)
    stream.start_epoch(0)
    end = SlotPosition.from_dict(list(stream)[-1][0])
    assert end.skipped == {"bad_shard": 17 + 15}  # what the two shards lost, not one skip per error
    assert end.drawn == 60 + 3 + 5 and end.lost == 32
    assert {(Path(row["file"]).name, row["detail"]) for row in end.bad_rows} == {
        ("b-1.tar", "ReadError: unexpected end of data @ <_io.BufferedReader name='" + str(shards / "b-1.tar")
         + "'>; gave 3 of the 20 samples sizes.json lists"),
        ("b-3.tar", "ended early; gave 5 of the 20 samples sizes.json lists")}

    from vembed.data.streaming import StreamReport

    report = StreamReport(split="train", files=stream.files, planned_samples=100)
    report.merge_positions(0, [end])
    assert (report.total, report.kept) == (100, 68)
    with pytest.raises(DataError, match=r"32 of 100 samples .*32 bad_shard; 32.0% > data.max_bad_fraction=0.05") as err:
        report.check_bad_fraction(0.05, epoch_done=True)  # one skip per shard would have been 2 %: passed
    assert re.match(rf"data error: {shards}/b-[13]\.tar: 32 of 100", str(err.value))  # a shard is named, no row 0

    (shards / "sizes.json").unlink()  # sizes unknown: the unreadable one counts as 1, and the report says so
    stream = _stream(str(shards / "b-*.tar"), batch_size=1, shuffle_buffer=1)
    stream.start_epoch(0)
    end = SlotPosition.from_dict(list(stream)[-1][0])
    assert end.skipped == {"bad_shard": 1} and end.unsized_broken == 1
    report = StreamReport(split="train", files=stream.files)
    report.merge_positions(0, [end])
    assert "1 broken shard(s) not in sizes.json, each counted as 1 lost sample" in report.summary()


def test_tar_members_and_json_fields_map_to_columns(tmp_path):
    write_tar(tmp_path / "s-0.tar", {"k0": {"jpg": png_bytes(), "caption": b"the caption", "txt": b"unused",
                                           "json": json.dumps({"group": "g1", "doc": "a document"}).encode()}})
    columns = ColumnMap(query="caption", positive="doc", query_image="jpg", label="group")
    stream = _stream(str(tmp_path / "s-0.tar"), batch_size=1, columns=columns.model_dump())
    stream.start_epoch(0)
    (_, [example]), _end = list(stream)
    assert example.query.text == "the caption" and example.query.image.size == (8, 8)  # member `.caption`, `.jpg`
    assert example.positive.text == "a document" and example.positive.image is None  # .json fields
    assert example.label == "g1"

    default = _stream(str(tmp_path / "s-0.tar"), batch_size=1)  # default names: open_clip's txt/image pairing
    default.start_epoch(0)
    (_, [example]), _end = list(default)
    assert example.query.text == "unused" and example.positive.image is not None and example.label is None


def _recipe(train: str, **changes) -> dict:
    return {"model_type": "clip", "model_config": {}, "data": {"train": train}, **changes}


def test_shards_without_an_index_need_max_steps(tmp_path):
    from vembed.data.streaming import check_stream_recipe

    write_tar(tmp_path / "s-0.tar", {"k": _good()})
    cfg = recipe_from_dict(_recipe(str(tmp_path / "s-*.tar"))).data
    with pytest.raises(RecipeError, match="max_steps.*sizes.json.*vembed data index"):
        check_stream_recipe(cfg, max_steps=None)
    check_stream_recipe(cfg, max_steps=10)  # a fixed length needs no index
    (tmp_path / "sizes.json").write_text(json.dumps({"s-0.tar": 1}))
    check_stream_recipe(cfg, max_steps=None)


def test_a_validation_split_in_shards_is_read_for_evaluation_up_to_its_bound(tmp_path):
    from PIL import Image

    from vembed.data.streaming import held_out_shard_splits, read_held_out_shards

    for number in range(3):
        write_tar(tmp_path / "val" / f"{number:05d}.tar", {f"{number}{i:04d}": _good(f"val {number} {i}")
                                                         for i in range(4)})
    write_tar(tmp_path / "val" / "00001.tar", {"bad": {"png": b"corrupt", "txt": b"x"},
                                               **{f"1{i:04d}": _good(f"val 1 {i}") for i in range(3)}})
    write_tar(tmp_path / "train" / "t-0.tar", {"k": _good()})
    cfg = DataConfig(train=str(tmp_path / "train" / "t-0.tar"), validation=str(tmp_path / "val"),
                     max_bad_fraction=0.2)
    assert held_out_shard_splits(cfg) == ["validation"]  # accepted (it was refused)

    examples, report = read_held_out_shards(cfg, "validation", 1)
    assert [e.query.text for e in examples] == [f"val {n} {i}" for n in range(3) for i in range(4) if (n, i) != (1, 3)]
    assert isinstance(examples[0].positive.image, Image.Image) and examples[0].positive.image.fp is not None  # lazy
    assert (report.total, report.kept, report.skipped) == (12, 11, {"bad_image": 1})

    bounded = cfg.model_copy(update={"eval_max_samples": 5})
    examples, report = read_held_out_shards(bounded, "validation", 1)
    assert len(examples) == 5 and report.total == 6  # stops reading at the bound
    with pytest.raises(RecipeError, match="data.test.*not found"):
        held_out_shard_splits(cfg.model_copy(update={"test": str(tmp_path / "val" / "0000{0..3}.tar")}))


def test_img2dataset_stats_give_the_shard_sizes_without_reading_the_shards(tmp_path, capsys):
    from vembed.cli import main
    from vembed.data.streaming import index_shards, read_sizes

    shards = tmp_path / "i2d"
    for number, successes in enumerate((3, 2)):  # img2dataset's layout: 00000.tar, 00000_stats.json, ...
        write_tar(shards / f"{number:05d}.tar", {f"{number}{i:04d}": _good() for i in range(successes)})
        (shards / f"{number:05d}_stats.json").write_text(json.dumps(
            {"count": 4, "successes": successes, "failed_to_download": 4 - successes, "failed_to_resize": 0}))
    paths = [str(shards / "00000.tar"), str(shards / "00001.tar")]
    assert read_sizes(paths) == [3, 2]  # no sizes.json needed

    (shards / "00001.tar").write_bytes(b"unreadable")  # the stats are trusted: the shard is not read to count it
    assert index_shards(paths) == {str(shards): {"00000.tar": 3, "00001.tar": 2}}
    assert main(["data", "index", str(shards)]) == 0
    assert json.loads((shards / "sizes.json").read_text()) == {"00000.tar": 3, "00001.tar": 2}

    (shards / "00000_stats.json").write_text("{not json")
    with pytest.raises(DataError, match=r"00000_stats.json: cannot read the shard's img2dataset stats"):
        index_shards([str(shards / "00000.tar")])


def test_streaming_is_chosen_for_tar_shards_only(tmp_path, dummy_data_dir):
    from vembed.data.streaming import wants_streaming

    write_tar(tmp_path / "s-0.tar", {"k": _good()})
    assert wants_streaming(DataConfig(train=str(tmp_path / "s-{0..0}.tar")))
    assert not wants_streaming(DataConfig(train=str(dummy_data_dir / "train.jsonl")))
    assert wants_streaming(DataConfig(train=str(dummy_data_dir / "train.jsonl"), streaming=True))


def test_data_commands_write_shards_and_an_index_that_agree(tmp_path, capsys):
    from vembed.cli import main

    out = tmp_path / "wds"
    assert main(["data", "webdataset", "--out", str(out), "--source", "dummy", "--num-samples", "40",
                 "--shard-size", "8"]) == 0
    written = json.loads((out / "shards" / "sizes.json").read_text())
    assert sum(written.values()) == 28 and len(written) == 4  # 70 % of 40 for training, 8 per shard
    (out / "shards" / "sizes.json").unlink()
    assert main(["data", "index", str(out / "shards")]) == 0
    assert json.loads((out / "shards" / "sizes.json").read_text()) == written
    assert main(["data", "index"]) == 2 and "give the shards" in capsys.readouterr().err


def test_a_stream_that_reads_no_shard_is_refused_in_one_line(tmp_path):
    write_tar(tmp_path / "s-0.tar", {"k": _good()})
    with pytest.raises(RecipeError, match="not found"):
        open_stream(DataConfig(train=str(tmp_path / "s-{0..1}.tar")))
    with pytest.raises(RecipeError, match="mixes tar shards"):
        (tmp_path / "x.jsonl").write_text("{}\n")
        open_stream(DataConfig(train=[str(tmp_path / "s-0.tar"), str(tmp_path / "x.jsonl")]))


def test_report_stops_a_run_whose_epoch_cannot_stay_under_max_bad_fraction():
    from vembed.data.streaming import StreamReport

    report = StreamReport(split="train", files=["x.tar"], planned_samples=100)
    bad = SlotPosition(0, drawn=10)
    for row in range(6):
        bad.skip("x.tar", row + 1, "bad_image", "sample k: cannot decode image")
    report.merge_positions(0, [bad])
    report.check_bad_fraction(0.1, epoch_done=False)  # 6 of a planned 100: may still pass
    with pytest.raises(DataError, match=r"x.tar, row 1: .*6 of 10 samples .* bad_image"):
        report.check_bad_fraction(0.05, epoch_done=False)  # 6 > 5 % of 100: cannot pass any more
    with pytest.raises(DataError, match="data.max_bad_fraction=0.1"):
        report.check_bad_fraction(0.1, epoch_done=True)  # 60 % of what the epoch read
    assert Counter(report.skipped) == Counter({"bad_image": 6})


def test_webdataset_command_never_deletes_shards_it_did_not_write(tmp_path, capsys):
    from vembed.cli import main

    out = tmp_path / "wds"
    args = ["data", "webdataset", "--out", str(out), "--source", "dummy", "--num-samples", "40", "--shard-size", "8"]
    shards = out / "shards"
    shards.mkdir(parents=True)
    write_tar(shards / "train-00007.tar", {"mine": _good()})  # the user's own shard, in the folder it writes to
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(shards) in err[0] and "train-00007.tar, not written by vembed" in err[0]
    assert (shards / "train-00007.tar").is_file() and sorted(p.name for p in shards.iterdir()) == ["train-00007.tar"]

    (shards / "train-00007.tar").unlink()
    assert main(args) == 0
    (shards / "notes.txt").write_text("mine")
    assert main([*args[:-1], "16"]) == 0  # a rerun replaces its own shards (4 of 8 become 2 of 16), nothing else
    assert sorted(p.name for p in shards.glob("train-*.tar")) == ["train-00000.tar", "train-00001.tar"]
    assert (shards / "notes.txt").read_text() == "mine"


def test_data_index_names_a_missing_path_and_the_missing_extra_in_one_line(tmp_path, capsys, monkeypatch):
    from vembed.cli import main

    write_tar(tmp_path / "s-0.tar", {"k": _good()})
    (tmp_path / "empty").mkdir()
    for given, says in ((tmp_path / "s-9.tar", f"{tmp_path / 's-9.tar'} not found"),
                        (tmp_path / "empty", "empty holds no .tar shards"),
                        (tmp_path / "t-*.tar", "t-*.tar matches no files")):
        # the missing one is named, even beside a good shard (it was dropped, and the good one indexed alone)
        assert main(["data", "index", str(tmp_path / "s-0.tar"), str(given)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
    assert not (tmp_path / "sizes.json").exists()
    monkeypatch.setitem(sys.modules, "webdataset", None)  # the streaming extra not installed
    assert main(["data", "index", str(tmp_path / "s-0.tar")]) == 2
    assert capsys.readouterr().err.strip() == ("environment error: vembed data index: reads tar shards through the "
                                               "webdataset package; pip install 'vembed[streaming]'")


def test_a_dual_encoders_stream_skips_samples_that_would_leave_a_tower_idle(tmp_path, tiny_clip_recipe):
    """2-rank CLIP runs on tar shards set DDP's find_unused_parameters (an extra graph pass every step) although no
    parameter went unused: the stream's records were unknown. The decoder now insists on text and an image."""
    from vembed.models import MODELS
    from vembed.tasks.contrastive import ContrastiveTask

    write_tar(tmp_path / "s-0.tar", {"k0": _good(), "k1": {"txt": b"text only", "json": b'{"positive": "doc"}'}})
    cfg = DataConfig(train=str(tmp_path / "s-0.tar"))
    backend, shards = open_stream(cfg)
    decoder = SampleDecoder(cfg.columns.model_dump(), None, 0, 1, required_modalities=frozenset({"text", "image"}))
    stream = ShardStream(backend, shards, decoder, list, batch_size=1, seed=0, shuffle_buffer=1)
    stream.start_epoch(0)
    items = list(stream)
    position = SlotPosition.from_dict(items[-1][0])
    assert [batch[0].query.text for _, batch in items if batch] == ["a caption"]
    assert position.skipped == {"missing_modality": 1} and "has no image" in position.bad_rows[0]["detail"]

    task = ContrastiveTask(recipe_from_dict(dict(tiny_clip_recipe, data={"train": str(tmp_path / "s-*.tar")},
                                                 max_steps=2)))
    task.train_rows = None  # streamed
    assert MODELS.get("clip").modalities_per_record == {"text", "image"}
    assert task.every_step_uses_every_parameter()  # so DDP is built without the search


@pytest.mark.parametrize("limit, stops", [(0.05, True), (0.1, False), (0.11, False)])
def test_max_bad_fraction_of_a_stream_at_its_boundary(limit, stops):
    """The map-style rule per epoch: 10 of 100 samples read is 10 %, so 0.1 passes and 0.05 stops; before the epoch
    ends, 10 skips of a planned 100 stop only a limit below 10 % (at 0.1 the epoch can still pass)."""
    from vembed.data.streaming import StreamReport

    report = StreamReport(split="train", files=["x.tar"], planned_samples=100)
    position = SlotPosition(0, drawn=100)
    for row in range(10):
        position.skip("x.tar", row + 1, "bad_image", "sample k: cannot decode image")
    report.merge_positions(0, [position])
    for epoch_done in (False, True):
        if stops:
            with pytest.raises(DataError, match=rf"10 of 100 samples .*data.max_bad_fraction={limit}"):
                report.check_bad_fraction(limit, epoch_done=epoch_done)
        else:
            report.check_bad_fraction(limit, epoch_done=epoch_done)


def test_a_stream_report_keeps_the_first_bad_rows_of_every_slot_up_to_the_limit():
    from vembed.data.reports import MAX_BAD_ROWS_SHOWN
    from vembed.data.streaming import StreamReport

    slots = [SlotPosition(slot, drawn=20) for slot in range(2)]
    for slot in slots:
        for row in range(MAX_BAD_ROWS_SHOWN + 2):
            slot.skip(f"s{slot.slot}.tar", row + 1, "bad_image", "cannot decode image")
    assert [len(slot.bad_rows) for slot in slots] == [MAX_BAD_ROWS_SHOWN] * 2
    report = StreamReport(split="train", files=["s0.tar", "s1.tar"])
    report.merge_positions(0, slots)
    shown = [(bad.file, bad.row) for bad in report.bad_rows]
    assert shown == [("s0.tar", row + 1) for row in range(MAX_BAD_ROWS_SHOWN)]
    assert report.skipped == {"bad_image": 2 * (MAX_BAD_ROWS_SHOWN + 2)}
