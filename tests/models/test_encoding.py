"""Batch encoding (vembed/models/encoding.py): sides are encoded in length-sorted batches and come back in their own
order, with the embeddings file-order batches give and fewer padded token positions (counted from what the adapter
was actually given)."""

from __future__ import annotations

import random

import pytest
import torch

from vembed.data.records import Side
from vembed.models.encoding import encode_sides

WORDS = "a photo of red blue green square circle the number three written by hand small yellow star".split()


def _texts(n: int = 24, seed: int = 0) -> list[str]:
    """Mostly short texts with a long one (past the 16-token limit) in every run of four: file-order batches of four
    each pad to the long one."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(12 if i % 4 == 0 else rng.choice([1, 2]))) for i in range(n)]


class Counting:
    """Wraps an adapter's `encode`, adding up the token positions (attention mask cells) and rows it is given."""

    def __init__(self, adapter):
        self.positions, self.rows, inner = 0, 0, adapter.encode

        def encode(inputs):
            self.positions += inputs["attention_mask"].numel()
            self.rows += len(inputs["attention_mask"])
            return inner(inputs)

        adapter.encode = encode


def test_sides_are_encoded_in_length_sorted_batches_with_the_embeddings_of_file_order(build):
    adapter = build("text")
    sides = [Side(text=t) for t in _texts()]
    counted = Counting(adapter)
    with torch.no_grad():  # file order, batch by batch, as encode_sides did before sorting
        file_order = torch.cat([adapter(adapter.preprocess(sides[i: i + 4])).float() for i in range(0, len(sides), 4)])
    unsorted_positions = counted.positions
    counted.positions = counted.rows = 0
    sorted_order = encode_sides(adapter, sides, batch_size=4)
    torch.testing.assert_close(sorted_order, file_order, atol=1e-6, rtol=0)
    assert counted.rows == len(sides)
    # 244 of 384 positions when written
    assert counted.positions < 0.7 * unsorted_positions, (counted.positions, unsorted_positions)


def test_adapters_whose_output_depends_on_padding_keep_file_order(build):
    adapter = build("siglip")  # pools the last position of max_length padding: never reordered
    sides = [Side(text=t) for t in _texts(8)]
    with torch.no_grad():
        file_order = torch.cat([adapter(adapter.preprocess(sides[i: i + 3])).float() for i in range(0, 8, 3)])
    torch.testing.assert_close(encode_sides(adapter, sides, batch_size=3), file_order, atol=1e-6, rtol=0)


class CharacterVectors(torch.nn.Module):
    """A stand-in token-vector adapter: one L2-normalised vector per character of a side's text, zero vectors past
    its end (the `vembed.models.token_vectors` contract), so each batch is as long as its longest text."""

    embedding_dim = 4

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(1)
        self.weight = torch.nn.Parameter(torch.randn(128, self.embedding_dim, generator=generator))

    def preprocess(self, sides):
        longest = max(len(side.text) for side in sides)
        codes = torch.zeros(len(sides), longest, dtype=torch.long)
        mask = torch.zeros(len(sides), longest)
        for row, side in enumerate(sides):
            codes[row, : len(side.text)] = torch.tensor([ord(char) % 128 for char in side.text])
            mask[row, : len(side.text)] = 1
        return {"codes": codes, "mask": mask}

    def forward(self, inputs):
        return torch.nn.functional.normalize(self.weight[inputs["codes"]], dim=-1) * inputs["mask"][..., None]


SHORT_AND_LONG = [Side(text=text) for text in ["ab", "a long text", "abc", "a", "the longest text of all"]]


def _token_vectors_on_ranks(out_file: str) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    vectors = encode_sides(CharacterVectors(), SHORT_AND_LONG, accelerator=accelerator, batch_size=2)
    if accelerator.is_main_process:
        torch.save(vectors, out_file)


@pytest.mark.slow  # starts 2 processes
def test_two_ranks_gather_token_vectors_of_other_lengths_as_one_process_encodes_them(tmp_path):
    """Each rank's share pads to its own longest side (rank 0: 11 tokens, rank 1: 23): the shares are padded with zero
    vectors to one length before the gather (gloo aborted on the sizes, ending a 2-rank ColQwen run's evaluation)."""
    from ranks import run_on_ranks

    run_on_ranks(_token_vectors_on_ranks, str(tmp_path / "vectors.pt"), world=2, timeout=120)
    expected = encode_sides(CharacterVectors(), SHORT_AND_LONG, batch_size=2)
    assert expected.shape == (5, 23, 4)
    torch.testing.assert_close(torch.load(tmp_path / "vectors.pt", weights_only=True), expected, rtol=0, atol=0)
