"""MatryoshkaLoss: a weighted sum of the inner loss on truncated, renormalised embeddings."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vembed.components import recipe_from_dict
from vembed.losses import build_loss
from vembed.losses.contrastive import InfoNCELoss, SigLIPLoss
from vembed.losses.matryoshka import MatryoshkaLoss

B, K, D = 4, 2, 8


def _unit(*shape: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(*shape, generator=generator), dim=-1)


def _cut(x: torch.Tensor, d: int) -> torch.Tensor:
    prefix = x[..., :d]
    return prefix / prefix.norm(dim=-1, keepdim=True)


@pytest.mark.parametrize(
    "inner", [InfoNCELoss(temperature=0.05), SigLIPLoss(temperature=0.1)], ids=["infonce", "siglip"]
)
@pytest.mark.parametrize("with_negatives", [False, True])
def test_matryoshka_equals_weighted_sum_of_inner_loss_on_truncated_renormalised_inputs(inner, with_negatives):
    q, p = _unit(B, D, seed=1), _unit(B, D, seed=2)
    n = _unit(B, K, D, seed=3) if with_negatives else None
    dims, weights = [2, 5, D], [0.25, 1.0, 2.0]  # includes the full size
    expected = sum(
        w * inner(_cut(q, d), _cut(p, d), _cut(n, d) if n is not None else None).item() for d, w in zip(dims, weights)
    )
    assert MatryoshkaLoss(inner, dims, weights)(q, p, n).item() == pytest.approx(expected, rel=1e-5)


def test_matryoshka_default_weights_are_all_one():
    q, p = _unit(B, D, seed=1), _unit(B, D, seed=2)
    inner = InfoNCELoss(temperature=0.05)
    expected = inner(_cut(q, 4), _cut(p, 4)) + inner(q, p)
    assert MatryoshkaLoss(inner, [4, D])(q, p).item() == pytest.approx(expected.item(), rel=1e-5)


def test_matryoshka_shares_the_inner_learnable_temperature_across_dims():
    q, p = _unit(B, D, seed=1), _unit(B, D, seed=2)
    inner = InfoNCELoss(temperature=0.05, learnable_temperature=True)
    wrapped = MatryoshkaLoss(inner, [4, D], [1.0, 0.5])
    assert [name for name, _ in wrapped.named_parameters()] == ["loss.log_scale"]
    wrapped(q, p).backward()
    summed = inner.log_scale.grad.clone()
    inner.log_scale.grad = None
    (inner(_cut(q, 4), _cut(p, 4)) + 0.5 * inner(q, p)).backward()
    assert summed.item() == pytest.approx(inner.log_scale.grad.item(), rel=1e-5)


def test_matryoshka_bf16_inputs_give_float32_loss_and_bf16_gradients():
    q, p = (_unit(B, D, seed=s).to(torch.bfloat16).requires_grad_() for s in (1, 2))
    loss = MatryoshkaLoss(InfoNCELoss(temperature=0.05), [4, D])(q, p)
    assert loss.dtype == torch.float32
    loss.backward()
    assert q.grad.dtype == torch.bfloat16


def test_matryoshka_rejects_bad_dims_and_weights():
    inner = InfoNCELoss()
    with pytest.raises(ValueError, match="one weight per dimension"):
        MatryoshkaLoss(inner, [4, 8], [1.0])
    with pytest.raises(ValueError, match="positive"):
        MatryoshkaLoss(inner, [0, 8])
    with pytest.raises(ValueError, match="exceed the embedding size 8"):
        MatryoshkaLoss(inner, [4, 16])(_unit(B, D, seed=1), _unit(B, D, seed=2))


def test_build_loss_wraps_the_recipe_loss_in_matryoshka_when_mrl_dims_set():
    loss = build_loss(recipe_from_dict(dict(loss_type="siglip", mrl_dims=[8, 4], mrl_weights=[1.0, 0.5])))
    assert isinstance(loss, MatryoshkaLoss) and isinstance(loss.loss, SigLIPLoss)
    assert loss.config["dims"] == [8, 4] and loss.config["weights"] == [1.0, 0.5]
    assert loss.config["loss"]["name"] == "SigLIPLoss"
