"""InfoNCE's false-negative masking and query-query / document-document terms (the Qwen3-(VL-)Embedding recipe's
loss), against the loss written out term by term as in the Qwen3-Embedding report."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from vembed.components import recipe_from_dict
from vembed.errors import RecipeError
from vembed.losses import build_loss
from vembed.losses.contrastive import InfoNCELoss

B, K, D, TEMPERATURE = 6, 2, 8, 0.1


def _unit(*shape: int, seed: int) -> torch.Tensor:
    return F.normalize(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)), dim=-1)


def _dot(a, b) -> float:
    return sum(float(x) * float(y) for x, y in zip(a, b))


def reference(q, p, n, margin, query_query, document_document, symmetric) -> float:
    """Z_i = e^{s(q_i,p_i)} + sum of kept e^{s} over: every other positive and every hard negative (q_i vs them),
    other queries (q_i vs q_j), other positives (p_i vs p_j); a negative is dropped when s > s(q_i,p_i) + margin."""

    def row_loss(anchor_scores: list[float], positive: float) -> float:
        kept = [s for s in anchor_scores if margin is None or s <= positive + margin]
        return -(positive / TEMPERATURE - math.log(sum(math.exp(s / TEMPERATURE) for s in [positive, *kept])))

    hard = [n[j, m] for j in range(len(q)) for m in range(n.shape[1])] if n is not None else []
    forward = 0.0
    for i in range(len(q)):
        negatives = [_dot(q[i], p[j]) for j in range(len(q)) if j != i] + [_dot(q[i], h) for h in hard]
        if query_query:
            negatives += [_dot(q[i], q[j]) for j in range(len(q)) if j != i]
        if document_document:
            negatives += [_dot(p[i], p[j]) for j in range(len(q)) if j != i]
        forward += row_loss(negatives, _dot(q[i], p[i]))
    forward /= len(q)
    if not symmetric:
        return forward
    others = [[_dot(p[i], q[j]) for j in range(len(q)) if j != i] for i in range(len(q))]
    reverse = sum(row_loss(others[i], _dot(p[i], q[i])) for i in range(len(q)))
    return (forward + reverse / len(q)) / 2


@pytest.mark.parametrize("margin", [None, 0.1, 0.0])
@pytest.mark.parametrize("query_query,document_document", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("symmetric", [False, True])
def test_options_match_the_loss_written_out(margin, query_query, document_document, symmetric):
    q, p, n = _unit(B, D, seed=1), _unit(B, D, seed=2), _unit(B, K, D, seed=3)
    loss = InfoNCELoss(TEMPERATURE, symmetric=symmetric, false_negative_margin=margin, query_query=query_query,
                       document_document=document_document)(q, p, n)
    expected = reference(q, p, n, margin, query_query, document_document, symmetric)
    assert loss.item() == pytest.approx(expected, rel=1e-5)


def test_masking_really_drops_columns_and_keeps_the_positive():
    # Random unit vectors in 8-d: some negatives score above positive + 0.1 (else this test would prove nothing).
    q, p = _unit(B, D, seed=1), _unit(B, D, seed=2)
    scores = q @ p.T
    assert (scores > scores.diag().unsqueeze(1) + 0.1).any()
    masked = InfoNCELoss(TEMPERATURE, symmetric=False, false_negative_margin=0.1)(q, p)
    plain = InfoNCELoss(TEMPERATURE, symmetric=False)(q, p)
    assert masked < plain
    # A positive that is not the best column is still scored: the loss stays finite with every option on.
    everything = InfoNCELoss(TEMPERATURE, false_negative_margin=0.0, query_query=True, document_document=True)
    loss = everything(q.requires_grad_(), p)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(q.grad).all()


def test_recipe_keys_build_the_options():
    recipe = recipe_from_dict({"mask_false_negatives": True, "query_query_loss": True, "document_document_loss": True})
    loss = build_loss(recipe)
    assert (loss.false_negative_margin, loss.query_query, loss.document_document) == (0.1, True, True)
    with pytest.raises(RecipeError, match="false_negative_margin: does nothing unless mask_false_negatives"):
        recipe_from_dict({"false_negative_margin": 0.3})  # a margin that would mask nothing is refused
