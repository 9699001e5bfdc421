"""The shard format and its dataset: rows as written, corrupt shards skipped and counted, per-epoch order disjoint
across ranks."""

from __future__ import annotations

import json

import pytest
import torch

from vembed.data.embedding_shards import EmbeddingShardDataset, read_index, shard_name, write_index, write_shard
from vembed.errors import DataError, RecipeError


def _write(directory, counts: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    """Shards of the given sizes with known contents; returns all rows in order."""
    generator = torch.Generator().manual_seed(seed)
    directory.mkdir(parents=True, exist_ok=True)
    eva = torch.randn(sum(counts), 4, 6, generator=generator)
    clip = torch.randn(sum(counts), 4, 3, generator=generator)
    start = 0
    for i, n in enumerate(counts):
        write_shard(directory / shard_name(i), eva[start : start + n].half(), clip[start : start + n].half(),
                    [f"img{j}.png" for j in range(start, start + n)], [], writer_rank=0)
        start += n
    write_index(directory, [directory / shard_name(i) for i in range(len(counts))], {"teacher_a": "a"})
    return {"eva": eva.half().float(), "clip": clip.half().float()}


def test_rows_come_back_in_order_as_float32(tmp_path):
    rows = _write(tmp_path / "s", [3, 2, 4])
    dataset = EmbeddingShardDataset(str(tmp_path / "s"))
    assert len(dataset) == 9 and dataset.report.num_shards == 3
    for i in range(9):
        item = dataset[i]
        assert item["eva"].dtype == torch.float32
        assert torch.equal(item["eva"], rows["eva"][i]) and torch.equal(item["clip"], rows["clip"][i])
    assert torch.equal(dataset.tensors()["clip"], rows["clip"])


def test_a_corrupt_shard_is_skipped_and_counted(tmp_path):
    rows = _write(tmp_path / "s", [3, 3, 3, 3])
    path = tmp_path / "s" / shard_name(1)
    path.write_bytes(path.read_bytes()[:40])  # truncated mid-header
    dataset = EmbeddingShardDataset(str(tmp_path / "s"), max_bad_fraction=0.5)
    assert len(dataset) == 9 and dataset.report.num_skipped == 1
    assert dataset.report.bad_shards[0]["file"] == shard_name(1)
    assert "skipped 1 unreadable shard" in dataset.report.summary()
    assert torch.equal(dataset[3]["clip"], rows["clip"][6])  # shard 2 follows shard 0


def test_too_many_corrupt_shards_stop_naming_the_index(tmp_path):
    _write(tmp_path / "s", [2, 2])
    (tmp_path / "s" / shard_name(0)).unlink()
    with pytest.raises(DataError, match="1 of 2 shards are unreadable") as info:
        EmbeddingShardDataset(str(tmp_path / "s"), max_bad_fraction=0.05)
    assert "index.json" in str(info.value)


@pytest.mark.parametrize("limit, stops", [(0.24, True), (0.25, False), (0.26, False)])
def test_max_bad_fraction_of_shards_at_its_boundary(tmp_path, limit, stops):
    """1 unreadable shard of the 4 listed is 25 %: a limit of 0.25 passes, 0.24 stops."""
    _write(tmp_path / "s", [2, 2, 2, 2])
    (tmp_path / "s" / shard_name(3)).unlink()
    if stops:
        with pytest.raises(DataError, match="1 of 4 shards are unreadable"):
            EmbeddingShardDataset(str(tmp_path / "s"), max_bad_fraction=limit)
    else:
        assert len(EmbeddingShardDataset(str(tmp_path / "s"), max_bad_fraction=limit)) == 6


def test_not_a_shard_directory_names_the_key(tmp_path):
    with pytest.raises(RecipeError, match="data.validation.*vembed extract"):
        read_index(str(tmp_path), "data.validation")
    (tmp_path / "index.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(DataError, match="index.json"):
        read_index(str(tmp_path))


def test_each_epoch_is_a_reproducible_permutation_split_disjointly_across_ranks(tmp_path):
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler

    from vembed.data.sampler import EpochShuffleSampler

    _write(tmp_path / "s", [5, 7, 4])
    dataset = EmbeddingShardDataset(str(tmp_path / "s"))

    def rank_indices(epoch: int, rank: int) -> list[int]:
        sampler = EpochShuffleSampler(len(dataset), seed=3)
        sampler.set_epoch(epoch)
        shard = BatchSamplerShard(BatchSampler(sampler, 4, drop_last=True), num_processes=2, process_index=rank)
        return [i for batch in shard for i in batch]

    for epoch in (0, 1):
        first, second = rank_indices(epoch, 0), rank_indices(epoch, 1)
        assert not set(first) & set(second)
        assert sorted(first + second) == list(range(16))
        assert first == rank_indices(epoch, 0)
    assert rank_indices(0, 0) != rank_indices(1, 0)
