"""FLOPS regularisation (vembed/losses/sparse.py) equals sentence-transformers' SpladeLoss around its sparse losses on
the same (B, V) vectors: value and gradient w.r.t. every input, to 1e-6 (float64); and a recipe builds it from the
flops_* keys. (Under two gloo ranks with DDP: tests/losses/test_distributed_losses.py.)

sentence-transformers' SpladeLoss owns a model; here it is the stand-in of test_st_parity (`ColumnModel`), which
returns fixed vectors for each column, so `SpladeLoss.forward` runs unchanged on exactly the tensors ours receives.
"""

from __future__ import annotations

import pytest
import torch
from losses.test_st_parity import ColumnModel

sparse_losses = pytest.importorskip("sentence_transformers.sparse_encoder.losses")

from vembed.losses.contrastive import InfoNCELoss  # noqa: E402
from vembed.losses.scored import CoSENTLoss, DistillKLDivLoss, MarginMSELoss  # noqa: E402
from vembed.losses.sparse import FlopsRegularizedLoss, flops, warmup_factor  # noqa: E402

B, K, V = 6, 2, 12
TOLERANCE = 1e-6


def _sparse(*shape: int, seed: int) -> torch.Tensor:
    """SPLADE-like vectors: non-negative, about half of the weights exactly 0 (so thresholds select rows)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.relu(torch.randn(*shape, generator=generator, dtype=torch.float64)).requires_grad_()


def _teacher(seed: int) -> torch.Tensor:
    return torch.randn(B, 1 + K, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# name: (ours, theirs(model), uses hard negatives, the scores ours reads, the labels theirs reads)
TEACHER = _teacher(3)
GOLD = torch.tensor([0.9, 0.1, 0.5, 0.5, 0.0, 0.75], dtype=torch.float64)
CASES = {
    # sentence-transformers' SparseMultipleNegativesRankingLoss: dot product, scale 1, queries -> documents only.
    "infonce": (lambda: InfoNCELoss(temperature=1.0, symmetric=False),
                lambda m: sparse_losses.SparseMultipleNegativesRankingLoss(m), False, None, None),
    "infonce_hard_negatives": (lambda: InfoNCELoss(temperature=1.0, symmetric=False),
                               lambda m: sparse_losses.SparseMultipleNegativesRankingLoss(m), True, None, None),
    "margin_mse": (MarginMSELoss, lambda m: sparse_losses.SparseMarginMSELoss(m), True, TEACHER,
                   TEACHER[:, :1] - TEACHER[:, 1:]),
    "distill_kl": (lambda: DistillKLDivLoss(temperature=2.0),
                   lambda m: sparse_losses.SparseDistillKLDivLoss(m, temperature=2.0), True, TEACHER, TEACHER),
    "cosent": (lambda: CoSENTLoss(scale=20.0), lambda m: sparse_losses.SparseCoSENTLoss(m, scale=20.0), False, GOLD,
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

    columns = [q, p] + ([n[:, j] for j in range(K)] if with_negatives else [])
    model = ColumnModel(columns)
    splade = sparse_losses.SpladeLoss(model, theirs_inner(model), document_regularizer_weight=document_weight,
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
                           "query_threshold": None, "document_threshold": 3, "warmup_ratio": None,
                           "warmup": "quadratic", "loss": MarginMSELoss().config}
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


def test_labels_and_other_inputs_reach_the_inner_loss():
    q, p = _sparse(B, V, seed=6), _sparse(B, V, seed=7)
    labels = torch.tensor([0, 0, 1, 1, 2, 2])
    inner = InfoNCELoss(temperature=1.0, symmetric=False)
    wrapped = FlopsRegularizedLoss(inner, 0.5, 0.25)
    flops_terms = 0.5 * flops(q) + 0.25 * flops(p)
    assert wrapped(q, p, labels=labels).item() == pytest.approx((inner(q, p, labels=labels) + flops_terms).item())
    assert inner(q, p, labels=labels).item() != pytest.approx(inner(q, p).item())  # the labels change the loss

    class Recording(InfoNCELoss):
        def forward(self, *args, **kwargs):
            self.seen = kwargs
            return torch.zeros(())

    recording = Recording()
    FlopsRegularizedLoss(recording, 0.5, None)(q, p, guide=("guide",))
    assert recording.seen["guide"] == ("guide",)


class _State:
    """What SpladeRegularizerWeightSchedulerCallback reads of transformers' TrainerState."""

    def __init__(self, max_steps: int):
        self.max_steps, self.global_step = max_steps, 0


@pytest.mark.parametrize("kind", ["quadratic", "linear"])
@pytest.mark.parametrize("total, ratio", [(30, 1 / 3), (10, 0.25), (7, 1.0), (5, 0.1)])
def test_the_flops_warmup_equals_sentence_transformers_weight_scheduler_at_every_step(kind, total, ratio):
    from sentence_transformers.sparse_encoder.callbacks import SpladeRegularizerWeightSchedulerCallback

    q, p = _sparse(B, V, seed=6), _sparse(B, V, seed=7)
    inner = InfoNCELoss(temperature=1.0, symmetric=False)
    model = ColumnModel([q, p])
    splade = sparse_losses.SpladeLoss(model, CASES["infonce"][1](model), document_regularizer_weight=0.3,
                                      query_regularizer_weight=0.2)
    callback = SpladeRegularizerWeightSchedulerCallback(splade, scheduler_type=kind, warmup_ratio=ratio)
    state = _State(total)
    callback.on_train_begin(None, state, None)
    ours = FlopsRegularizedLoss(inner, 0.2, 0.3, warmup_ratio=ratio, warmup=kind)
    plain, full = inner(q, p), FlopsRegularizedLoss(inner, 0.2, 0.3)(q, p)
    rising = []
    for step in range(total):
        state.global_step = step
        callback.on_step_begin(None, state, None)
        ours.begin_step(step, total)
        factor = warmup_factor(step, total, ratio, kind)
        assert ours.weight_factor == factor
        assert (0.2 * factor, 0.3 * factor) == pytest.approx((splade.query_regularizer_weight,
                                                              splade.document_regularizer_weight), abs=1e-15)
        torch.testing.assert_close(ours(q, p), plain + factor * (full - plain), atol=1e-12, rtol=0)
        rising.append(factor)
    assert rising[0] == 0.0 and rising == sorted(rising) and (rising[-1] == 1.0) == (ratio < 1)
    if total * ratio >= 3:
        assert 0 < rising[1] < 1  # a real ramp, not a step


def test_without_a_warmup_ratio_the_weights_are_full_from_the_first_step():
    q, p = _sparse(B, V, seed=8), _sparse(B, V, seed=9)
    inner = InfoNCELoss(temperature=1.0, symmetric=False)
    for ratio in (None, 0.0):
        loss = FlopsRegularizedLoss(inner, 0.2, 0.3, warmup_ratio=ratio)
        loss.begin_step(0, 100)
        assert loss.weight_factor == 1.0
        assert loss(q, p).item() == FlopsRegularizedLoss(inner, 0.2, 0.3)(q, p).item()
