"""DDP exactness: two gloo ranks with DistributedDataParallel give the gradients of one process on the whole batch.

Each test launches two real gloo ranks (tests/ranks.py). Every rank encodes its half of a fixed global
batch with a small linear encoder, wrapped in DDP together with the loss (as the training loop does), and writes
its loss and gradients (after DDP's averaging) to a file; the pytest process then computes the same loss on the
concatenated batch with no process group and compares.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ranks import run_on_ranks
from torch import nn

from vembed.losses.base import EmbeddingLoss
from vembed.losses.contrastive import InfoNCELoss, SigLIPLoss
from vembed.losses.matryoshka import MatryoshkaLoss

WORLD, B, K, IN, OUT = 2, 4, 2, 16, 8  # ranks, pairs per rank, hard negatives per pair, encoder in/out sizes
MAX_RELATIVE_DIFFERENCE = 1e-5


def _infonce() -> EmbeddingLoss:
    return InfoNCELoss(temperature=0.05, learnable_temperature=True, symmetric=True)


def _siglip() -> EmbeddingLoss:
    return SigLIPLoss(temperature=0.1, learnable_temperature=True, bias_init=-3.0)


def _matryoshka_infonce() -> EmbeddingLoss:
    return MatryoshkaLoss(_infonce(), dims=[4, OUT], weights=[1.0, 0.5])


def _infonce_qwen3_options() -> EmbeddingLoss:
    # false-negative masking and the query-query / document-document terms: their self columns and labels are
    # offset by rank; margin 0 so that the random encoder's scores really get masked.
    return InfoNCELoss(temperature=0.05, learnable_temperature=True, symmetric=True, false_negative_margin=0.0,
                       query_query=True, document_document=True)


LOSS_BUILDERS = {"infonce": _infonce, "siglip": _siglip, "matryoshka_infonce": _matryoshka_infonce,
                 "infonce_qwen3_options": _infonce_qwen3_options,
                 "infonce_labels": _infonce, "infonce_qwen3_options_labels": _infonce_qwen3_options,
                 "siglip_labels": _siglip}
# Class ids of the global batch (rank 0's four pairs, then rank 1's): same-label pairs within a rank and across ranks.
LABELS = torch.tensor([0, 1, 2, 0, 1, 3, 0, 4])


class EncoderWithLoss(nn.Module):
    """What the loop hands to DDP: the encoder and the loss in one module, so the loss's parameters are averaged."""

    def __init__(self, loss: EmbeddingLoss):
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Linear(IN, OUT)
        self.loss = loss

    def forward(self, queries, positives, negatives):
        return tuple(F.normalize(self.encoder(x), dim=-1) for x in (queries, positives, negatives))


def _global_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    return (
        torch.randn(WORLD * B, IN, generator=generator),
        torch.randn(WORLD * B, IN, generator=generator),
        torch.randn(WORLD * B, K, IN, generator=generator),
    )


def _loss_and_gradients(model: nn.Module, forward: nn.Module, batch, labels=None) -> dict:
    model.zero_grad()
    loss = model.loss(*forward(*batch), labels=labels)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    return {"loss": loss.detach(), "grads": grads}


def _rank_worker(case: str, out_dir: str) -> None:
    """One DDP rank: its half of the global batch (rank 0 first), loss, backward, gradients to a file."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    model = EncoderWithLoss(LOSS_BUILDERS[case]())
    ddp = nn.parallel.DistributedDataParallel(model)
    local = tuple(t[rank * B : (rank + 1) * B] for t in _global_batch())
    labels = LABELS[rank * B : (rank + 1) * B] if case.endswith("_labels") else None
    torch.save(_loss_and_gradients(model, ddp, local, labels), Path(out_dir) / f"rank{rank}.pt")


def _relative_difference(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def _assert_ddp_matches_single_process(case: str, tmp_path: Path) -> float:
    run_on_ranks(_rank_worker, case, str(tmp_path), world=WORLD)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]

    model = EncoderWithLoss(LOSS_BUILDERS[case]())
    expected = _loss_and_gradients(model, model, _global_batch(), LABELS if case.endswith("_labels") else None)

    # The global loss is the mean of the per-rank losses.
    mean_loss = torch.stack([r["loss"] for r in ranks]).mean()
    assert _relative_difference(mean_loss, expected["loss"]) <= MAX_RELATIVE_DIFFERENCE
    worst = 0.0
    for r, result in enumerate(ranks):
        assert result["grads"].keys() == expected["grads"].keys()
        for name, grad in expected["grads"].items():
            difference = _relative_difference(result["grads"][name], grad)
            assert difference <= MAX_RELATIVE_DIFFERENCE, f"rank {r}, {name}: relative difference {difference:.2e}"
            worst = max(worst, difference)
    print(f"{case}: max relative gradient difference {worst:.2e}")
    return worst


def test_infonce_ddp_gradients_match_single_process_full_batch(tmp_path):
    # symmetric, with hard negatives, learnable temperature (its gradient is compared too)
    _assert_ddp_matches_single_process("infonce", tmp_path)


def test_siglip_ddp_gradients_match_single_process_full_batch(tmp_path):
    # with hard negatives; learnable scale and bias
    _assert_ddp_matches_single_process("siglip", tmp_path)


def test_matryoshka_infonce_ddp_gradients_match_single_process_full_batch(tmp_path):
    _assert_ddp_matches_single_process("matryoshka_infonce", tmp_path)


def test_infonce_false_negative_masking_and_qq_dd_terms_ddp_match_single_process_full_batch(tmp_path):
    _assert_ddp_matches_single_process("infonce_qwen3_options", tmp_path)


@pytest.mark.parametrize("case", ["infonce_labels", "infonce_qwen3_options_labels", "siglip_labels"])
def test_same_label_masking_ddp_gradients_match_single_process_full_batch(tmp_path, case):
    # labels gathered across ranks: a rank-0 row's same-label record on rank 1 is dropped like a local one
    _assert_ddp_matches_single_process(case, tmp_path)


def test_loss_parameters_are_compared_in_ddp_checks():
    # Guards the checks above: they compare the loss's own parameters, not only the encoder's.
    names = {
        case: [n for n, p in EncoderWithLoss(build()).named_parameters() if p.requires_grad]
        for case, build in LOSS_BUILDERS.items()
    }
    assert names["infonce"] == ["encoder.weight", "encoder.bias", "loss.log_scale"]
    assert names["siglip"] == ["encoder.weight", "encoder.bias", "loss.log_scale", "loss.bias"]
    assert names["matryoshka_infonce"] == ["encoder.weight", "encoder.bias", "loss.loss.log_scale"]
    assert names["infonce_qwen3_options"] == names["infonce"]


# --- the scored and triplet losses (vembed/losses/scored.py, triplet.py) ---------------------------------------------
# One launch computes every case on both ranks (a launch costs seconds; the cases cost milliseconds).

def _scored_cases() -> dict:
    from vembed.losses.distillation import EmbeddingMSELoss
    from vembed.losses.scored import AnglELoss, CoSENTLoss, CosineSimilarityLoss, DistillKLDivLoss, MarginMSELoss
    from vembed.losses.gist import GISTEmbedLoss
    from vembed.losses.triplet import BatchHardTripletLoss, TripletLoss

    return {
        "cosent": (lambda: CoSENTLoss(scale=20.0), "pair"),
        "angle": (lambda: AnglELoss(scale=20.0), "pair"),
        "cosine_mse": (CosineSimilarityLoss, "pair"),
        "triplet": (lambda: TripletLoss(margin=0.5, distance="euclidean"), None),
        "batch_hard_triplet": (lambda: BatchHardTripletLoss(margin=0.5), "labels"),
        "batch_hard_triplet_cosine": (lambda: BatchHardTripletLoss(margin=0.2, distance="cosine"), "labels"),
        "margin_mse": (MarginMSELoss, "teacher"),
        "distill_kl": (lambda: DistillKLDivLoss(temperature=0.5), "teacher"),
        "matryoshka_cosent": (lambda: MatryoshkaLoss(CoSENTLoss(), dims=[OUT, 4], weights=[1.0, 0.5]), "pair"),
        "matryoshka_batch_hard_triplet": (lambda: MatryoshkaLoss(BatchHardTripletLoss(margin=0.5), dims=[OUT, 4]),
                                          "labels"),
        "gist": (lambda: GISTEmbedLoss(temperature=0.05, margin=0.05), "guide"),
        "gist_relative_no_blocks": (lambda: GISTEmbedLoss(temperature=0.05, margin_strategy="relative", margin=0.1,
                                                          contrast_anchors=False, contrast_positives=False), "guide"),
        "embedding_mse": (EmbeddingMSELoss, "teacher_embeddings"),
    }


# Gold scores with ties across ranks, and teacher scores of [positive, K negatives].
PAIR_SCORES = torch.tensor([0.9, 0.1, 0.5, 0.3, 0.5, 0.0, 0.75, 0.1])
TEACHER_SCORES = torch.randn(WORLD * B, 1 + K, generator=torch.Generator().manual_seed(5))
TEACHER_EMBEDDINGS = F.normalize(torch.randn(WORLD * B, OUT, generator=torch.Generator().manual_seed(6)), dim=-1)


def _scored_inputs(kind: str | None, rows: slice) -> dict:
    if kind == "pair":
        return {"scores": PAIR_SCORES[rows]}
    if kind == "teacher":
        return {"scores": TEACHER_SCORES[rows]}
    if kind == "labels":
        return {"labels": LABELS[rows]}
    if kind == "teacher_embeddings":  # a teacher's vectors of the rows, as the collator looks them up
        return {"teacher": TEACHER_EMBEDDINGS[rows]}
    if kind == "guide":  # the guide's embeddings: fixed, unrelated to the encoder, so some candidates get masked
        generator = torch.Generator().manual_seed(9)
        guide = [torch.randn(WORLD * B, 4, generator=generator), torch.randn(WORLD * B, 4, generator=generator),
                 torch.randn(WORLD * B, K, 4, generator=generator)]
        return {"guide": tuple(t[rows] for t in guide)}
    return {}


def _scored_loss_and_gradients(model: nn.Module, forward: nn.Module, batch, inputs: dict) -> dict:
    model.zero_grad()
    loss = model.loss(*forward(*batch), **inputs)
    loss.backward()
    return {"loss": loss.detach(), "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                             if p.requires_grad and p.grad is not None}}


def _scored_rank_worker(out_dir: str) -> None:
    torch.set_num_threads(1)
    rank = dist.get_rank()
    rows = slice(rank * B, (rank + 1) * B)
    results = {}
    for case, (build, kind) in _scored_cases().items():
        model = EncoderWithLoss(build())
        ddp = nn.parallel.DistributedDataParallel(model)
        local = tuple(t[rows] for t in _global_batch())
        results[case] = _scored_loss_and_gradients(model, ddp, local, _scored_inputs(kind, rows))
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


def test_scored_and_triplet_losses_ddp_gradients_match_single_process_full_batch(tmp_path):
    # cosent / angle / batch-hard compare pairs across the whole batch: each rank gathers the other's; the others
    # are per-pair means. Every case: two ranks' mean loss and DDP-averaged gradients = one process on 8 pairs.
    run_on_ranks(_scored_rank_worker, str(tmp_path), world=WORLD)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    everything = slice(0, WORLD * B)
    for case, (build, kind) in _scored_cases().items():
        model = EncoderWithLoss(build())
        expected = _scored_loss_and_gradients(model, model, _global_batch(), _scored_inputs(kind, everything))
        assert expected["loss"] > 0, case
        _assert_ranks_equal_one_process(ranks, case, expected)


def _assert_ranks_equal_one_process(ranks: list[dict], case: str, expected: dict) -> None:
    """The ranks' mean loss and each rank's averaged gradients equal one process's on the whole batch."""
    mean_loss = torch.stack([r[case]["loss"] for r in ranks]).mean()
    assert _relative_difference(mean_loss, expected["loss"]) <= MAX_RELATIVE_DIFFERENCE, case
    for r, result in enumerate(ranks):
        assert result[case]["grads"].keys() == expected["grads"].keys(), case
        for name, grad in expected["grads"].items():
            difference = _relative_difference(result[case]["grads"][name], grad)
            assert difference <= MAX_RELATIVE_DIFFERENCE, f"{case}, rank {r}, {name}: {difference:.2e}"


# --- FLOPS regularisation of sparse vectors (vembed/losses/sparse.py) ------------------------------------------------
SPARSE_B, VOCAB = 6, 12


class SparseEncoderWithLoss(nn.Module):
    """What the loop hands to DDP: a small encoder of non-negative, partly zero vectors and the loss in one module."""

    def __init__(self, loss: nn.Module):
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Linear(IN, VOCAB)
        self.loss = loss

    def forward(self, queries, positives, negatives):
        return tuple(torch.relu(self.encoder(x)) for x in (queries, positives, negatives))


def _flops_cases() -> dict:
    from vembed.losses.scored import MarginMSELoss
    from vembed.losses.sparse import FlopsRegularizedLoss

    return {
        "infonce": lambda: FlopsRegularizedLoss(InfoNCELoss(temperature=1.0, symmetric=False), 0.5, 0.3),
        "infonce_thresholds": lambda: FlopsRegularizedLoss(InfoNCELoss(temperature=1.0, symmetric=False), 0.5, 0.3,
                                                           6, 5),
        "margin_mse": lambda: FlopsRegularizedLoss(MarginMSELoss(), 0.5, 0.3),
        "infonce_warming_up": lambda: _at_step(FlopsRegularizedLoss(InfoNCELoss(temperature=1.0, symmetric=False),
                                                                    0.5, 0.3, warmup_ratio=0.5), 1, 4),
    }


def _at_step(loss, step: int, total_steps: int):
    """`loss` as the loop leaves it before step `step` of `total_steps` (here: a quarter of its FLOPS weights)."""
    loss.begin_step(step, total_steps)
    assert loss.weight_factor == 0.25
    return loss


def _sparse_batch() -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(1234)
    return (torch.randn(WORLD * SPARSE_B, IN, generator=generator),
            torch.randn(WORLD * SPARSE_B, IN, generator=generator),
            torch.randn(WORLD * SPARSE_B, K, IN, generator=generator))


SPARSE_TEACHER_SCORES = torch.randn(WORLD * SPARSE_B, 1 + K, generator=torch.Generator().manual_seed(5))


def _flops_rank_worker(out_dir: str) -> None:
    torch.set_num_threads(1)
    rank = dist.get_rank()
    rows = slice(rank * SPARSE_B, (rank + 1) * SPARSE_B)
    results = {}
    for case, build in _flops_cases().items():
        model = SparseEncoderWithLoss(build())
        ddp = nn.parallel.DistributedDataParallel(model)
        local = tuple(t[rows] for t in _sparse_batch())
        results[case] = _scored_loss_and_gradients(model, ddp, local, {"scores": SPARSE_TEACHER_SCORES[rows]})
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


def test_flops_regularised_losses_ddp_gradients_match_single_process_full_batch(tmp_path):
    # FLOPS is a function of the global batch's mean: each rank's column sums are summed over ranks with gradients.
    run_on_ranks(_flops_rank_worker, str(tmp_path), world=WORLD, timeout=120)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for case, build in _flops_cases().items():
        model = SparseEncoderWithLoss(build())
        expected = _scored_loss_and_gradients(model, model, _sparse_batch(), {"scores": SPARSE_TEACHER_SCORES})
        regulariser = expected["loss"] - model.loss.loss(*model(*_sparse_batch()), scores=SPARSE_TEACHER_SCORES)
        assert regulariser > 1e-3, case  # the FLOPS terms weigh in the comparison
        _assert_ranks_equal_one_process(ranks, case, expected)
