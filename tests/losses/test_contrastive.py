"""InfoNCE and SigLIP against plainly written reference computations (single process)."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.functional as F

from vembed.components import recipe_from_dict
from vembed.errors import RecipeError
from vembed.losses import LOSSES, build_loss
from vembed.losses.contrastive import MAX_LOGIT_SCALE, InfoNCELoss, SigLIPLoss

B, K, D = 5, 3, 8


def _unit(*shape: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(*shape, generator=generator), dim=-1)


def _batch(with_negatives: bool):
    return _unit(B, D, seed=1), _unit(B, D, seed=2), (_unit(B, K, D, seed=3) if with_negatives else None)


def _dot(a: torch.Tensor, b: torch.Tensor) -> float:
    return sum(float(x) * float(y) for x, y in zip(a, b))


def reference_infonce(q, p, n, temperature: float, symmetric: bool, labels=None) -> float:
    """Cross-entropy written out: row i's candidates are all positives, then every hard negative of every row; with
    labels, the other positives of row i's label are not candidates."""
    documents = list(p) + ([n[j, m] for j in range(n.shape[0]) for m in range(n.shape[1])] if n is not None else [])
    def same(i: int, j: int) -> bool:
        return labels is not None and j != i and j < len(p) and labels[i] == labels[j]

    forward = 0.0
    for i in range(len(q)):
        logits = [_dot(q[i], d) / temperature for j, d in enumerate(documents) if not same(i, j)]
        own = _dot(q[i], documents[i]) / temperature
        forward += -(own - math.log(sum(math.exp(x) for x in logits)))
    forward /= len(q)
    if not symmetric:
        return forward
    backward = 0.0
    for i in range(len(p)):
        logits = [_dot(p[i], query) / temperature for j, query in enumerate(q) if not same(i, j)]
        own = _dot(p[i], q[i]) / temperature
        backward += -(own - math.log(sum(math.exp(x) for x in logits)))
    backward /= len(p)
    return (forward + backward) / 2


def reference_siglip(q, p, n, scale: float, bias: float, labels=None) -> float:
    documents = list(p) + ([n[j, m] for j in range(n.shape[0]) for m in range(n.shape[1])] if n is not None else [])
    total = 0.0
    for i in range(len(q)):
        for j, d in enumerate(documents):
            if labels is not None and j != i and j < len(p) and labels[i] == labels[j]:
                continue
            z = 1.0 if j == i else -1.0
            total += -math.log(1.0 / (1.0 + math.exp(-z * (scale * _dot(q[i], d) + bias))))
    return total / len(q)


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("with_negatives", [False, True])
def test_infonce_matches_reference_cross_entropy(symmetric, with_negatives):
    q, p, n = _batch(with_negatives)
    loss = InfoNCELoss(temperature=0.07, symmetric=symmetric)(q, p, n)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert loss.item() == pytest.approx(reference_infonce(q, p, n, 0.07, symmetric), rel=1e-5)


def test_infonce_hard_negatives_add_columns_to_in_batch_negatives():
    q, p, _ = _batch(False)
    # Hard negatives equal to the positives of other rows: if they replaced the in-batch negatives the loss would
    # equal the plain one; as added columns each in-batch negative counts twice.
    shifted = torch.roll(p, shifts=1, dims=0).unsqueeze(1)
    loss_fn = InfoNCELoss(temperature=0.1, symmetric=False)
    with_negatives = loss_fn(q, p, shifted).item()
    assert with_negatives > loss_fn(q, p).item()
    assert with_negatives == pytest.approx(reference_infonce(q, p, shifted, 0.1, False), rel=1e-5)


def test_infonce_symmetric_ignores_hard_negatives_in_document_to_query_direction():
    q, p, n = _batch(True)
    both = InfoNCELoss(temperature=0.1, symmetric=True)(q, p, n).item()
    forward = InfoNCELoss(temperature=0.1, symmetric=False)(q, p, n).item()
    backward = reference_infonce(p, q, None, 0.1, False)  # documents -> queries, queries only as candidates
    assert both == pytest.approx((forward + backward) / 2, rel=1e-5)


def test_infonce_learnable_temperature_gets_gradient_and_fixed_one_is_frozen():
    q, p, n = _batch(True)
    learned = InfoNCELoss(temperature=0.05, learnable_temperature=True)
    learned(q, p, n).backward()
    assert learned.log_scale.grad is not None and learned.log_scale.grad.abs().item() > 0
    assert learned.log_scale.item() == pytest.approx(math.log(20.0))

    fixed = InfoNCELoss(temperature=0.05)
    assert [param for param in fixed.parameters() if param.requires_grad] == []
    assert "log_scale" in fixed.state_dict()  # the same checkpoint keys either way


def test_infonce_learned_scale_is_clamped_to_100_and_keeps_its_gradient():
    q, p, n = _batch(True)
    loss_fn = InfoNCELoss(temperature=0.05, learnable_temperature=True)
    with torch.no_grad():
        loss_fn.log_scale.fill_(math.log(1000.0))  # as if an optimiser step had overshot
    loss = loss_fn(q, p, n)
    assert loss_fn.log_scale.exp().item() == pytest.approx(MAX_LOGIT_SCALE, rel=1e-5)
    assert loss.item() == pytest.approx(reference_infonce(q, p, n, 1 / MAX_LOGIT_SCALE, True), rel=1e-4)
    loss.backward()
    assert loss_fn.log_scale.grad.abs().item() > 0  # a clamp inside the graph would have zeroed it


def test_infonce_rejects_learnable_temperature_below_the_cap():
    with pytest.raises(ValueError, match="cap"):
        InfoNCELoss(temperature=0.001, learnable_temperature=True)
    InfoNCELoss(temperature=0.001)  # a fixed temperature is used as given
    with pytest.raises(RecipeError, match="temperature"):
        build_loss(recipe_from_dict(dict(temperature=0.001, learnable_temperature=True)))


@pytest.mark.parametrize(
    "loss_fn", [InfoNCELoss(temperature=0.05), SigLIPLoss(temperature=0.1)], ids=["infonce", "siglip"]
)
def test_bf16_embeddings_are_scored_in_float32(loss_fn):
    q, p, n = (t.to(torch.bfloat16).requires_grad_() for t in _batch(True))
    loss = loss_fn(q, p, n)
    assert loss.dtype == torch.float32
    expected = loss_fn(q.detach().float(), p.detach().float(), n.detach().float())
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    loss.backward()
    assert q.grad.dtype == torch.bfloat16 and n.grad.abs().sum() > 0
    with torch.autocast("cpu", dtype=torch.bfloat16):  # mixed precision must not undo the upcast
        assert loss_fn(q, p, n).item() == pytest.approx(expected.item(), rel=1e-6)


@pytest.mark.parametrize("with_negatives", [False, True])
def test_siglip_matches_reference_sigmoid_loss(with_negatives):
    q, p, n = _batch(with_negatives)
    loss_fn = SigLIPLoss(temperature=0.1, learnable_temperature=True, bias_init=-3.0)
    loss = loss_fn(q, p, n)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert loss.item() == pytest.approx(reference_siglip(q, p, n, scale=10.0, bias=-3.0), rel=1e-5)


LABELS = torch.tensor([3, 1, 3, 7, 1])  # rows 0 and 2 share a class, and rows 1 and 4


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("with_negatives", [False, True])
def test_infonce_labels_drop_same_label_in_batch_negatives(symmetric, with_negatives):
    q, p, n = _batch(with_negatives)
    loss_fn = InfoNCELoss(temperature=0.1, symmetric=symmetric)
    masked = loss_fn(q, p, n, labels=LABELS).item()
    assert masked == pytest.approx(reference_infonce(q, p, n, 0.1, symmetric, LABELS.tolist()), rel=1e-5)
    assert abs(masked - loss_fn(q, p, n).item()) > 1e-4  # it does drop something
    # distinct labels drop nothing
    assert loss_fn(q, p, n, labels=torch.arange(B)).item() == pytest.approx(loss_fn(q, p, n).item(), rel=1e-6)


def test_infonce_labels_drop_same_label_query_query_and_document_document_columns():
    q, p, _ = _batch(False)
    plain = InfoNCELoss(temperature=0.1, symmetric=False, query_query=True, document_document=True)
    # one label for all: every in-batch column but the row's own positive is dropped, in all three blocks
    alone = plain(q, p, labels=torch.zeros(B, dtype=torch.int64))
    assert alone.item() == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("with_negatives", [False, True])
def test_siglip_labels_leave_same_label_pairs_out(with_negatives):
    q, p, n = _batch(with_negatives)
    loss_fn = SigLIPLoss(temperature=0.1, learnable_temperature=True, bias_init=-3.0)
    masked = loss_fn(q, p, n, labels=LABELS).item()
    assert masked == pytest.approx(reference_siglip(q, p, n, 10.0, -3.0, LABELS.tolist()), rel=1e-5)
    assert abs(masked - loss_fn(q, p, n).item()) > 1e-4


def test_siglip_bias_is_always_learned_and_scale_follows_learnable_temperature():
    q, p, n = _batch(True)
    learned = SigLIPLoss(temperature=0.1, learnable_temperature=True, bias_init=-10.0)
    learned(q, p, n).backward()
    assert learned.bias.grad.abs().item() > 0 and learned.log_scale.grad.abs().item() > 0

    fixed_scale = SigLIPLoss(temperature=0.1, learnable_temperature=False, bias_init=-10.0)
    fixed_scale(q, p, n).backward()
    assert fixed_scale.bias.grad.abs().item() > 0
    assert not fixed_scale.log_scale.requires_grad and fixed_scale.log_scale.grad is None


def test_losses_reject_mismatched_shapes():
    q, p, n = _batch(True)
    with pytest.raises(ValueError, match="query and positive"):
        InfoNCELoss()(q, p[:-1])
    with pytest.raises(ValueError, match="negatives"):
        SigLIPLoss()(q, p, n[:, :, :-1])


def test_from_recipe_builds_each_loss_by_name_with_recipe_values():
    recipe = recipe_from_dict(
        dict(loss_type="infonce", temperature=0.02, learnable_temperature=True, symmetric_loss=False)
    )
    infonce = build_loss(recipe)
    assert isinstance(infonce, InfoNCELoss) and LOSSES.get("infonce") is InfoNCELoss
    assert infonce.config == {
        "name": "InfoNCELoss",
        "loss_type": "infonce",
        "temperature": 0.02,
        "learnable_temperature": True,
        "symmetric": False,
        "false_negative_margin": None,
        "query_query": False,
        "document_document": False,
        "learned_temperature": pytest.approx(0.02),
    }
    siglip = build_loss(recipe_from_dict(dict(loss_type="siglip", temperature=0.1, siglip_bias_init=-5.0)))
    assert isinstance(siglip, SigLIPLoss) and LOSSES.get("siglip") is SigLIPLoss
    assert siglip.config["bias_init"] == -5.0 and siglip.config["learnable_temperature"] is False
    assert siglip.log_scale.exp().item() == pytest.approx(10.0) and siglip.bias.item() == -5.0


@pytest.mark.parametrize("cls", [InfoNCELoss, SigLIPLoss])
def test_constructor_defaults_are_the_recipe_defaults(cls):
    settings = cls.Settings()  # the loss's recipe keys, as a recipe that leaves them out has them
    keys = {
        "temperature": "temperature",
        "learnable_temperature": "learnable_temperature",
        "symmetric": "symmetric_loss",
        "bias_init": "siglip_bias_init",
        "query_query": "query_query_loss",
        "document_document": "document_document_loss",
    }
    for name, param in inspect.signature(cls).parameters.items():
        if name == "false_negative_margin":  # None (off) unless the recipe sets mask_false_negatives
            assert param.default is None and settings.mask_false_negatives is False
            continue
        assert param.default == getattr(settings, keys[name]), name
