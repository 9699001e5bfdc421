"""vembed/data/collate.py: examples -> per-side adapter inputs."""

from __future__ import annotations

import pickle

import pytest
import torch

from vembed.data.collate import PairCollator
from vembed.data.records import Example, Side
from vembed.errors import DataError


class CountingAdapter:
    """Stands in for an adapter: preprocess returns how many sides it got, and their texts (to check the order)."""

    def preprocess(self, sides):
        return {"n": torch.tensor(len(sides)), "texts": [side.text for side in sides]}


def _example(i, k, label=None):
    return Example(Side(text=f"q{i}"), Side(text=f"p{i}"), [Side(text=f"n{i}.{j}") for j in range(k)], label=label)


def test_batch_has_each_side_and_row_major_negatives():
    batch = PairCollator(CountingAdapter())([_example(0, 2, "a"), _example(1, 2, "b"), _example(2, 2, "a")])
    assert batch["query"]["n"].item() == 3 and batch["positive"]["texts"] == ["p0", "p1", "p2"]
    assert batch["negative"]["n"].item() == 6
    assert batch["negative"]["texts"] == ["n0.0", "n0.1", "n1.0", "n1.1", "n2.0", "n2.1"]
    assert batch["num_negatives"] == 2 and batch["labels"] == ["a", "b", "a"]


def test_no_negatives_and_partial_labels_leave_those_keys_out():
    batch = PairCollator(CountingAdapter())([_example(0, 0, "a"), _example(1, 0)])
    assert batch["num_negatives"] == 0 and "negative" not in batch and "labels" not in batch


def test_uneven_negatives_are_a_data_error():
    with pytest.raises(DataError, match=r"different numbers of hard negatives \[1, 2\]"):
        PairCollator(CountingAdapter())([_example(0, 2), _example(1, 1)])


def test_collator_pickles_for_dataloader_workers():
    collator = pickle.loads(pickle.dumps(PairCollator(CountingAdapter())))
    assert collator([_example(0, 1)])["negative"]["n"].item() == 1


def test_label_ids_are_equal_for_equal_labels_in_any_process():
    examples = [_example(0, 0, "a"), _example(1, 0, "b"), _example(2, 0, "a")]
    batch = PairCollator(CountingAdapter(), labels=True)(examples)
    ids = batch["label_ids"]
    assert ids.dtype == torch.int64 and ids[0] == ids[2] and ids[0] != ids[1]
    # a stable digest, not Python's per-process salted hash: another interpreter gives the same ids
    import subprocess
    import sys

    code = "from vembed.data.collate import label_ids; print(label_ids(['a', 'b']).tolist())"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert other.stdout.strip() == str([ids[0].item(), ids[1].item()])
    assert "label_ids" not in PairCollator(CountingAdapter())([_example(0, 0, "a")])  # masking off


def test_a_batch_from_one_named_source_carries_its_name():
    examples = [_example(i, 0) for i in range(2)]
    for example in examples:
        example.source_name = "captions"
    assert PairCollator(CountingAdapter())(examples)["source"] == "captions"
    examples[1].source_name = "shapes"
    assert "source" not in PairCollator(CountingAdapter())(examples)
