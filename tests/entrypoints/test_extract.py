"""`vembed extract`: paired shards, round-robin over processes with no shared files, resumable, bad images counted."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest
import torch
from ranks import run_on_ranks
from teachers import CLIP_DIM, EVA_DIM, NUM_TOKENS, save_teachers, write_images

from vembed.cli import main as vembed
from vembed.data.embedding_shards import read_shard_metadata


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("extract")
    eva, clip = save_teachers(root)
    images = write_images(root / "images", 14, seed=0)
    (images / "broken.png").write_bytes(b"not a png")  # sorted last (after 00000.png ...): lands in shard 4
    return {"root": root, "eva": eva, "clip": clip, "images": images}


def _extract(setup: dict, out: Path, images: list[str] | None = None) -> int:
    return vembed(["extract", "--teacher-a", setup["eva"], "--teacher-b", setup["clip"], "--images",
                   *(images or [str(setup["images"])]), "--out", str(out), "--shard-size", "3", "--batch-size", "2",
                   "--dtype", "float32"])


def _shards(out: Path) -> dict[str, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return {p.name: load_file(p) for p in sorted(out.glob("shard-*.safetensors"))}


def _extract_on_rank(setup: dict, out: str) -> None:
    assert _extract(setup, Path(out)) == 0


def test_two_processes_write_disjoint_shards_whose_union_is_the_single_process_run(setup, tmp_path):
    single, double = tmp_path / "single", tmp_path / "double"
    assert _extract(setup, single) == 0
    run_on_ranks(_extract_on_rank, setup, str(double), world=2)

    index = json.loads((double / "index.json").read_text())
    assert index == {**json.loads((single / "index.json").read_text()),
                     "shards": index["shards"]}  # same totals, shapes, teachers
    assert index["num_samples"] == 14 and index["num_skipped_images"] == 1
    assert index["eva_shape"] == [NUM_TOKENS, EVA_DIM] and index["clip_shape"] == [NUM_TOKENS, CLIP_DIM]
    # 15 images in shards of 3: shard i was written by rank i mod 2, and only by it.
    writers = {entry["file"]: entry["rank"] for entry in index["shards"]}
    assert writers == {f"shard-{i:05d}.safetensors": i % 2 for i in range(5)}
    ones, twos = _shards(single), _shards(double)
    assert ones.keys() == twos.keys()
    for name in ones:
        for side in ("eva", "clip"):
            torch.testing.assert_close(twos[name][side], ones[name][side], rtol=0, atol=1e-6)
    # No temporary file is left behind by either rank.
    assert not list(double.glob(".tmp-*"))


def test_a_resumed_extraction_skips_finished_shards(setup, tmp_path, capsys):
    out = tmp_path / "out"
    assert _extract(setup, out) == 0
    kept = out / "shard-00001.safetensors"
    stamp = kept.stat().st_mtime_ns
    (out / "shard-00003.safetensors").unlink()  # as if the run had been killed before this shard
    capsys.readouterr()
    assert _extract(setup, out) == 0
    assert "skipped 4 finished shard(s)" in capsys.readouterr().out
    assert kept.stat().st_mtime_ns == stamp  # untouched
    assert (out / "shard-00003.safetensors").is_file()
    assert json.loads((out / "index.json").read_text())["num_samples"] == 14


def test_unreadable_images_are_skipped_and_named(setup, tmp_path):
    out = tmp_path / "out"
    assert _extract(setup, out) == 0
    meta = read_shard_metadata(out / "shard-00004.safetensors")
    assert meta["skipped"] == ["broken.png"]
    assert meta["shapes"]["eva"][0] == 2 and "broken.png" not in meta["sources"]


def test_tar_archives_give_the_same_embeddings_as_the_folder(setup, tmp_path):
    archive = tmp_path / "images.tar"
    with tarfile.open(archive, "w") as tar:
        for path in sorted(setup["images"].glob("*.png")):
            tar.add(path, arcname=path.name)
    from_dir, from_tar = tmp_path / "dir", tmp_path / "tar"
    assert _extract(setup, from_dir) == 0
    assert _extract(setup, from_tar, [str(archive)]) == 0
    ones, twos = _shards(from_dir), _shards(from_tar)
    for name in ones:
        assert torch.equal(ones[name]["clip"], twos[name]["clip"])
    meta = read_shard_metadata(from_tar / "shard-00001.safetensors")
    assert meta["sources"][0].startswith("images.tar::")


def test_a_missing_image_folder_is_one_line(setup, tmp_path, capsys):
    assert _extract(setup, tmp_path / "out", [str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("argument error: --images") and len(err.splitlines()) == 1


def test_shards_of_another_extraction_are_refused_not_mixed_in(setup, tmp_path, capsys):
    """A rerun with other teachers or shard size kept the old shards as 'finished' and indexed them with the new."""
    out = tmp_path / "out"
    assert _extract(setup, out) == 0
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    capsys.readouterr()
    assert vembed(["extract", "--teacher-a", setup["clip"], "--teacher-b", setup["clip"], "--images",
                   str(setup["images"]), "--out", str(out), "--shard-size", "3", "--dtype", "float32"]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds an extraction with other settings (teacher_a" in err and "\n" not in err, err
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "shard-00000.safetensors").write_bytes(b"someone else's")
    assert _extract(setup, foreign) == 2
    assert "without extraction.json, not written by vembed extract" in capsys.readouterr().err
