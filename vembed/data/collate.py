"""Batches of `Example`s -> the adapter's tensors, per side. Runs in DataLoader workers, so it stays picklable."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vembed.data.records import Example
from vembed.errors import DataError

if TYPE_CHECKING:
    from vembed.models.base import EmbeddingAdapter


class PairCollator:
    """`collate_fn` for `PairDataset`: a list of B examples with k hard negatives each becomes

    {"query": preprocess(B queries), "positive": preprocess(B positives),
     "negative": preprocess(B*k negatives, row-major: example 0's k, then example 1's, ...)  # only when k > 0
     "num_negatives": k,
     "labels": [B labels]}  # only when every example has a label

    A plain object holding the adapter (only its `preprocess` is called), so DataLoader workers can pickle it.
    """

    def __init__(self, adapter: "EmbeddingAdapter"):
        self.adapter = adapter

    def __call__(self, examples: Sequence[Example]) -> dict[str, Any]:
        if not examples:
            raise ValueError("PairCollator got an empty batch")
        counts = {len(example.negatives) for example in examples}
        if len(counts) > 1:
            odd = next(e for e in examples if len(e.negatives) != len(examples[0].negatives))
            raise DataError(
                f"records of one batch have different numbers of hard negatives {sorted(counts)}; "
                "load the split with one num_hard_negatives",
                file=odd.source,
                row=odd.row,
            )
        num_negatives = counts.pop()
        batch: dict[str, Any] = {
            "query": self.adapter.preprocess([example.query for example in examples]),
            "positive": self.adapter.preprocess([example.positive for example in examples]),
            "num_negatives": num_negatives,
        }
        if num_negatives:
            batch["negative"] = self.adapter.preprocess([side for example in examples for side in example.negatives])
        if all(example.label is not None for example in examples):
            batch["labels"] = [example.label for example in examples]
        return batch
