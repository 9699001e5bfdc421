"""vembed/data/sampler.py: a reproducible per-epoch order, sharded across ranks by accelerate."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from vembed.data.sampler import EpochShuffleSampler


@pytest.fixture(autouse=True, scope="module")
def _fresh_accelerate_state():
    """prepare_data_loader creates accelerate's process-wide PartialState; leave none behind for other tests."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def _order(sampler, epoch):
    sampler.set_epoch(epoch)
    return list(sampler)


def test_same_seed_and_epoch_give_the_same_order_and_epochs_differ():
    a, b = EpochShuffleSampler(50, seed=3), EpochShuffleSampler(50, seed=3)
    torch.manual_seed(0)  # global RNG state must not matter
    first = _order(a, 0)
    torch.manual_seed(123)
    assert _order(b, 0) == first
    assert sorted(first) == list(range(50)) and len(a) == 50
    assert _order(a, 1) != first and _order(a, 1) == _order(b, 1)
    assert _order(EpochShuffleSampler(50, seed=4), 0) != first


def _rank_batches(num_samples, batch_size, seed, epoch, world_size):
    from accelerate.data_loader import prepare_data_loader

    shards = []
    for rank in range(world_size):
        loader = DataLoader(
            list(range(num_samples)),
            batch_size=batch_size,
            sampler=EpochShuffleSampler(num_samples, seed),
            drop_last=True,
        )
        prepared = prepare_data_loader(
            loader, num_processes=world_size, process_index=rank, put_on_device=False, split_batches=False
        )
        prepared.set_epoch(epoch)  # the loop calls this; accelerate forwards it to our sampler
        shards.append([batch.tolist() for batch in prepared])
    return shards


@pytest.mark.parametrize("num_samples", [24, 23, 30])
def test_accelerate_shards_are_disjoint_and_cover_the_epoch_order(num_samples):
    batch_size, world_size, seed, epoch = 4, 2, 7, 2
    shards = _rank_batches(num_samples, batch_size, seed, epoch, world_size)
    order = _order(EpochShuffleSampler(num_samples, seed), epoch)
    full_batches = [order[i : i + batch_size] for i in range(0, num_samples - batch_size + 1, batch_size)]
    # rank r gets batches r, r + W, ...; the incomplete last batch is dropped (drop_last=True), and so is a last
    # round of full batches that not every rank would get (accelerate keeps ranks in step)
    rounds = len(full_batches) // world_size
    for rank, shard in enumerate(shards):
        assert shard == full_batches[rank : rounds * world_size : world_size]
    seen = [i for shard in shards for batch in shard for i in batch]
    assert len(seen) == len(set(seen))
    assert sorted(seen) == sorted(order[: rounds * world_size * batch_size])
    if num_samples == 24:
        assert sorted(seen) == list(range(24))  # an exact multiple loses nothing


def test_accelerate_shards_change_with_the_epoch_and_repeat_for_the_same_epoch():
    assert _rank_batches(24, 4, 7, 0, 2) == _rank_batches(24, 4, 7, 0, 2)
    assert _rank_batches(24, 4, 7, 0, 2) != _rank_batches(24, 4, 7, 1, 2)
