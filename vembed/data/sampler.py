"""The training order: a fresh, reproducible permutation each epoch, the same on every rank; with named sources (or
no duplicates in a batch), batches drawn one source at a time."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from vembed.errors import DataError


class EpochShuffleSampler(Sampler[int]):
    """Yields a permutation of `range(num_samples)` drawn from a `torch.Generator` seeded with `seed + epoch`.

    Every rank builds the same sampler and gets the same order; accelerate's `BatchSamplerShard` then gives rank r the
    batches r, r + W, ... . The order depends only on (seed, epoch), never on global RNG state, so a resumed run replays
    it exactly. The loop calls `set_epoch` (accelerate's prepared DataLoader forwards its own `set_epoch` here) before
    iterating each epoch. With `tags_epochs`, it yields `(epoch, index)` pairs instead, for datasets whose samples draw
    per epoch (augmented images: vembed/classification/augment.py), so DataLoader workers know the epoch without sharing
    state with the main process.
    """

    def __init__(self, num_samples: int, seed: int = 0, tags_epochs: bool = False):
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        self.num_samples = num_samples
        self.seed = seed
        self.tags_epochs = tags_epochs
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        order = _ints(torch.randperm(self.num_samples, generator=generator))
        if self.tags_epochs:
            epoch = self.epoch
            return ((epoch, index) for index in order)
        return order

    def __len__(self) -> int:
        return self.num_samples


class SourceBatchSampler:
    """Per-rank batches for several named sources (and/or batches without duplicates), one source per step.

    Each optimizer step's global batch (`batch_size × world_size` records) is drawn from ONE source, the same on
    every rank, so in-batch negatives are same-task (as E5, BGE, GTE and Qwen3-Embedding train); each rank gets its
    own disjoint slice of it. It yields the `world_size` slices of each global batch one after another, and
    accelerate's `BatchSamplerShard` hands rank r the r-th of each group (the same sharding as for the plain
    sampler).

    An epoch has as many steps as the sources' records fill whole global batches (sum over sources of
    records // global batch). Which source each step uses: by size (each source's full batches, every record once),
    or by `weights` (steps apportioned by weight; a source drawn more often than its records fill starts a fresh
    shuffle of them), in an order shuffled per epoch. Everything is a function of (seed, stage, epoch): the records
    of a source are permuted by their own generator, so a resumed run that skips the first batches replays them.

    `duplicate_keys` (offsets, keys), as `PairRows.duplicate_keys` gives: a record whose texts or images are already
    in the global batch being filled waits for a later batch of the epoch (sentence-transformers' no-duplicates
    sampler); batches stay full, so records left waiting at the end of an epoch are not seen in it.
    """

    drop_last = True

    def __init__(self, sources: list[tuple[int, int]], batch_size: int, world_size: int, seed: int = 0, *,
                 weights: list[float] | None = None, duplicate_keys: tuple[np.ndarray, np.ndarray] | None = None,
                 stage: int = 0, names: list[str | None] | None = None):
        self.sources, self.batch_size, self.world_size = list(sources), batch_size, world_size
        self.seed, self.stage, self.epoch = seed, stage, 0
        self.duplicate_keys = duplicate_keys
        self.names = names or [None] * len(self.sources)
        self.global_batch = batch_size * world_size
        for name, (start, stop) in zip(self.names, self.sources):
            if stop - start < self.global_batch:
                raise DataError(f"source {name or 'train'!r} has {stop - start} records, fewer than one contrastive "
                                f"batch ({batch_size} x {world_size} processes); lower batch_size or leave it out")
        full = [(stop - start) // self.global_batch for start, stop in self.sources]
        self.steps_per_source = full if weights is None else _apportion(sum(full), weights)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return sum(self.steps_per_source) * self.world_size

    def __iter__(self) -> Iterator[list[int]]:
        streams = [self._global_batches(number) for number in range(len(self.sources))]
        size = self.batch_size
        for number in self.step_sources():
            batch = next(streams[number])
            for rank in range(self.world_size):
                yield batch[rank * size : (rank + 1) * size]

    def step_sources(self) -> list[int]:
        """The source (index into `sources`) of each step of the current epoch."""
        order = np.repeat(np.arange(len(self.sources)), self.steps_per_source)
        return self._generator(purpose=0).permutation(order).tolist()

    def _generator(self, purpose: int, source: int = 0, cycle: int = 0) -> np.random.Generator:
        # A fixed-length key: (seed, stage, epoch, what for, which source, which pass over it).
        key = [self.seed % 2**63, self.stage, self.epoch, purpose, source, cycle]
        return np.random.default_rng(key)

    def _shuffled(self, number: int) -> Iterator[int]:
        """The records of source `number`, in a fresh order each pass, for as long as needed."""
        start, stop = self.sources[number]
        for cycle in itertools.count():
            order = self._generator(1, number, cycle).permutation(stop - start)
            order += start  # in place: one array of the source's size
            yield from _ints(order)

    def _global_batches(self, number: int) -> Iterator[list[int]]:
        records = self._shuffled(number)
        if self.duplicate_keys is None:
            while True:
                yield list(itertools.islice(records, self.global_batch))
        offsets, keys = self.duplicate_keys
        start, stop = self.sources[number]
        waiting: list[int] = []
        while True:
            batch, seen, later = [], set(), []
            for record in waiting:  # records held back earlier go first
                found = keys[offsets[record] : offsets[record + 1]].tolist()
                if len(batch) < self.global_batch and seen.isdisjoint(found):
                    batch.append(record)
                    seen.update(found)
                else:
                    later.append(record)
            waiting, looked = later, 0
            while len(batch) < self.global_batch:
                record = next(records)
                looked += 1
                found = keys[offsets[record] : offsets[record + 1]].tolist()
                if seen.isdisjoint(found):
                    batch.append(record)
                    seen.update(found)
                else:
                    waiting.append(record)
                if looked > 2 * (stop - start) + self.global_batch:
                    raise DataError(
                        f"source {self.names[number] or 'train'!r} cannot fill a batch of {self.global_batch} records "
                        f"without repeating a text or image (found {len(batch)} distinct); lower batch_size or set "
                        "data.no_duplicates: false")
            yield batch


class MPerClassBatchSampler:
    """Class-balanced batches (`data.m_per_class`, pytorch-metric-learning's MPerClassSampler): every global batch
    (`batch_size × world_size` images) holds `m` images of each of `global batch / m` classes, and each rank's slice
    holds whole classes (`batch_size / m` of them), so a pair-based loss finds positives on every rank and in the
    gathered batch.

    Per global batch, its classes are drawn without replacement; each class gives its next `m` images from its own
    shuffled cycle, so the images of a class are seen equally often. An epoch has `len(labels) // global batch`
    steps, as the plain shuffle has. Everything is a function of (seed, epoch), so a resumed run replays the order;
    with `tags_epochs` it yields `(epoch, index)` keys (augmented images)."""

    drop_last = True

    def __init__(self, labels: list[int], m: int, batch_size: int, world_size: int, seed: int = 0,
                 tags_epochs: bool = False):
        self.m, self.batch_size, self.world_size, self.seed = m, batch_size, world_size, seed
        self.tags_epochs, self.epoch = tags_epochs, 0
        self.global_batch = batch_size * world_size
        self.classes_per_batch = self.global_batch // m
        by_class: dict[int, list[int]] = {}
        for index, label in enumerate(labels):
            by_class.setdefault(int(label), []).append(index)
        self.classes = sorted(by_class)
        self.indices = [np.asarray(by_class[label], dtype=np.int64) for label in self.classes]
        self.steps = len(labels) // self.global_batch

    def check(self, file: str | None = None, names: list[str] | None = None) -> None:
        """One line for data that cannot fill a class-balanced batch: too few classes, or a class with fewer than m
        images."""
        if len(self.classes) < self.classes_per_batch:
            raise DataError(f"data.m_per_class: {self.m} images of each class fill a global batch of "
                            f"{self.global_batch} with {self.classes_per_batch} classes, but the data has "
                            f"{len(self.classes)}; lower batch_size or raise m_per_class", file=file)
        small = [(label, len(found)) for label, found in zip(self.classes, self.indices) if len(found) < self.m]
        if small:
            label, count = small[0]
            name = names[label] if names else label
            raise DataError(f"data.m_per_class is {self.m} but class {name!r} has {count} image(s) ({len(small)} "
                            f"class(es) have fewer than {self.m}); lower m_per_class or add images", file=file)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.steps * self.world_size

    def _generator(self, purpose: int, item: int = 0, cycle: int = 0) -> np.random.Generator:
        return np.random.default_rng([self.seed % 2**63, self.epoch, purpose, item, cycle])

    def _draws(self, number: int) -> Iterator[list[int]]:
        """Class `number`'s images, m distinct ones at a time, from a fresh order each pass over the class: a draw
        that crosses into the next pass takes that pass's first images that are not already in it."""
        images, left = self.indices[number], []
        for cycle in itertools.count():
            order = images[self._generator(1, number, cycle).permutation(len(images))].tolist()
            if left:
                fill = [index for index in order if index not in left][: self.m - len(left)]
                yield left + fill
                order = [index for index in order if index not in fill]
            while len(order) >= self.m:
                yield order[: self.m]
                order = order[self.m :]
            left = order

    def __iter__(self) -> Iterator[list[Any]]:
        draws = [self._draws(number) for number in range(len(self.classes))]
        per_rank = self.batch_size
        for step in range(self.steps):
            chosen = self._generator(0, step).choice(len(self.classes), self.classes_per_batch, replace=False)
            batch = [index for number in chosen.tolist() for index in next(draws[number])]
            if self.tags_epochs:
                batch = [(self.epoch, index) for index in batch]
            for rank in range(self.world_size):
                yield batch[rank * per_rank : (rank + 1) * per_rank]


def _ints(order: "torch.Tensor | np.ndarray", chunk: int = 65536) -> Iterator[int]:
    """The values of a permutation as Python ints, a chunk at a time: the order stays one 8-byte-per-row array, not a
    list of n Python ints (~38 bytes per row: 190 MB for 5 M rows, per rank)."""
    for start in range(0, len(order), chunk):
        yield from order[start : start + chunk].tolist()


def _apportion(total: int, weights: list[float]) -> list[int]:
    """`total` steps split in proportion to `weights` (largest remainders), so an epoch matches them exactly."""
    shares = np.asarray(weights, dtype=np.float64) / float(sum(weights)) * total
    counts = np.floor(shares).astype(np.int64)
    for index in np.argsort(-(shares - counts), kind="stable")[: total - int(counts.sum())]:
        counts[index] += 1
    return counts.tolist()


def build_batch_sampler(dataset: Any, batch_size: int, world_size: int, seed: int, *, stage: int = 0,
                        weights: dict[str, float] | None = None, only: list[str] | None = None,
                        no_duplicates: bool = False) -> SourceBatchSampler | None:
    """The batch sampler for `dataset` (a `PairDataset`): None (the plain `EpochShuffleSampler` then) for one
    unnamed source without no-duplicates; else a `SourceBatchSampler` over the named sources this stage uses
    (`only`, or those with a weight > 0 in `weights`), by weight when weights are given, else by size."""
    ranges = dataset.source_ranges() if hasattr(dataset, "source_ranges") else [(None, 0, len(dataset))]
    named = [name for name, _, _ in ranges]
    if named == [None] and not no_duplicates:
        return None
    chosen = [r for r in ranges if (only is None or r[0] in only) and (weights is None or weights.get(r[0], 0) > 0)]
    keys = dataset.examples.duplicate_keys() if no_duplicates else None
    return SourceBatchSampler([(start, stop) for _, start, stop in chosen], batch_size, world_size, seed,
                              weights=[weights[name] for name, _, _ in chosen] if weights else None,
                              duplicate_keys=keys, stage=stage, names=[name for name, _, _ in chosen])
