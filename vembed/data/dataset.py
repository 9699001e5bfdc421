"""The map-style dataset the loop iterates: records with their images decoded, corrupt images skipped and counted."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.utils.data import Dataset, get_worker_info

from vembed.data.images import load_image
from vembed.data.records import Example, Side
from vembed.errors import DataError

if TYPE_CHECKING:
    from vembed.data.image_cache import ImageCache

logger = logging.getLogger(__name__)

_COUNTER_SLOTS = 257  # the training process and up to 256 DataLoader workers, each writing only its own row
SKIPS_SHOWN = 3  # "skipping ..." lines per process; the rest are counted (the run's stop line and metrics.json)


@dataclass(frozen=True)
class DecodeCounts:
    """Records fetched and records replaced because their images would not decode, over every worker."""

    fetched: int
    replaced: int
    first_bad: int | None  # index of a replaced record, for messages


class PairDataset(Dataset):
    """`Example`s (a list, or the records `load_rows` makes on fetch) whose `__getitem__` returns a copy with every
    image decoded to RGB PIL.

    A record whose image cannot be decoded (a corrupt or truncated file: missing files were already skipped by
    `load_examples`) is replaced by the next record that decodes, searching forward and wrapping around, at most
    `max_substitutions` records away; the substitute depends only on the index, so every epoch and every worker picks
    the same one. `decode_failures` counts the distinct bad records this process has met (each DataLoader worker
    keeps its own count); `decode_counts()` counts fetches and replacements in every worker, through shared memory.
    `num_negatives`: the hard negatives each record keeps; None keeps what the records hold (`load_rows` has already
    cut them to one number per source). `image_cache`: image files found there come back as their cached pixels
    (`CachedPixels`, resized once, see vembed/data/image_cache.py) instead of decoded PIL images; an image that did
    not decode when the cache was built raises the same error here, so it is replaced and counted as without a cache.
    """

    def __init__(self, examples: Sequence[Example], num_negatives: int | None = None, max_substitutions: int = 64,
                 image_cache: "ImageCache | None" = None):
        for example in examples if num_negatives is not None else ():
            if len(example.negatives) < num_negatives:
                raise DataError(
                    f"record has {len(example.negatives)} hard negatives, the dataset needs {num_negatives}; "
                    "load the split with num_hard_negatives set",
                    file=example.source,
                    row=example.row,
                )
        self.examples = examples
        self.num_negatives = num_negatives
        self.max_substitutions = max_substitutions
        self.image_cache = image_cache
        self._bad: set[int] = set()
        # Per process (row 0: the one that built the dataset; 1+: DataLoader worker id + 1): fetched, replaced, first
        # replaced index + 1. Shared memory, so counts made in forked or spawned workers reach the training loop.
        self._counts = torch.zeros(_COUNTER_SLOTS, 3, dtype=torch.int64).share_memory_()

    def source_ranges(self) -> list[tuple[str | None, int, int]]:
        """(name, first index, one past the last) of each named source; one unnamed range without named sources."""
        ranges = getattr(self.examples, "source_ranges", None)
        return ranges() if ranges is not None else [(None, 0, len(self.examples))]

    @property
    def decode_failures(self) -> int:
        return len(self._bad)

    def decode_counts(self) -> DecodeCounts:
        fetched, replaced = (int(v) for v in self._counts[:, :2].sum(dim=0))
        marked = self._counts[:, 2][self._counts[:, 2] > 0]
        return DecodeCounts(fetched, replaced, int(marked[0]) - 1 if len(marked) else None)

    def decode_error(self, index: int) -> str | None:
        """Why record `index` cannot be used (its image's decode error), or None when it decodes."""
        try:
            self._decoded(self.examples[index])
        except DataError as err:
            return err.args[0]
        return None

    def _count(self, index: int, replaced: bool) -> None:
        worker = get_worker_info()
        row = self._counts[0 if worker is None else 1 + worker.id % (_COUNTER_SLOTS - 1)]
        row[0] += 1
        if replaced:
            row[1] += 1
            if row[2] == 0:
                row[2] = index + 1

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> Example:
        size = len(self.examples)
        if not -size <= index < size:
            raise IndexError(f"index {index} out of range for {size} records")
        index %= size
        first_error: DataError | None = None
        for step in range(min(size, self.max_substitutions + 1)):
            candidate = (index + step) % size
            if candidate in self._bad:
                continue
            try:
                decoded = self._decoded(self.examples[candidate])
            except DataError as err:
                self._bad.add(candidate)
                first_error = first_error or err
                self._warn_skipped(self.examples[candidate], err)
                continue
            self._count(index, replaced=candidate != index)
            return decoded
        tried = min(size, self.max_substitutions + 1)
        start = self.examples[index]
        raise DataError(
            f"none of the {tried} records from here on has images that decode (first: {first_error}); "
            "check the image files",
            file=start.source,
            row=start.row,
        )

    def _warn_skipped(self, example: Example, err: DataError) -> None:
        """The first few skipped records by name, then one line: a corrupt folder would print a line per row."""
        if len(self._bad) <= SKIPS_SHOWN:
            logger.warning("skipping %s, row %s: %s", example.source, example.row, err)
        elif len(self._bad) == SKIPS_SHOWN + 1:
            logger.warning("skipping more records whose images do not decode, without a line each: they are counted "
                           "against data.max_bad_fraction and in metrics.json (train.decode_failures)")

    def _decoded(self, example: Example) -> Example:
        negatives = [self._decoded_side(side) for side in example.negatives[: self.num_negatives]]
        score = example.score[: 1 + len(negatives)] if isinstance(example.score, list) else example.score
        return dataclasses.replace(example, query=self._decoded_side(example.query),
                                   positive=self._decoded_side(example.positive), negatives=negatives, score=score)

    def _decoded_side(self, side: Side) -> Side:
        if side.image is None:
            return side
        load = self._load
        images = [load(image) for image in side.image] if isinstance(side.image, list) else load(side.image)
        return dataclasses.replace(side, image=images)

    def _load(self, image):
        cache = self.image_cache
        if cache is not None and isinstance(image, str) and image in cache:
            return cache.pixels(image)
        return load_image(image)
