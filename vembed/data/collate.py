"""Batches of `Example`s -> the adapter's tensors, per side. Runs in DataLoader workers, so it stays picklable."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vembed.data.records import Example
from vembed.errors import DataError

if TYPE_CHECKING:
    import torch

    from vembed.data.teacher_embeddings import TeacherEmbeddings
    from vembed.models.base import EmbeddingAdapter


class PairCollator:
    """`collate_fn` for `PairDataset`: a list of B examples with k hard negatives each becomes

    {"query": preprocess(B queries), "positive": preprocess(B positives),
     "negative": preprocess(B*k negatives, row-major: example 0's k, then example 1's, ...)  # only when k > 0
     "num_negatives": k,
     "labels": [B labels],                  # only when every example has a label
     "label_ids": LongTensor (B,),           # the same, as ids equal on every rank (labels=True): the loss masks
                                             # in-batch negatives that share the row's label
     "scores": FloatTensor (B,) or (B, 1+k), # data.columns.score, only when every example has one
     "teacher": FloatTensor (B, d),          # a teacher's extracted embeddings of the rows (teacher=)
     "source": name}                         # the named source every example of the batch came from, if any

    A plain object holding the adapter (only its `preprocess` is called), so DataLoader workers can pickle it.
    """

    def __init__(self, adapter: "EmbeddingAdapter", labels: bool = False, guide: "EmbeddingAdapter | None" = None,
                 teacher: "TeacherEmbeddings | None" = None):
        self.adapter = adapter
        self.labels = labels
        self.guide = guide  # GISTEmbed's guide model: each side preprocessed for it too, under "guide"
        self.teacher = teacher  # embedding_mse: the teacher's vectors, looked up by each record's file and row

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
        if self.guide is not None:
            sides = {"query": [e.query for e in examples], "positive": [e.positive for e in examples]}
            if num_negatives:
                sides["negative"] = [side for example in examples for side in example.negatives]
            batch["guide"] = {name: self.guide.preprocess(found) for name, found in sides.items()}
        if all(example.label is not None for example in examples):
            batch["labels"] = [example.label for example in examples]
            if self.labels:
                batch["label_ids"] = label_ids(batch["labels"])
        if all(example.score is not None for example in examples):
            batch["scores"] = score_tensor(examples)
        if self.teacher is not None:
            batch["teacher"] = self.teacher.lookup(examples)
        names = {example.source_name for example in examples}
        if len(names) == 1 and None not in names:
            batch["source"] = names.pop()
        return batch


def score_tensor(examples: Sequence[Example]) -> "torch.Tensor":
    """The examples' scores as float32: (B,) for one number each, (B, m) for lists of m teacher scores."""
    import torch

    def shape(example: Example) -> int | None:
        return len(example.score) if isinstance(example.score, list) else None

    first = shape(examples[0])
    odd = next((example for example in examples if shape(example) != first), None)
    if odd is not None:
        raise DataError("records of one batch have scores of different shapes (a number and a list, or lists of "
                        "different lengths); give every row of data.columns.score the same shape", file=odd.source,
                        row=odd.row)
    return torch.tensor([example.score for example in examples], dtype=torch.float32)


def label_ids(labels: Sequence[str]) -> "torch.Tensor":
    """Labels as int64 ids that are equal on every rank for equal labels (a stable digest, not Python's salted
    `hash`), so the loss can compare labels gathered from other ranks."""
    import torch

    ids = [int.from_bytes(hashlib.blake2b(label.encode(), digest_size=8).digest(), "little", signed=True)
           for label in labels]
    return torch.tensor(ids, dtype=torch.int64)
