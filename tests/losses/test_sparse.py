"""FLOPS regularisation (vembed/losses/sparse.py) equals sentence-transformers' SpladeLoss around its sparse losses on
the same (B, V) vectors: value and gradient w.r.t. every input, to 1e-6 (float64); under two gloo ranks with DDP
its gradients are those of one process on the whole batch (1e-5); and a recipe builds it from the flops_* keys.

sentence-transformers' SpladeLoss owns a model; here it is the stand-in of test_st_parity (`ColumnModel`), which
returns fixed vectors for each column, so `SpladeLoss.forward` runs unchanged on exactly the tensors ours receives.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ranks import run_on_ranks
from torch import nn

from vembed.losses.contrastive import InfoNCELoss
from vembed.losses.scored import CoSENTLoss, DistillKLDivLoss, MarginMSELoss
from vembed.losses.sparse import FlopsRegularizedLoss, flops

B, K, V = 6, 2, 12
TOLERANCE = 1e-6


def _sparse(*shape: int, seed: int) -> torch.Tensor:
    """SPLADE-like vectors: non-negative, about half of the weights exactly 0 (so thresholds select rows)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.relu(torch.randn(*shape, generator=generator, dtype=torch.float64)).requires_grad_()


def _teacher(seed: int) -> torch.Tensor:
    return torch.randn(B, 1 + K, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _sparse_losses():
    # Imported by the test, not the module: the two-rank test's spawned ranks import this module, and
    # sentence-transformers takes seconds to import.
    return pytest.importorskip("sentence_transformers.sparse_encoder.losses")


# name: (ours, theirs(model), uses hard negatives, the scores ours reads, the labels theirs reads)
TEACHER = _teacher(3)
GOLD = torch.tensor([0.9, 0.1, 0.5, 0.5, 0.0, 0.75], dtype=torch.float64)
CASES = {
    # sentence-transformers' SparseMultipleNegativesRankingLoss: dot product, scale 1, queries -> documents only.
    "infonce": (lambda: InfoNCELoss(temperature=1.0, symmetric=False),
                lambda m: _sparse_losses().SparseMultipleNegativesRankingLoss(m), False, None, None),
    "infonce_hard_negatives": (lambda: InfoNCELoss(temperature=1.0, symmetric=False),
                               lambda m: _sparse_losses().SparseMultipleNegativesRankingLoss(m), True, None, None),
    "margin_mse": (MarginMSELoss, lambda m: _sparse_losses().SparseMarginMSELoss(m), True, TEACHER,
                   TEACHER[:, :1] - TEACHER[:, 1:]),
    "distill_kl": (lambda: DistillKLDivLoss(temperature=2.0),
                   lambda m: _sparse_losses().SparseDistillKLDivLoss(m, temperature=2.0), True, TEACHER, TEACHER),
    "cosent": (lambda: CoSENTLoss(scale=20.0), lambda m: _sparse_losses().SparseCoSENTLoss(m, scale=20.0), False, GOLD,
               GOLD),
}
# (query weight, document weight, query threshold, document threshold); sentence-transformers' names in the test.
REGULARISERS = {
    "both": (5e-2, 3e-2, None, None),
    "documents_only": (None, 3e-2, None, None),
    "thresholds": (5e-2, 3e-2, 6, 5),
}


@pytest.mark.parametrize("regulariser", list(REGULARISERS))
@pytest.mark.parametrize("case", list(CASES))
def test_flops_regularised_losses_equal_sentence_transformers_splade_loss(case, regulariser):
    ours_inner, theirs_inner, with_negatives, scores, labels = CASES[case]
    query_weight, document_weight, query_threshold, document_threshold = REGULARISERS[regulariser]
    q, p, n = _sparse(B, V, seed=0), _sparse(B, V, seed=1), _sparse(B, K, V, seed=2)
    leaves = [q, p, n] if with_negatives else [q, p]
    loss = FlopsRegularizedLoss(ours_inner(), query_weight, document_weight, query_threshold, document_threshold)
    value = loss(q, p, n if with_negatives else None, scores=scores)
    grads = torch.autograd.grad(value, leaves)

    from losses.test_st_parity import ColumnModel

    columns = [q, p] + ([n[:, j] for j in range(K)] if with_negatives else [])
    model = ColumnModel(columns)
    splade = _sparse_losses().SpladeLoss(model, theirs_inner(model), document_regularizer_weight=document_weight,
                                      query_regularizer_weight=query_weight,
                                      query_regularizer_threshold=query_threshold,
                                      document_regularizer_threshold=document_threshold)
    terms = splade([{"column": i} for i in range(len(columns))], labels)
    their_value = sum(terms.values())
    their_grads = torch.autograd.grad(their_value, leaves)

    assert terms["document_regularizer_loss"] > 0
    assert abs(value.item() - their_value.item()) <= TOLERANCE * max(1.0, abs(their_value.item()))
    for mine, theirs in zip(grads, their_grads):
        assert (mine - theirs).abs().max().item() <= TOLERANCE
    # The FLOPS terms are really in both: without them, the value differs.
    assert abs(ours_inner()(q, p, n if with_negatives else None, scores=scores).item() - value.item()) > 1e-4


def test_flops_is_the_squared_mean_weight_summed_over_the_vocabulary_and_a_threshold_drops_sparse_rows():
    weights = torch.tensor([[1.0, 0.0, 2.0], [3.0, 0.0, 0.0]])
    assert flops(weights).item() == pytest.approx(2.0**2 + 0.0 + 1.0**2)
    # Row 1 has one non-zero weight, at most the threshold: it counts as zeros, but still as a row of the mean.
    assert flops(weights, threshold=1).item() == pytest.approx(0.5**2 + 0.0 + 1.0**2)
    assert flops(weights, threshold=0).item() == pytest.approx(flops(weights).item())


def test_a_zero_or_unset_weight_adds_nothing_and_a_negative_weight_is_refused():
    q, p = _sparse(B, V, seed=4), _sparse(B, V, seed=5)
    inner = InfoNCELoss(temperature=1.0, symmetric=False)
    plain = inner(q, p).item()
    assert FlopsRegularizedLoss(inner, 0.0, None)(q, p).item() == plain
    assert FlopsRegularizedLoss(inner, None, 1.0)(q, p).item() > plain
    assert FlopsRegularizedLoss(inner, 1.0, None)(q, p).item() > plain
    with pytest.raises(ValueError, match="query_weight must be >= 0, got -1.0"):
        FlopsRegularizedLoss(inner, -1.0, None)
    with pytest.raises(ValueError, match="document_weight must be >= 0, got -0.5"):
        FlopsRegularizedLoss(inner, None, -0.5)


def test_the_config_names_the_weights_thresholds_and_the_inner_loss():
    loss = FlopsRegularizedLoss(MarginMSELoss(), 0.5, 0.25, None, 3)
    assert loss.config == {"name": "FlopsRegularizedLoss", "query_weight": 0.5, "document_weight": 0.25,
                           "query_threshold": None, "document_threshold": 3, "loss": MarginMSELoss().config}
    assert loss.gradient_cache_refusal is None and not loss.token_vectors and loss.uses_negatives


def test_a_recipe_wraps_its_loss_with_the_flops_keys_and_refuses_a_negative_weight():
    from vembed.components import recipe_from_dict
    from vembed.errors import RecipeError
    from vembed.losses import build_loss

    raw = {"model_type": "text", "model_name": "x", "embedding": "sparse", "loss_type": "margin_mse"}
    assert type(build_loss(recipe_from_dict(raw))) is MarginMSELoss
    loss = build_loss(recipe_from_dict({**raw, "flops_query_weight": 0.5, "flops_document_weight": 0.25,
                                        "flops_document_threshold": 3}))
    assert type(loss) is FlopsRegularizedLoss and type(loss.loss) is MarginMSELoss
    assert (loss.query_weight, loss.document_weight, loss.query_threshold, loss.document_threshold) == (
        0.5, 0.25, None, 3)
    assert loss.min_negatives == 1 and loss.needs_scores == MarginMSELoss.needs_scores  # the inner loss's needs
    for changes, key in (({"flops_query_weight": -1.0}, "flops_query_weight"),
                         ({"flops_query_threshold": 3}, "flops_query_threshold")):
        with pytest.raises(RecipeError) as err:
            recipe_from_dict({**raw, **changes})
        assert err.value.key == key


# --- two gloo ranks ---------------------------------------------------------------------------------------------------
WORLD, IN = 2, 16


class SparseEncoderWithLoss(nn.Module):
    """What the loop hands to DDP: a small encoder of non-negative, partly zero vectors and the loss in one module."""

    def __init__(self, loss: nn.Module):
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Linear(IN, V)
        self.loss = loss

    def forward(self, queries, positives, negatives):
        return tuple(torch.relu(self.encoder(x)) for x in (queries, positives, negatives))


def _distributed_cases() -> dict:
    return {
        "infonce": lambda: FlopsRegularizedLoss(InfoNCELoss(temperature=1.0, symmetric=False), 0.5, 0.3),
        "infonce_thresholds": lambda: FlopsRegularizedLoss(InfoNCELoss(temperature=1.0, symmetric=False), 0.5, 0.3,
                                                           6, 5),
        "margin_mse": lambda: FlopsRegularizedLoss(MarginMSELoss(), 0.5, 0.3),
    }


def _global_batch() -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(1234)
    return (torch.randn(WORLD * B, IN, generator=generator), torch.randn(WORLD * B, IN, generator=generator),
            torch.randn(WORLD * B, K, IN, generator=generator))


TEACHER_SCORES = torch.randn(WORLD * B, 1 + K, generator=torch.Generator().manual_seed(5))


def _loss_and_gradients(model: nn.Module, forward: nn.Module, batch, scores) -> dict:
    model.zero_grad()
    loss = model.loss(*forward(*batch), scores=scores)
    loss.backward()
    return {"loss": loss.detach(), "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                             if p.grad is not None}}


def _rank_worker(out_dir: str) -> None:
    torch.set_num_threads(1)
    rank = dist.get_rank()
    rows = slice(rank * B, (rank + 1) * B)
    results = {}
    for case, build in _distributed_cases().items():
        model = SparseEncoderWithLoss(build())
        ddp = nn.parallel.DistributedDataParallel(model)
        results[case] = _loss_and_gradients(model, ddp, tuple(t[rows] for t in _global_batch()), TEACHER_SCORES[rows])
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


def _relative_difference(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def test_flops_regularised_losses_ddp_gradients_match_single_process_full_batch(tmp_path):
    # FLOPS is a function of the global batch's mean: each rank's column sums are summed over ranks with gradients.
    run_on_ranks(_rank_worker, str(tmp_path), world=WORLD, timeout=120)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for case, build in _distributed_cases().items():
        model = SparseEncoderWithLoss(build())
        expected = _loss_and_gradients(model, model, _global_batch(), TEACHER_SCORES)
        regulariser = expected["loss"] - model.loss.loss(*model(*_global_batch()), scores=TEACHER_SCORES)
        assert regulariser > 1e-3, case  # the FLOPS terms weigh in the comparison
        mean_loss = torch.stack([r[case]["loss"] for r in ranks]).mean()
        assert _relative_difference(mean_loss, expected["loss"]) <= 1e-5, case
        for r, result in enumerate(ranks):
            assert result[case]["grads"].keys() == expected["grads"].keys(), case
            for name, grad in expected["grads"].items():
                difference = _relative_difference(result[case]["grads"][name], grad)
                assert difference <= 1e-5, f"{case}, rank {r}, {name}: {difference:.2e}"
