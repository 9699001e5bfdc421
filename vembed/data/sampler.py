"""The training order: a fresh, reproducible permutation each epoch, the same on every rank."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class EpochShuffleSampler(Sampler[int]):
    """Yields a permutation of `range(num_samples)` drawn from a `torch.Generator` seeded with `seed + epoch`.

    Every rank builds the same sampler and gets the same order; accelerate's `BatchSamplerShard` then gives rank r
    the batches r, r + W, ... . The order depends only on (seed, epoch), never on global RNG state, so a resumed
    run replays it exactly. The loop calls `set_epoch` (accelerate's prepared DataLoader forwards its own
    `set_epoch` here) before iterating each epoch.
    """

    def __init__(self, num_samples: int, seed: int = 0):
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        self.num_samples = num_samples
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.num_samples, generator=generator).tolist())

    def __len__(self) -> int:
        return self.num_samples
