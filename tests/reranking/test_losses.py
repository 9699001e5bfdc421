"""Ranking losses against sentence-transformers' CrossEncoder losses on the same logits: value and gradient to 1e-6.

sentence-transformers' losses call their model; a stub CrossEncoder returns fixed logits (as a leaf tensor whose
gradient is compared with ours)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vembed.reranking.losses import LambdaLoss, ListwiseSoftmaxLoss, PointwiseBCELoss


def _stub(logits: torch.Tensor):
    from sentence_transformers.cross_encoder import CrossEncoder

    class FixedLogits(CrossEncoder):
        """A CrossEncoder that scores every pair it is given with the next of `logits`, in order."""

        def __init__(self):
            nn.Module.__init__(self)
            self.fixed = logits

        @property
        def num_labels(self) -> int:
            return 1

        @property
        def device(self) -> torch.device:
            return torch.device("cpu")

        def preprocess(self, pairs, **kwargs):
            return {"count": torch.tensor(len(pairs))}

        def forward(self, inputs):
            start = self.__dict__.setdefault("_used", 0)
            n = int(inputs["count"])
            self.__dict__["_used"] = start + n
            return {"scores": self.fixed[start:start + n]}

    return FixedLogits()


# Three queries with lists of 4, 2 and 3 documents (padding in the batch); graded labels in one.
LISTS = [[1.0, 0.0, 0.0, 0.0], [0.0, 1.0], [2.0, 1.0, 0.0]]


def _batch(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    flat = torch.randn(sum(map(len, LISTS)), generator=generator, dtype=torch.float64).float() * 3
    length = max(map(len, LISTS))
    scores = torch.zeros(len(LISTS), length)
    labels = torch.zeros(len(LISTS), length)
    mask = torch.zeros(len(LISTS), length, dtype=torch.bool)
    start = 0
    for row, judged in enumerate(LISTS):
        n = len(judged)
        scores[row, :n] = flat[start:start + n]
        labels[row, :n] = torch.tensor(judged)
        mask[row, :n] = True
        start += n
    return flat, scores, labels, mask


def _ours(loss: nn.Module, flat: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor):
    leaf = flat.clone().requires_grad_(True)
    scores = torch.zeros(mask.shape).masked_scatter(mask, leaf)
    value = loss(scores, labels, mask)
    value.backward()
    return value.detach(), leaf.grad


def _theirs(make, flat: torch.Tensor, lists=LISTS, *, pointwise: bool):
    leaf = flat.clone().requires_grad_(True)
    model = _stub(leaf)
    loss = make(model)
    queries = [f"q{i}" for i in range(len(lists))]
    if pointwise:
        pairs_q = [q for q, judged in zip(queries, lists) for _ in judged]
        pairs_d = [f"d{i}" for i in range(len(pairs_q))]
        labels = torch.tensor([label for judged in lists for label in judged])
        value = loss([pairs_q, pairs_d], labels)
    else:
        documents = [[f"d{j}" for j in range(len(judged))] for judged in lists]
        value = loss([queries, documents], [torch.tensor(judged) for judged in lists])
    value.backward()
    return value.detach(), leaf.grad


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bce_matches_sentence_transformers(seed):
    from sentence_transformers.cross_encoder.losses import BinaryCrossEntropyLoss

    flat, _, labels, mask = _batch(seed)
    binary = [[min(label, 1.0) for label in judged] for judged in LISTS]  # BCE targets are in [0, 1]
    ours = _ours(PointwiseBCELoss(), flat, labels.clamp(max=1.0), mask)
    _assert_same(ours, _theirs(BinaryCrossEntropyLoss, flat, binary, pointwise=True))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_listwise_softmax_matches_list_net(seed):
    from sentence_transformers.cross_encoder.losses import ListNetLoss

    flat, _, labels, mask = _batch(seed)
    _assert_same(_ours(ListwiseSoftmaxLoss(), flat, labels, mask), _theirs(ListNetLoss, flat, pointwise=False))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("options", [{}, {"k": 2}, {"mu": 0.0, "sigma": 2.0}], ids=["default", "k2", "lambdarank"])
def test_lambdaloss_matches_sentence_transformers(seed, options):
    from sentence_transformers.cross_encoder.losses import LambdaLoss as TheirLambdaLoss
    from sentence_transformers.cross_encoder.losses.lambda_loss import LambdaRankScheme, NDCGLoss2PPScheme

    flat, _, labels, mask = _batch(seed)
    mu = options.get("mu", 10.0)
    scheme = LambdaRankScheme() if mu == 0 else NDCGLoss2PPScheme(mu=mu)

    def make(model):
        return TheirLambdaLoss(model, weighting_scheme=scheme, k=options.get("k"), sigma=options.get("sigma", 1.0))

    _assert_same(_ours(LambdaLoss(**options), flat, labels, mask), _theirs(make, flat, pointwise=False))


def _assert_same(ours, theirs):
    (value, grad), (their_value, their_grad) = ours, theirs
    assert their_value.item() > 0
    assert abs(value.item() - their_value.item()) <= 1e-6 * max(1.0, abs(their_value.item())), (value, their_value)
    assert torch.allclose(grad, their_grad, atol=1e-6, rtol=0), (grad, their_grad)


def _teacher_batch(seed: int, lengths=(4, 4, 4)):
    """Student logits (flat, row-major over the lists) and a teacher's scores, lists of `lengths`."""
    generator = torch.Generator().manual_seed(100 + seed)
    n = sum(lengths)
    flat = (torch.randn(n, generator=generator, dtype=torch.float64) * 3).float()
    teacher = (torch.randn(n, generator=generator, dtype=torch.float64) * 4).float()
    length = max(lengths)
    labels = torch.zeros(len(lengths), length)
    mask = torch.zeros(len(lengths), length, dtype=torch.bool)
    start = 0
    for row, size in enumerate(lengths):
        labels[row, :size] = teacher[start:start + size]
        mask[row, :size] = True
        start += size
    return flat, labels, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_margin_mse_matches_sentence_transformers(seed):
    from sentence_transformers.cross_encoder.losses import MarginMSELoss

    from vembed.reranking.losses import MarginMSERankingLoss

    flat, labels, mask = _teacher_batch(seed)
    batch, length = labels.shape
    # Theirs scores a column at a time (every positive, then every first negative, ...): the logits column-major.
    leaf = flat.view(batch, length).t().reshape(-1).clone().requires_grad_(True)
    loss = MarginMSELoss(_stub(leaf))
    columns = [[f"q{i}" for i in range(batch)]] + [[f"d{i}_{j}" for i in range(batch)] for j in range(length)]
    their_value = loss(columns, labels.clone())
    their_value.backward()
    theirs = (their_value.detach(), leaf.grad.view(length, batch).t().reshape(-1))
    _assert_same(_ours(MarginMSERankingLoss(), flat, labels, mask), theirs)


def test_margin_mse_of_ragged_lists_averages_the_real_margins():
    from vembed.reranking.losses import MarginMSERankingLoss

    flat, labels, mask = _teacher_batch(0, lengths=(4, 2, 3))
    value, grad = _ours(MarginMSERankingLoss(), flat, labels, mask)
    leaf = flat.double().clone().requires_grad_(True)
    errors, start = [], 0
    for row, size in enumerate((4, 2, 3)):
        s, t = leaf[start:start + size], labels[row, :size].double()
        errors += [((s[0] - s[j]) - (t[0] - t[j])) ** 2 for j in range(1, size)]
        start += size
    expected = torch.stack(errors).mean()
    expected.backward()
    _assert_same((value, grad), (expected.detach().float(), leaf.grad.float()))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("temperatures", [(1.0, None), (2.0, 0.5)], ids=["t1", "t2-teacher0.5"])
def test_list_kl_equals_its_formula_on_ragged_lists(seed, temperatures):
    from vembed.reranking.losses import ListDistillKLLoss

    lengths = (4, 2, 3)
    flat, labels, mask = _teacher_batch(seed, lengths)
    student_t, teacher_t = temperatures
    ours = _ours(ListDistillKLLoss(student_t, teacher_t), flat, labels, mask)
    leaf = flat.double().clone().requires_grad_(True)
    terms, start = [], 0
    for row, size in enumerate(lengths):
        p = torch.softmax(labels[row, :size].double() / (teacher_t or student_t), dim=0)
        q = torch.softmax(leaf[start:start + size] / student_t, dim=0)
        terms.append((p * (p.log() - q.log())).sum() * student_t ** 2)
        start += size
    expected = torch.stack(terms).mean()
    expected.backward()
    _assert_same(ours, (expected.detach().float(), leaf.grad.float()))


def test_list_kl_has_list_nets_gradient_on_teacher_scores():
    """At temperature 1: KL(p || q) = ListNet's cross-entropy(p, q) - entropy(p); same gradient, value shifted."""
    from sentence_transformers.cross_encoder.losses import ListNetLoss

    from vembed.reranking.losses import ListDistillKLLoss

    flat, labels, mask = _teacher_batch(3, lengths=(4, 2, 3))
    lists = [labels[row, :n].tolist() for row, n in enumerate((4, 2, 3))]
    (value, grad), (their_value, their_grad) = (_ours(ListDistillKLLoss(), flat, labels, mask),
                                                _theirs(ListNetLoss, flat, lists, pointwise=False))
    entropy = sum(float(-(p * p.log()).sum()) for p in (torch.tensor(x).double().softmax(0) for x in lists)) / 3
    assert value.item() == pytest.approx(their_value.item() - entropy, abs=1e-6)
    assert torch.allclose(grad, their_grad, atol=1e-6, rtol=0)


def test_distillation_losses_are_named_in_recipes(rerank_recipe):
    from vembed.components import loss_class, recipe_from_dict
    from vembed.reranking.losses import ListDistillKLLoss, MarginMSERankingLoss

    recipe = recipe_from_dict(dict(rerank_recipe, loss_type="rerank_distill_kl", temperature=2.0))
    loss = loss_class(recipe).from_recipe(recipe)
    assert isinstance(loss, ListDistillKLLoss) and (loss.temperature, loss.teacher_temperature) == (2.0, 2.0)
    recipe = recipe_from_dict(dict(rerank_recipe, loss_type="rerank_margin_mse"))
    assert isinstance(loss_class(recipe).from_recipe(recipe), MarginMSERankingLoss)
    assert recipe_from_dict(dict(rerank_recipe, loss_type="rerank_distill_kl")).loss.temperature == 1.0
