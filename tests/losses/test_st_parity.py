"""Each loss equals sentence-transformers' implementation on the same embeddings and batch: value and gradient with
respect to the embeddings, to 1e-6 (float64).

sentence-transformers' losses own a model; here that model is a stand-in that returns fixed embeddings for each
column (`ColumnModel`), so its `forward(features, labels)` runs unchanged on exactly the tensors ours receives.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

st_losses = pytest.importorskip("sentence_transformers.sentence_transformer.losses")

from vembed.losses.scored import AnglELoss, CoSENTLoss, CosineSimilarityLoss, DistillKLDivLoss, MarginMSELoss  # noqa: E402
from vembed.losses.triplet import BatchHardTripletLoss, TripletLoss  # noqa: E402

B, K, D = 6, 3, 10
TOLERANCE = 1e-6


class ColumnModel(nn.Module):
    """Stands in for a SentenceTransformer: the features of column i are `{"column": i}` and its embedding is the
    i-th fixed tensor."""

    def __init__(self, columns: list[torch.Tensor]):
        super().__init__()
        self.columns = columns

    def forward(self, features: dict) -> dict:
        return {"sentence_embedding": self.columns[int(features["column"])]}


def _leaves(seed: int, unit: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    q, p = torch.randn(B, D, generator=generator, dtype=torch.float64), torch.randn(B, D, generator=generator,
                                                                                   dtype=torch.float64)
    n = torch.randn(B, K, D, generator=generator, dtype=torch.float64)
    if unit:
        q, p, n = F.normalize(q, dim=-1), F.normalize(p, dim=-1), F.normalize(n, dim=-1)
    return q.requires_grad_(), p.requires_grad_(), n.requires_grad_()


def _ours(loss, q, p, n, **kwargs):
    value = loss(q, p, n, **kwargs)
    grads = torch.autograd.grad(value, [t for t in (q, p, n) if t is not None], allow_unused=True)
    return value.detach(), grads


def _theirs(make, columns, labels, leaves, model=None):
    loss = make(model if model is not None else ColumnModel(columns))
    value = loss([{"column": i} for i in range(len(columns))], labels)
    grads = torch.autograd.grad(value, leaves, allow_unused=True)
    return value.detach(), grads


def _assert_same(ours, theirs):
    (value, grads), (their_value, their_grads) = ours, theirs
    assert abs(value.item() - their_value.item()) <= TOLERANCE * max(1.0, abs(their_value.item()))
    for mine, other in zip(grads, their_grads):
        mine = torch.zeros(()) if mine is None else mine
        other = torch.zeros(()) if other is None else other
        assert (mine - other).abs().max().item() <= TOLERANCE, (mine, other)


# Gold scores with ties (CoSENT ranks only pairs whose scores differ).
SCORES = torch.tensor([0.9, 0.1, 0.5, 0.5, 0.0, 0.75], dtype=torch.float64)


@pytest.mark.parametrize("ours, theirs", [
    (lambda: CoSENTLoss(scale=20.0), lambda m: st_losses.CoSENTLoss(m, scale=20.0)),
    (lambda: CoSENTLoss(scale=7.0), lambda m: st_losses.CoSENTLoss(m, scale=7.0)),
    (lambda: AnglELoss(scale=20.0), lambda m: st_losses.AnglELoss(m, scale=20.0)),
    (lambda: CosineSimilarityLoss(), lambda m: st_losses.CosineSimilarityLoss(m)),
], ids=["cosent", "cosent_scale7", "angle", "cosine_mse"])
@pytest.mark.parametrize("unit", [True, False], ids=["unit", "raw"])
def test_pair_score_losses_equal_sentence_transformers(ours, theirs, unit):
    q, p, _ = _leaves(0, unit)
    _assert_same(_ours(ours(), q, p, None, scores=SCORES), _theirs(theirs, [q, p], SCORES, [q, p]))


def test_angle_with_an_odd_embedding_size_equals_sentence_transformers():
    q, p, _ = _leaves(1)
    q, p = q.detach()[:, :7].requires_grad_(), p.detach()[:, :7].requires_grad_()
    _assert_same(_ours(AnglELoss(), q, p, None, scores=SCORES),
                 _theirs(lambda m: st_losses.AnglELoss(m), [q, p], SCORES, [q, p]))


@pytest.mark.parametrize("distance", ["euclidean", "cosine", "manhattan"])
@pytest.mark.parametrize("margin", [0.3, 5.0])
def test_triplet_equals_sentence_transformers(distance, margin):
    q, p, n = _leaves(2)
    n1 = n.detach()[:, :1].clone().requires_grad_()
    metric = getattr(st_losses.TripletDistanceMetric, distance.upper())
    theirs = _theirs(lambda m: st_losses.TripletLoss(m, distance_metric=metric, triplet_margin=margin),
                     [q, p, n1[:, 0]], None, [q, p, n1])
    _assert_same(_ours(TripletLoss(margin, distance), q, p, n1), theirs)


@pytest.mark.parametrize("distance", ["euclidean", "squared_euclidean", "cosine"])
@pytest.mark.parametrize("margin", [0.2, 5.0])
def test_batch_hard_triplet_equals_sentence_transformers_on_queries_and_positives(distance, margin):
    q, p, _ = _leaves(3)
    labels = torch.tensor([0, 1, 0, 2, 1, 0])
    functions = st_losses.BatchHardTripletLossDistanceFunction
    metric = {"euclidean": functions.euclidean_distance, "cosine": functions.cosine_distance,
              "squared_euclidean": lambda e: functions.euclidean_distance(e, squared=True)}[distance]
    stacked = torch.cat([q, p])  # ours: every query and every positive, each with its row's label
    theirs = _theirs(lambda m: st_losses.BatchHardTripletLoss(m, distance_metric=metric, margin=margin),
                     [stacked], torch.cat([labels, labels]), [q, p])
    _assert_same(_ours(BatchHardTripletLoss(margin, distance), q, p, None, labels=labels), theirs)


def _teacher(seed: int) -> torch.Tensor:
    return torch.randn(B, 1 + K, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_margin_mse_with_teacher_score_lists_equals_sentence_transformers():
    q, p, n = _leaves(4)
    scores = _teacher(5)
    columns = [q, p] + [n[:, j] for j in range(K)]
    _assert_same(_ours(MarginMSELoss(), q, p, n, scores=scores),
                 _theirs(lambda m: st_losses.MarginMSELoss(m), columns, scores, [q, p, n]))


def test_margin_mse_with_one_margin_per_pair_equals_sentence_transformers():
    q, p, n = _leaves(6)
    n1 = n.detach()[:, :1].clone().requires_grad_()
    margins = _teacher(7)[:, 0]
    _assert_same(_ours(MarginMSELoss(), q, p, n1, scores=margins),
                 _theirs(lambda m: st_losses.MarginMSELoss(m), [q, p, n1[:, 0]], margins, [q, p, n1]))


@pytest.mark.parametrize("temperature, teacher_temperature", [(1.0, None), (0.05, None), (0.05, 2.0)])
def test_distill_kl_equals_sentence_transformers(temperature, teacher_temperature):
    q, p, n = _leaves(8)
    scores = _teacher(9)
    columns = [q, p] + [n[:, j] for j in range(K)]
    theirs = _theirs(lambda m: st_losses.DistillKLDivLoss(m, temperature=temperature,
                                                          teacher_temperature=teacher_temperature),
                     columns, scores, [q, p, n])
    _assert_same(_ours(DistillKLDivLoss(temperature, teacher_temperature), q, p, n, scores=scores), theirs)


@pytest.mark.parametrize("loss_type, keys, expected", [
    ("cosent", {"cosent_scale": 10.0}, CoSENTLoss), ("angle", {}, AnglELoss), ("cosine_mse", {}, CosineSimilarityLoss),
    ("triplet", {"triplet_margin": 0.5, "triplet_distance": "cosine"}, TripletLoss),
    ("batch_hard_triplet", {"batch_hard_distance": "squared_euclidean"}, BatchHardTripletLoss),
    ("margin_mse", {}, MarginMSELoss), ("distill_kl", {"teacher_temperature": 2.0}, DistillKLDivLoss),
])
def test_a_recipe_names_each_loss_and_its_own_keys(loss_type, keys, expected):
    from vembed.components import recipe_from_dict
    from vembed.losses import build_loss

    loss = build_loss(recipe_from_dict({"model_type": "text", "model_name": "x", "loss_type": loss_type, **keys}))
    assert type(loss) is expected
    assert all(value in loss.config.values() for value in keys.values())


class GuidedColumnModel(ColumnModel):
    """A ColumnModel with what sentence-transformers' GISTEmbedLoss asks of a model and its guide: a transformers
    tokenizer (the same one for both, so nothing is retokenised) and a max_seq_length."""

    def __init__(self, columns, tokenizer):
        super().__init__(columns)
        self.tokenizer, self.max_seq_length = tokenizer, 16


@pytest.mark.parametrize("strategy, margin", [("absolute", 0.0), ("absolute", 0.1), ("relative", 0.05)])
@pytest.mark.parametrize("anchors, positives", [(True, True), (False, False)])
@pytest.mark.parametrize("with_negative", [True, False])
def test_gist_equals_sentence_transformers(tiny_tokenizer_dir, strategy, margin, anchors, positives, with_negative):
    from transformers import AutoTokenizer

    from vembed.losses.gist import GISTEmbedLoss

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    q, p, n = _leaves(10)
    n1 = n.detach()[:, :1].clone().requires_grad_()
    gq, gp, gn = (t.detach() for t in _leaves(11))
    # The guide sees the rows close to how the model does, so some candidates score above the positive
    gq, gp, gn1 = gq + 2 * q.detach(), gp + 2 * p.detach(), gn[:, :1] + 2 * n1.detach()
    columns, guide_columns, leaves = [q, p], [gq, gp], [q, p]
    if with_negative:
        columns, guide_columns, leaves = columns + [n1[:, 0]], guide_columns + [gn1[:, 0]], leaves + [n1]
    theirs = _theirs(lambda m: st_losses.GISTEmbedLoss(
        m, GuidedColumnModel(guide_columns, tokenizer), temperature=0.05, margin_strategy=strategy, margin=margin,
        contrast_anchors=anchors, contrast_positives=positives), columns, None, leaves,
        GuidedColumnModel(columns, tokenizer))
    ours = GISTEmbedLoss(0.05, strategy, margin, anchors, positives)
    value = ours(q, p, n1 if with_negative else None, guide=(gq, gp, gn1 if with_negative else None))
    grads = torch.autograd.grad(value, leaves)
    _assert_same((value.detach(), grads), theirs)
