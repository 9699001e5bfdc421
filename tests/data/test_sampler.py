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


def test_the_order_for_a_seed_and_epoch_is_pinned():
    """Resumed runs replay the order of the run they resume (saved before this test was written): a change in how the
    permutation is drawn or handed out breaks them, so the values are pinned."""
    sampler = EpochShuffleSampler(100_000, seed=7)
    sampler.set_epoch(3)
    order = list(sampler)
    assert order[:6] == [96937, 82237, 30716, 11299, 7300, 29850]
    assert order[65535:65538] == [40969, 68263, 97659]  # across the boundary of two chunks
    assert order[-3:] == [58528, 83057, 65854] and sorted(order) == list(range(100_000))
    several = SourceBatchSampler([(0, 40), (40, 64), (64, 100)], batch_size=4, world_size=1, seed=5)
    several.set_epoch(1)
    batches = list(several)
    assert batches[:3] == [[53, 41, 60, 63], [23, 2, 13, 0], [66, 87, 96, 91]] and batches[-1] == [70, 81, 72, 71]


def _python_memory_peak(iterable) -> int:
    """Bytes held at most while `iterable` is consumed: Python objects and numpy arrays (torch's storage is not
    traced)."""
    import collections
    import tracemalloc

    tracemalloc.start()
    try:
        collections.deque(iterable, maxlen=0)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_order_of_a_large_epoch_is_not_held_as_a_python_list():
    # A list of 1 M Python ints is ~40 MB per rank (~190 MB at 5 M rows); the permutation itself stays one tensor or
    # array (8 MB here) and is handed out a chunk at a time.
    rows = 1_000_000
    assert _python_memory_peak(EpochShuffleSampler(rows, seed=0)) < 16 * 2**20
    one_source = SourceBatchSampler([(0, rows)], batch_size=1000, world_size=1, seed=0)
    assert _python_memory_peak(one_source) < 16 * 2**20


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


# --- several sources, one per step ------------------------------------------------------------------------------------

import numpy as np  # noqa: E402

from vembed.data.sampler import SourceBatchSampler  # noqa: E402

SOURCES = [(0, 40), (40, 64), (64, 100)]  # three sources of 40, 24 and 36 records


def _source_of(index):
    return next(number for number, (start, stop) in enumerate(SOURCES) if start <= index < stop)


def _sharded(make_sampler, epoch, world_size):
    """Each rank's batches, as accelerate shards the batch sampler for `world_size` processes."""
    from accelerate.data_loader import prepare_data_loader

    shards = []
    for rank in range(world_size):
        sampler = make_sampler()
        loader = DataLoader(list(range(100)), batch_sampler=sampler)
        prepared = prepare_data_loader(loader, num_processes=world_size, process_index=rank, put_on_device=False)
        sampler.set_epoch(epoch)
        shards.append([batch.tolist() for batch in prepared])
    return shards


def test_every_step_draws_one_source_on_every_rank_with_disjoint_rows():
    make = lambda: SourceBatchSampler(SOURCES, batch_size=4, world_size=2, seed=5)  # noqa: E731
    ranks = _sharded(make, epoch=1, world_size=2)
    assert len(ranks[0]) == len(ranks[1]) == 5 + 3 + 4  # whole global batches of 8 per source: 40/8, 24/8, 36/8
    for step, (mine, theirs) in enumerate(zip(*ranks)):
        sources = {_source_of(i) for i in mine + theirs}
        assert len(sources) == 1, f"step {step} mixes sources {sources}"  # homogeneous, the same on both ranks
        assert not set(mine) & set(theirs)  # each rank its own rows
    seen = [i for shard in ranks for batch in shard for i in batch]
    assert len(seen) == len(set(seen)) == 96  # by size: every record once, but 4 of source 3 (36 = 4 x 8 + 4)
    assert set(range(64)) <= set(seen)
    # a function of (seed, epoch): again the same, another epoch or seed differs
    assert _sharded(make, epoch=1, world_size=2) == ranks
    assert _sharded(make, epoch=2, world_size=2) != ranks
    other = lambda: SourceBatchSampler(SOURCES, batch_size=4, world_size=2, seed=6)  # noqa: E731
    assert _sharded(other, epoch=1, world_size=2) != ranks


def test_weights_apportion_the_steps_of_an_epoch_exactly():
    sampler = SourceBatchSampler(SOURCES, batch_size=4, world_size=1, seed=0, weights=[2.0, 1.0, 1.0])
    steps = sampler.step_sources()
    assert len(steps) == len(sampler) == 10 + 6 + 9  # an epoch keeps the by-size length
    counts = np.bincount(steps, minlength=3).tolist()
    assert counts == [13, 6, 6]  # 25 steps split 2:1:1 (12.5, 6.25, 6.25), largest remainder first
    batches = list(sampler)
    assert all(len({_source_of(i) for i in batch}) == 1 for batch in batches)
    firsts = [i for batch, s in zip(batches, steps) if s == 0 for i in batch]
    assert len(firsts) == 13 * 4 and sorted(set(firsts)) == list(range(40))  # 52 draws of 40: a second pass began


def test_leftover_steps_go_to_the_largest_remainders_not_the_first_sources():
    from vembed.data.sampler import _apportion

    # 25 steps at 1:1:2 are 6.25, 6.25 and 12.5: the one step left over goes to the third source (remainder 0.5),
    # not to the first (0.25), which a first-come rule would give [7, 6, 12]
    assert _apportion(25, [1.0, 1.0, 2.0]) == [6, 6, 13]
    assert _apportion(10, [0.2, 0.3, 0.5]) == [2, 3, 5]  # exact shares: nothing left over
    sampler = SourceBatchSampler(SOURCES, batch_size=4, world_size=1, seed=0, weights=[1.0, 1.0, 2.0])
    assert np.bincount(sampler.step_sources(), minlength=3).tolist() == [6, 6, 13]


def test_a_source_smaller_than_one_global_batch_is_refused_by_name():
    from vembed.errors import DataError

    with pytest.raises(DataError, match="source 'tiny' has 6 records, fewer than one contrastive batch"):
        SourceBatchSampler([(0, 40), (40, 46)], batch_size=4, world_size=2, names=["big", "tiny"])


def _keys_from_texts(texts):
    ids = {text: n for n, text in enumerate(dict.fromkeys(t for row in texts for t in row))}
    offsets = np.cumsum([0] + [len(row) for row in texts])
    return offsets, np.asarray([ids[t] for row in texts for t in row])


def test_no_duplicates_keeps_equal_texts_out_of_one_global_batch():
    # 60 records over 12 distinct queries and 60 distinct positives: every batch of 8 (2 ranks x 4) has 8 queries
    texts = [[f"query {i % 12}", f"positive {i}"] for i in range(60)]
    keys = _keys_from_texts(texts)
    make = lambda: SourceBatchSampler([(0, 60)], batch_size=4, world_size=2, seed=1, duplicate_keys=keys)  # noqa
    ranks = _sharded(make, epoch=0, world_size=2)
    assert len(ranks[0]) == 60 // 8
    for mine, theirs in zip(*ranks):
        queries = [texts[i][0] for i in mine + theirs]
        assert len(queries) == len(set(queries)) == 8
    plain = SourceBatchSampler([(0, 60)], batch_size=4, world_size=2, seed=1)
    assert any(len({texts[i][0] for i in a + b}) < 8 for a, b in zip(*[iter(list(plain))] * 2))  # it would repeat
    assert _sharded(make, epoch=0, world_size=2) == ranks


def test_no_duplicates_that_cannot_fill_a_batch_is_a_data_error():
    from vembed.errors import DataError

    keys = _keys_from_texts([[f"query {i % 3}"] for i in range(30)])  # 3 distinct texts, batches of 4
    with pytest.raises(DataError, match="cannot fill a batch of 4 records without repeating"):
        list(SourceBatchSampler([(0, 30)], batch_size=4, world_size=1, duplicate_keys=keys))


# --- class-balanced batches (data.m_per_class) -----------------------------------------------------------------------

from vembed.data.sampler import MPerClassBatchSampler  # noqa: E402
from vembed.errors import DataError  # noqa: E402

# 7 classes of 6, 9, 5, 12, 7, 8 and 10 images, interleaved as an ImageFolder listing would not be (order is irrelevant)
CLASS_SIZES = [6, 9, 5, 12, 7, 8, 10]
CLASS_LABELS = [label for label, size in enumerate(CLASS_SIZES) for _ in range(size)][::-1]


@pytest.mark.parametrize("m, batch_size, world_size", [(2, 4, 2), (3, 6, 2), (4, 8, 1), (2, 2, 3)])
def test_every_global_batch_holds_m_of_each_class_and_each_rank_whole_classes(m, batch_size, world_size):
    make = lambda: MPerClassBatchSampler(CLASS_LABELS, m, batch_size, world_size, seed=3)  # noqa: E731
    shards = _sharded(make, epoch=1, world_size=world_size)
    steps = len(CLASS_LABELS) // (batch_size * world_size)
    assert [len(shard) for shard in shards] == [steps] * world_size  # as many steps as the plain shuffle
    drawn = []
    for step in range(steps):
        global_batch = []
        for rank in range(world_size):
            labels = [CLASS_LABELS[i] for i in shards[rank][step]]
            assert len(labels) == batch_size
            counts = {label: labels.count(label) for label in labels}
            assert set(counts.values()) == {m}, (step, rank, labels)  # whole classes, m images each, on each rank
            global_batch += shards[rank][step]
        classes = [CLASS_LABELS[i] for i in global_batch]
        assert all(classes.count(c) == m for c in classes)  # no class split across two ranks' slices either
        assert len(set(global_batch)) == len(global_batch)  # m distinct images (every class has at least m)
        drawn += global_batch
    for label, size in enumerate(CLASS_SIZES):  # each class's images come round evenly: a shuffled cycle per class
        seen = [drawn.count(i) for i, found in enumerate(CLASS_LABELS) if found == label]
        assert max(seen) - min(seen) <= 1, (label, seen)


def test_class_balanced_order_is_a_function_of_seed_and_epoch_and_is_pinned():
    sampler = MPerClassBatchSampler(CLASS_LABELS, 2, 4, 1, seed=11)
    assert _order(sampler, 0) == _order(MPerClassBatchSampler(CLASS_LABELS, 2, 4, 1, seed=11), 0)
    assert _order(sampler, 0) != _order(sampler, 1)
    assert _order(sampler, 0) != _order(MPerClassBatchSampler(CLASS_LABELS, 2, 4, 1, seed=12), 0)
    # Pinned: a change to the draws (which would silently change every resumed run's order) shows here.
    assert _order(sampler, 0)[:3] == [[18, 24, 9, 5], [51, 54, 3, 4], [56, 55, 39, 40]]
    tagged = MPerClassBatchSampler(CLASS_LABELS, 2, 4, 1, seed=11, tags_epochs=True)
    assert _order(tagged, 2)[0] == [(2, i) for i in _order(sampler, 2)[0]]  # augmented images: (epoch, index)


def test_data_that_cannot_fill_a_class_balanced_batch_is_one_line():
    with pytest.raises(DataError, match=r"data.m_per_class is 6 but class 'two' has 5 image\(s\) \(1 class\(es\)"):
        MPerClassBatchSampler(CLASS_LABELS, 6, 6, 1).check(names=["zero", "one", "two", "3", "4", "5", "6"])
    MPerClassBatchSampler(CLASS_LABELS, 5, 10, 1).check()  # exactly the smallest class's count: fine
    with pytest.raises(DataError, match=r"global batch of 32 with 8 classes, but the data has 7"):
        MPerClassBatchSampler(CLASS_LABELS, 4, 16, 2).check()
    MPerClassBatchSampler(CLASS_LABELS, 4, 14, 2).check()  # 7 classes: exactly enough
