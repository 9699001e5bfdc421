"""What every reranker shares (vembed/reranking/pairs.py): a pair's parts as sides or list documents, and `score` of
lists of pairs in batches, in evaluation mode, in order, on a tiny module written here (no model weights)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vembed.data.records import Side
from vembed.reranking.pairs import PairScorer, as_side, pair_document


class LengthScorer(PairScorer, nn.Module):
    """Scores a pair as weight * (len(query) + 10 * len(document)); records each batch and the mode it ran in."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.tensor(2.0))
        self.batches: list[list[str]] = []
        self.modes: list[bool] = []

    def preprocess(self, queries, documents):
        self.batches.append(list(queries))
        return {"lengths": torch.tensor([len(q) + 10 * len(d) for q, d in zip(queries, documents)], dtype=torch.float)}

    def forward(self, batch):
        self.modes.append(self.training)
        if (batch["lengths"] < 0).any():
            raise RuntimeError("a failing forward")
        return self.weight * batch["lengths"]


def test_score_keeps_the_pairs_order_across_batches_in_evaluation_mode_and_restores_the_mode():
    model = LengthScorer()
    queries, documents = [f"q{'x' * i}" for i in range(5)], ["d" * i for i in range(5)]
    scores = model.score(queries, documents, batch_size=2)
    assert model.batches == [queries[:2], queries[2:4], queries[4:]]
    assert torch.equal(scores, 2.0 * torch.tensor([1.0 + i + 10 * i for i in range(5)]))
    assert scores.device.type == "cpu" and not scores.requires_grad  # scored without a graph
    assert model.modes == [False] * 3 and model.training  # evaluation mode while scoring, training mode after
    model.eval()
    model.score(queries, documents)
    assert model.modes[-1] is False and not model.training  # a model in evaluation mode stays in it


def test_score_batches_64_pairs_by_default():
    model = LengthScorer()
    model.score(["q"] * 130, ["d"] * 130)
    assert [len(batch) for batch in model.batches] == [64, 64, 2]


def test_score_restores_training_mode_when_the_forward_fails():
    model = LengthScorer()

    def failing(queries, documents):
        return {"lengths": -torch.ones(len(queries))}

    model.preprocess = failing
    with pytest.raises(RuntimeError, match="a failing forward"):
        model.score(["q"], ["d"])
    assert model.training


def test_score_of_no_pairs_is_empty_and_a_query_per_document_is_asked():
    model = LengthScorer()
    empty = model.score([], [])
    assert empty.shape == (0,) and model.batches == []
    with pytest.raises(ValueError, match="^2 queries for 1 documents; give one query per document$"):
        model.score(["a", "b"], ["c"])


def test_a_pairs_parts_as_sides_and_as_list_documents():
    side = Side(text="a red square", image="red.png", role="document")
    assert as_side(side, "query") is side  # a side keeps its own role and image
    assert as_side("a red square", "query") == Side(text="a red square", role="query")
    assert pair_document(side) is side  # an image: the side itself, for a reranker that reads images
    assert pair_document(Side(text="just text", role="document")) == "just text"
    assert pair_document(Side(text=None, image=None)) == ""
