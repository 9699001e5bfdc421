"""Late interaction (ColBERT): MaxSim scoring and the losses over it (in-batch contrastive, colpali-engine's pairwise,
KL distillation of teacher scores), against plain loops written here, and two gloo ranks against one process on the
whole batch."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ranks import run_on_ranks
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from pylate_runner import pylate_available, run_pylate  # noqa: E402

from vembed.losses.late_interaction import (  # noqa: E402
    LateInteractionDistillKLLoss,
    LateInteractionLoss,
    LateInteractionPairwiseLoss,
)
from vembed.models.maxsim import maxsim, maxsim_candidates  # noqa: E402
from vembed.models.token_vectors import cat_tokens, pad_tokens, token_mask  # noqa: E402

WORLD, B, K, IN, D = 2, 3, 2, 12, 8


def _token_vectors(lengths: list[int], width: int, generator: torch.Generator, dim: int = D) -> torch.Tensor:
    """(n, width, dim) L2-normalised token vectors, row i with lengths[i] tokens, zero vectors after."""
    vectors = F.normalize(torch.randn(len(lengths), width, dim, generator=generator, dtype=torch.float64), dim=-1)
    keep = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    return vectors * keep[..., None]


def _brute_maxsim(query: torch.Tensor, document: torch.Tensor) -> torch.Tensor:
    """Sum over the query's real tokens of the best dot product with the document's real tokens, by loops."""
    q_tokens = [t for t in query if t.abs().sum() > 0]
    d_tokens = [t for t in document if t.abs().sum() > 0]
    total = torch.zeros((), dtype=query.dtype)
    for q in q_tokens:
        total = total + max((q @ d for d in d_tokens), key=float)
    return total


def _brute_loss(query, positive, negatives, temperature, labels=None) -> torch.Tensor:
    documents = list(positive) + ([n for row in negatives for n in row] if negatives is not None else [])
    losses = []
    for i, q in enumerate(query):
        logits = []
        for j, d in enumerate(documents):
            if labels is not None and j < len(positive) and j != i and labels[j] == labels[i]:
                continue  # a same-label record is not a negative
            logits.append(_brute_maxsim(q, d) / temperature)
        logits = torch.stack(logits)
        own = sum(1 for j in range(i) if labels is None or labels[j] != labels[i])
        losses.append(torch.logsumexp(logits, 0) - logits[own])
    return torch.stack(losses).mean()


def test_maxsim_equals_loops_and_never_scores_padding():
    g = torch.Generator().manual_seed(0)
    queries = _token_vectors([4, 2, 3], 4, g)
    documents = _token_vectors([5, 1, 3, 2], 6, g)
    expected = torch.stack([torch.stack([_brute_maxsim(q, d) for d in documents]) for q in queries])
    assert torch.allclose(maxsim(queries, documents), expected, atol=1e-12)
    # more padding, in blocks of one document: the same scores (padding is neither a max nor a term)
    assert torch.allclose(maxsim(pad_tokens(queries, 9), pad_tokens(documents, 11), max_block_elements=1), expected,
                          atol=1e-12)
    assert (expected < 0).any()  # negative dot products: scoring padding as 0 would have changed the max


def test_maxsim_document_without_tokens_scores_zero():
    g = torch.Generator().manual_seed(1)
    queries, documents = _token_vectors([2], 3, g), _token_vectors([0, 2], 3, g)
    scores = maxsim(queries, documents)
    assert scores[0, 0] == 0 and torch.isfinite(scores).all()
    # documents padded to no token slot at all (search unpacks a chunk of empty documents so): every score 0
    assert torch.equal(maxsim(queries, documents[:, :0]), queries.new_zeros(1, 2))
    assert torch.equal(maxsim_candidates(queries, documents[None, :, :0]), queries.new_zeros(1, 2))


def test_cat_tokens_pads_to_the_longest_and_mask_reads_back():
    g = torch.Generator().manual_seed(2)
    a, b = _token_vectors([2, 1], 2, g), _token_vectors([3], 5, g)
    joined = cat_tokens([a, b])
    assert joined.shape == (3, 5, D)
    assert token_mask(joined).sum(1).tolist() == [2, 1, 3]


@pytest.mark.parametrize("with_negatives,with_labels,q_width", [(False, False, 4), (True, False, 4), (True, True, 4),
                                                                 (True, False, 3)])
def test_loss_equals_cross_entropy_over_brute_force_maxsim(with_negatives, with_labels, q_width):
    g = torch.Generator().manual_seed(3)
    query = _token_vectors([q_width] * 4, q_width, g)  # expanded queries: every position a token; B 4, Tq 4 or 3
    positive = _token_vectors([3, 6, 1, 5], 6, g)
    negatives = _token_vectors([2, 4, 3, 1, 6, 2, 5, 3], 6, g).view(4, 2, 6, D) if with_negatives else None
    labels = torch.tensor([7, 8, 7, 9]) if with_labels else None
    loss = LateInteractionLoss(temperature=0.5)(query, positive, negatives, labels=labels)
    expected = _brute_loss(query, positive, negatives, 0.5, labels)
    assert loss.dtype == torch.float64
    assert abs(loss.item() - expected.item()) <= 1e-6 * max(1.0, abs(expected.item()))


@pytest.mark.parametrize("loss", [LateInteractionLoss, LateInteractionPairwiseLoss, LateInteractionDistillKLLoss])
def test_loss_refuses_one_vector_per_side(loss):
    with pytest.raises(ValueError, match="takes token vectors"):
        loss()(torch.randn(2, 4), torch.randn(2, 4), torch.randn(2, 1, 4), scores=torch.randn(2, 2))
    assert loss.token_vectors


def test_maxsim_candidates_scores_each_query_against_its_own_list():
    g = torch.Generator().manual_seed(4)
    queries = _token_vectors([3, 2, 4], 4, g)
    candidates = _token_vectors([2, 5, 1, 3, 4, 2, 6, 1, 3], 6, g).view(3, 3, 6, D)
    expected = torch.stack([torch.stack([_brute_maxsim(q, c) for c in row]) for q, row in zip(queries, candidates)])
    assert torch.allclose(maxsim_candidates(queries, candidates), expected, atol=1e-12)
    assert torch.allclose(maxsim_candidates(queries, candidates, max_block_elements=1), expected, atol=1e-12)


def _brute_pairwise(query, positive, negatives, temperature, per_token, labels=None) -> torch.Tensor:
    """colpali-engine's ColbertPairwiseCELoss, written out: MaxSim (divided by the query's token count, its default
    normalize_scores), the positive against the best-scoring other candidate, softplus of the difference."""
    documents = list(positive) + ([n for row in negatives for n in row] if negatives is not None else [])
    losses = []
    for i, q in enumerate(query):
        tokens = sum(1 for t in q if t.abs().sum() > 0) if per_token else 1
        others = [_brute_maxsim(q, d) / tokens for j, d in enumerate(documents)
                  if j != i and not (labels is not None and j < len(positive) and labels[j] == labels[i])]
        own = _brute_maxsim(q, positive[i]) / tokens
        losses.append(torch.log1p(torch.exp((max(others, key=float) - own) / temperature)))
    return torch.stack(losses).mean()


@pytest.mark.parametrize("with_negatives,with_labels,per_token", [(False, False, True), (True, False, True),
                                                                   (True, True, True), (True, False, False)])
def test_pairwise_loss_equals_colpalis_definition_by_loops(with_negatives, with_labels, per_token):
    g = torch.Generator().manual_seed(5)
    query = _token_vectors([4, 2, 3, 4], 4, g)
    positive = _token_vectors([3, 6, 1, 5], 6, g)
    negatives = _token_vectors([2, 4, 3, 1, 6, 2, 5, 3], 6, g).view(4, 2, 6, D) if with_negatives else None
    labels = torch.tensor([7, 8, 7, 9]) if with_labels else None
    normalization = "query_length" if per_token else "none"
    loss = LateInteractionPairwiseLoss(0.5, normalization)(query, positive, negatives, labels=labels)
    expected = _brute_pairwise(query, positive, negatives, 0.5, per_token, labels)
    assert abs(loss.item() - expected.item()) <= 1e-9 * max(1.0, abs(expected.item()))


def _brute_distill(query, positive, negatives, teacher, temperature, teacher_temperature, min_max) -> torch.Tensor:
    losses = []
    for q, p, row, t in zip(query, positive, negatives, teacher):
        student = torch.stack([_brute_maxsim(q, d) for d in [p, *row]])
        if min_max:
            student = (student - student.min()) / (student.max() - student.min() + 1e-8)
        target = torch.exp(t / teacher_temperature) / torch.exp(t / teacher_temperature).sum()
        log_student = student / temperature - torch.logsumexp(student / temperature, 0)
        losses.append((target * (target.log() - log_student)).sum())
    return torch.stack(losses).mean() * temperature**2


@pytest.mark.parametrize("temperature,teacher_temperature,min_max,widths", [
    (1.0, None, False, (6, 5)), (0.5, 2.0, False, (6, 5)), (1.0, None, True, (6, 5)),
    (1.0, None, False, (10, 5)), (1.0, None, False, (6, 10))])  # token widths (positives, negatives); D is 8
def test_distill_kl_equals_kl_over_each_querys_candidates_by_loops(temperature, teacher_temperature, min_max, widths):
    g = torch.Generator().manual_seed(6)
    query = _token_vectors([4, 2, 3], 4, g)
    positive = _token_vectors([3, widths[0], 1], widths[0], g)
    negatives = _token_vectors([2, 4, 3, 1, widths[1], 2], widths[1], g).view(3, 2, widths[1], D)
    teacher = torch.tensor([[9.0, 3.0, -1.0], [2.0, 4.5, 0.0], [1.0, 1.0, 7.0]], dtype=torch.float64)
    loss = LateInteractionDistillKLLoss(temperature, teacher_temperature, "min_max" if min_max else "none")(
        query, positive, negatives, scores=teacher)
    expected = _brute_distill(query, positive, negatives, teacher, temperature, teacher_temperature or temperature,
                              min_max)
    assert loss.dtype == torch.float64 and loss.item() > 0
    assert abs(loss.item() - expected.item()) <= 1e-9 * max(1.0, abs(expected.item()))


@pytest.mark.slow  # a child process on PyLate's stack
@pytest.mark.skipif(not pylate_available(), reason="PyLate's stack is not installed (bash scripts/setup.sh dev)")
def test_distill_kl_equals_pylates_distillation_loss(tmp_path):
    """PyLate's `Distillation` (run in a child process on its own stack, bench/pylate_runner.py) on the same token
    vectors and teacher scores: the same loss with and without its min-max normalisation, and the same gradients
    up to PyLate's re-normalisation of the vectors (which removes each gradient's component along its vector)."""
    g = torch.Generator().manual_seed(8)
    query = _token_vectors([5] * 4, 5, g).float()
    candidates = _token_vectors([6] * 12, 6, g).float().view(4, 3, 6, D)  # every token real: PyLate scores padding 0
    teacher = torch.tensor([[9.0, 3.0, -1.0], [2.0, 4.5, 0.0], [1.0, 1.0, 7.0], [0.0, 0.5, 0.25]])
    torch.save({"queries": query, "documents": candidates, "teacher": teacher}, tmp_path / "inputs.pt")
    run_pylate({"distill": {"inputs": str(tmp_path / "inputs.pt"), "out": str(tmp_path / "out.pt")}}, tmp_path)
    theirs = torch.load(tmp_path / "out.pt")

    def tangent(grad: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
        return grad - (grad * vectors).sum(-1, keepdim=True) * vectors

    for normalization in ("none", "min_max"):
        q, c = query.clone().requires_grad_(), candidates.clone().requires_grad_()
        loss = LateInteractionDistillKLLoss(1.0, 1.0, normalization)(q, c[:, 0], c[:, 1:], scores=teacher)
        loss.backward()
        expected = theirs[normalization]
        assert loss.item() > 0
        torch.testing.assert_close(loss.detach(), expected["loss"], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(tangent(q.grad, query), expected["queries"], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(tangent(c.grad, candidates), expected["documents"], atol=1e-6, rtol=1e-5)


def test_distill_kl_needs_negatives_and_a_teacher_score_per_candidate():
    g = torch.Generator().manual_seed(7)
    query, positive = _token_vectors([2, 2], 3, g), _token_vectors([2, 3], 3, g)
    negatives = _token_vectors([1, 2], 3, g).view(2, 1, 3, D)
    with pytest.raises(ValueError, match="^LateInteractionDistillKLLoss needs hard negatives"):
        LateInteractionDistillKLLoss()(query, positive, None, scores=torch.zeros(2, 1))
    with pytest.raises(ValueError, match=r"^LateInteractionDistillKLLoss needs scores of shape \(2, 2\)"):
        LateInteractionDistillKLLoss()(query, positive, negatives, scores=torch.zeros(2, 3))



# --- the recipe keys and the shapes each loss takes ------------------------------------------------------------------
def _built(loss_type: str, **keys):
    from vembed.components import recipe_from_dict
    from vembed.losses import build_loss

    return build_loss(recipe_from_dict({"model_type": "text", "embedding": "multi_vector", "loss_type": loss_type,
                                        **keys}))


def test_recipe_defaults_and_keys_reach_each_loss_and_its_config():
    assert _built("late_interaction").config == {
        "name": "LateInteractionLoss", "loss_type": "late_interaction", "temperature": 1.0,
        "learnable_temperature": False}
    learned = _built("late_interaction", temperature=0.5, learnable_temperature=True)
    assert learned.config == {"name": "LateInteractionLoss", "loss_type": "late_interaction", "temperature": 0.5,
                              "learnable_temperature": True, "learned_temperature": pytest.approx(0.5)}
    assert learned._infonce.log_scale.requires_grad
    assert _built("late_interaction_pairwise").config == {
        "name": "LateInteractionPairwiseLoss", "loss_type": "late_interaction_pairwise", "temperature": 1.0,
        "maxsim_normalization": "query_length"}
    assert _built("late_interaction_pairwise", temperature=0.5, maxsim_normalization="none").config == {
        "name": "LateInteractionPairwiseLoss", "loss_type": "late_interaction_pairwise", "temperature": 0.5,
        "maxsim_normalization": "none"}
    assert _built("late_interaction_distill_kl").config == {
        "name": "LateInteractionDistillKLLoss", "loss_type": "late_interaction_distill_kl", "temperature": 1.0,
        "teacher_temperature": 1.0, "maxsim_normalization": "none"}
    assert _built("late_interaction_distill_kl", temperature=0.5).config["teacher_temperature"] == 0.5
    assert _built("late_interaction_distill_kl", temperature=0.5, teacher_temperature=2.0,
                  maxsim_normalization="min_max").config == {
        "name": "LateInteractionDistillKLLoss", "loss_type": "late_interaction_distill_kl", "temperature": 0.5,
        "teacher_temperature": 2.0, "maxsim_normalization": "min_max"}


@pytest.mark.parametrize("loss_type", ["late_interaction", "late_interaction_pairwise", "late_interaction_distill_kl"])
def test_recipe_refuses_matryoshka_and_a_temperature_not_above_zero_naming_the_key(loss_type):
    from vembed.errors import RecipeError

    with pytest.raises(RecipeError, match=r"mrl_dims: Matryoshka dimensions apply to one vector per side, not to "
                                          r"token vectors; remove mrl_dims \(set multi_vector_dim instead\)"):
        _built(loss_type, mrl_dims=[4])
    with pytest.raises(RecipeError, match="temperature: input should be greater than 0"):
        _built(loss_type, temperature=0)
    assert _built(loss_type, temperature=0.25).temperature == 0.25


@pytest.mark.parametrize("loss_type", ["late_interaction_pairwise", "late_interaction_distill_kl"])
def test_fixed_temperature_losses_refuse_a_learnable_one_naming_the_key(loss_type):
    from vembed.errors import RecipeError

    with pytest.raises(RecipeError, match="learnable_temperature: this loss_type keeps its temperature fixed; "
                                          "remove the key"):
        _built(loss_type, learnable_temperature=True)


def test_a_learnable_temperature_below_the_cap_is_a_recipe_error_naming_temperature():
    from vembed.errors import RecipeError

    with pytest.raises(RecipeError) as refused:
        _built("late_interaction", temperature=0.001, learnable_temperature=True)
    assert refused.value.key == "temperature"
    assert refused.value.message.startswith("a learnable temperature starts at 0.001, below the cap of 0.01")


def test_python_defaults_are_the_recipes():
    """`LateInteractionLoss()` and the others built in Python (no recipe) take the recipe's defaults."""
    g = torch.Generator().manual_seed(11)
    query, positive = _token_vectors([3, 2, 1], 4, g), _token_vectors([2, 4, 3], 4, g)
    negatives = _token_vectors([1, 2, 3], 4, g).view(3, 1, 4, D)
    teacher = torch.tensor([[1.0, 0.0], [0.5, 2.0], [3.0, -1.0]], dtype=torch.float64)
    for loss_type, cls in [("late_interaction", LateInteractionLoss),
                           ("late_interaction_pairwise", LateInteractionPairwiseLoss),
                           ("late_interaction_distill_kl", LateInteractionDistillKLLoss)]:
        default, built = cls(), _built(loss_type)
        assert default.config == built.config, loss_type
        assert not any(p.requires_grad for p in default.parameters())  # nothing learned by default
        assert torch.equal(default(query, positive, negatives, scores=teacher),
                           built(query, positive, negatives, scores=teacher)), loss_type
    # the defaults themselves: temperature 1, colpali's per-token normalisation, raw MaxSim for distillation
    assert torch.equal(LateInteractionPairwiseLoss()(query, positive, negatives),
                       LateInteractionPairwiseLoss(1.0, "query_length")(query, positive, negatives))
    assert not torch.equal(LateInteractionPairwiseLoss()(query, positive, negatives),
                           LateInteractionPairwiseLoss(1.0, "none")(query, positive, negatives))


@pytest.mark.parametrize("loss", [LateInteractionLoss, LateInteractionPairwiseLoss, LateInteractionDistillKLLoss])
def test_mismatched_token_vectors_are_refused_naming_the_shapes(loss):
    name = {LateInteractionLoss: "late_interaction", LateInteractionPairwiseLoss: "late_interaction_pairwise",
            LateInteractionDistillKLLoss: "late_interaction_distill_kl"}[loss]
    q, p, n, s = torch.zeros(2, 3, D), torch.zeros(2, 4, D), torch.zeros(2, 1, 5, D), torch.zeros(2, 2)
    for query, positive in [(q, torch.zeros(3, 4, D)), (q, torch.zeros(2, 4, D + 1)), (torch.zeros(2, 3), p),
                            (q, torch.zeros(2, D))]:
        with pytest.raises(ValueError, match=f"^{re.escape(name)} takes token vectors: query \\(B, Tq, d\\) and "
                                             f"positive \\(B, Tp, d\\); got {re.escape(str(tuple(query.shape)))} and "
                                             f"{re.escape(str(tuple(positive.shape)))} "
                                             f"\\(set embedding: multi_vector\\)$"):
            loss()(query, positive, n, scores=s)
    for negatives in [torch.zeros(2, 5, D), torch.zeros(3, 1, 5, D), torch.zeros(2, 1, 5, D + 1)]:
        with pytest.raises(ValueError, match=f"^negatives must be \\(B, k, Tn, d\\) with B=2, d={D}; got "
                                             f"{re.escape(str(tuple(negatives.shape)))}$"):
            loss()(q, p, negatives, scores=s)
    assert loss()(q, p, n, scores=s).isfinite()  # shapes that fit: no error


def test_pairwise_divides_by_each_querys_own_token_count_and_a_query_without_tokens_scores_zero():
    g = torch.Generator().manual_seed(9)
    query = _token_vectors([1, 3, 0], 4, g)  # one token, three, none (3 queries of width 4: B is not Tq)
    positive, negatives = _token_vectors([2, 3, 1], 3, g), _token_vectors([2, 1, 3], 3, g).view(3, 1, 3, D)
    loss = LateInteractionPairwiseLoss(0.5)(query, positive, negatives)
    expected = [_brute_pairwise(query[:2], positive, negatives, 0.5, True), torch.log(torch.tensor(2.0))]
    # the query without tokens scores 0 against everything: softplus(0) = log 2, not NaN from 0 / 0
    assert abs(loss.item() - (2 * expected[0] + expected[1]).item() / 3) <= 1e-9


def test_pairwise_row_without_any_other_candidate_adds_zero():
    g = torch.Generator().manual_seed(10)
    query, positive = _token_vectors([2], 2, g), _token_vectors([2], 2, g)
    assert LateInteractionPairwiseLoss()(query, positive).item() == 0.0

# --- two gloo ranks = one process on the whole batch ---------------------------------------------------------------
Q_LENGTHS = [5, 5, 5, 5, 5, 5]  # expanded queries
P_LENGTHS = [2, 4, 3, 7, 1, 6]  # rank 0's positives are at most 4 long, rank 1's 7: the gather pads
N_LENGTHS = [[1, 3], [2, 2], [4, 1], [5, 2], [3, 3], [2, 6]]


LOSSES = {
    "late_interaction": lambda: LateInteractionLoss(temperature=0.2, learnable_temperature=True),
    "late_interaction_pairwise": lambda: LateInteractionPairwiseLoss(temperature=0.5),
    "late_interaction_distill_kl": lambda: LateInteractionDistillKLLoss(temperature=0.5, teacher_temperature=2.0),
}


class TokenEncoderWithLoss(nn.Module):
    """A linear token encoder (normalised, zero where there is no token) and the loss, as the loop wraps them."""

    def __init__(self, loss: str = "late_interaction"):
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Linear(IN, D, bias=False)
        self.loss = LOSSES[loss]()

    def encode(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        width = int(lengths.max())  # each rank pads only to its own longest row
        keep = torch.arange(width)[None, :] < lengths[:, None]
        return F.normalize(self.encoder(tokens[:, :width]), dim=-1) * keep[..., None]

    def forward(self, batch):
        queries, q_len, positives, p_len, negatives, n_len, _ = batch
        n = negatives.shape[0]
        encoded = self.encode(negatives.flatten(0, 1), n_len.flatten())
        return self.encode(queries, q_len), self.encode(positives, p_len), encoded.view(n, K, *encoded.shape[1:])


def _global_token_batch():
    g = torch.Generator().manual_seed(99)
    n = WORLD * B
    return (torch.randn(n, 5, IN, generator=g), torch.tensor(Q_LENGTHS), torch.randn(n, 7, IN, generator=g),
            torch.tensor(P_LENGTHS), torch.randn(n, K, 6, IN, generator=g), torch.tensor(N_LENGTHS),
            3 * torch.randn(n, 1 + K, generator=g))  # teacher scores of [positive, negatives]


def _loss_and_grads(model, forward, batch):
    model.zero_grad()
    loss = model.loss(*forward(batch), scores=batch[-1])
    loss.backward()
    return {"loss": loss.detach(), "grads": {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}}


def _late_interaction_rank(out_dir: str) -> None:
    rank = dist.get_rank()
    local = tuple(t[rank * B : (rank + 1) * B] for t in _global_token_batch())
    for loss in LOSSES:  # one start of the ranks for every loss (spawning them is the slow part)
        model = TokenEncoderWithLoss(loss)
        ddp = nn.parallel.DistributedDataParallel(model)
        torch.save(_loss_and_grads(model, ddp, local), Path(out_dir) / f"{loss}-rank{rank}.pt")


def test_late_interaction_losses_two_ranks_equal_one_process_on_the_whole_batch(tmp_path):
    run_on_ranks(_late_interaction_rank, str(tmp_path), world=WORLD)
    for loss in LOSSES:
        ranks = [torch.load(tmp_path / f"{loss}-rank{r}.pt") for r in range(WORLD)]
        model = TokenEncoderWithLoss(loss)
        expected = _loss_and_grads(model, model, _global_token_batch())
        learned = {"loss._infonce.log_scale"} if loss == "late_interaction" else set()
        assert set(expected["grads"]) == {"encoder.weight"} | learned
        mean = torch.stack([r["loss"] for r in ranks]).mean()
        assert abs(mean - expected["loss"]) <= 1e-5 * expected["loss"].abs(), loss
        for result in ranks:
            for name, grad in expected["grads"].items():
                difference = ((result["grads"][name] - grad).abs().max() / grad.abs().max()).item()
                assert difference <= 1e-5, f"{loss} {name}: relative difference {difference:.2e}"
