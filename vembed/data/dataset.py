"""The map-style dataset the loop iterates: records with their images decoded, corrupt images skipped and counted."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from torch.utils.data import Dataset

from vembed.data.images import load_image
from vembed.data.records import Example, Side
from vembed.errors import DataError

logger = logging.getLogger(__name__)


class PairDataset(Dataset):
    """`Example`s (a list, or the records `load_rows` makes on fetch) whose `__getitem__` returns a copy with every
    image decoded to RGB PIL.

    A record whose image cannot be decoded (a corrupt or truncated file: missing files were already skipped by
    `load_examples`) is replaced by the next record that decodes, searching forward and wrapping around, at most
    `max_substitutions` records away; the substitute depends only on the index, so every epoch and every worker picks
    the same one. `decode_failures` counts the distinct bad records this process has met (each DataLoader worker
    keeps its own count). `num_negatives`: the hard negatives each record keeps; None keeps what the records hold
    (`load_rows` has already cut them to one number per source).
    """

    def __init__(self, examples: Sequence[Example], num_negatives: int | None = None, max_substitutions: int = 64):
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
        self._bad: set[int] = set()

    def source_ranges(self) -> list[tuple[str | None, int, int]]:
        """(name, first index, one past the last) of each named source; one unnamed range without named sources."""
        ranges = getattr(self.examples, "source_ranges", None)
        return ranges() if ranges is not None else [(None, 0, len(self.examples))]

    @property
    def decode_failures(self) -> int:
        return len(self._bad)

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
                return self._decoded(self.examples[candidate])
            except DataError as err:
                self._bad.add(candidate)
                first_error = first_error or err
                example = self.examples[candidate]
                logger.warning("skipping %s, row %s: %s", example.source, example.row, err)
        tried = min(size, self.max_substitutions + 1)
        start = self.examples[index]
        raise DataError(
            f"none of the {tried} records from here on has images that decode (first: {first_error}); "
            "check the image files",
            file=start.source,
            row=start.row,
        )

    def _decoded(self, example: Example) -> Example:
        return Example(
            query=_decoded_side(example.query),
            positive=_decoded_side(example.positive),
            negatives=[_decoded_side(side) for side in example.negatives[: self.num_negatives]],
            label=example.label,
            row=example.row,
            source=example.source,
            source_name=example.source_name,
        )


def _decoded_side(side: Side) -> Side:
    if side.image is None:
        return side
    images = [load_image(image) for image in side.image] if isinstance(side.image, list) else load_image(side.image)
    return dataclasses.replace(side, image=images)
