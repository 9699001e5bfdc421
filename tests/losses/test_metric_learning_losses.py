"""The metric-learning losses (vembed/losses/metric_learning.py): PML's losses on the global batch. Two gloo ranks with
DDP, each encoding half of a labelled batch, give the loss and the gradients (encoder and ArcFace's centres) of one
process on the whole batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ranks import run_on_ranks
from torch import nn

pytest.importorskip("pytorch_metric_learning")

WORLD, B, IN, OUT, CLASSES = 2, 6, 12, 8, 4  # ranks, images per rank, encoder sizes, classes
# Rank 0's six images, then rank 1's: some positives on the same rank, some only on the other one (classes 2, 3).
LABELS = torch.tensor([0, 1, 0, 2, 1, 3, 1, 0, 2, 3, 0, 1])
MAX_RELATIVE_DIFFERENCE = 1e-5


def _losses() -> dict:
    from vembed.losses.metric_learning import NTXentLoss, SubCenterArcFaceLoss, SupConLoss

    torch.manual_seed(7)  # ArcFace's centres: the same on every rank and in the single process
    return {"supcon": SupConLoss(temperature=0.1), "ntxent": NTXentLoss(temperature=0.07),
            "subcenter_arcface": SubCenterArcFaceLoss(CLASSES, OUT, margin=28.6, scale=16.0, sub_centers=2)}


class EncoderWithLoss(nn.Module):
    """What the task hands to DDP: the encoder and the loss in one module, so the loss's parameters are averaged."""

    def __init__(self, loss: nn.Module):
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Linear(IN, OUT)
        self.loss = loss

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss(F.normalize(self.encoder(images), dim=-1), labels)


def _images() -> torch.Tensor:
    return torch.randn(WORLD * B, IN, generator=torch.Generator().manual_seed(1234))


def _loss_and_gradients(model: nn.Module, forward: nn.Module, images, labels) -> dict:
    model.zero_grad()
    loss = forward(images, labels)
    loss.backward()
    return {"loss": loss.detach(), "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()}}


def _rank_worker(out_dir: str) -> None:
    rank = dist.get_rank()
    rows = slice(rank * B, (rank + 1) * B)
    results = {}
    for name, loss in _losses().items():
        model = EncoderWithLoss(loss)
        results[name] = _loss_and_gradients(model, nn.parallel.DistributedDataParallel(model), _images()[rows],
                                            LABELS[rows])
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.slow
def test_two_ranks_give_the_loss_and_gradients_of_one_process_on_the_whole_batch(tmp_path):
    run_on_ranks(_rank_worker, str(tmp_path), world=WORLD)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for name, loss in _losses().items():
        model = EncoderWithLoss(loss)
        expected = _loss_and_gradients(model, model, _images(), LABELS)
        assert expected["loss"] > 0
        for r, result in enumerate(ranks):
            got = result[name]
            assert abs(got["loss"] - expected["loss"]) <= MAX_RELATIVE_DIFFERENCE * expected["loss"], (name, r)
            assert got["grads"].keys() == expected["grads"].keys()
            for param, grad in expected["grads"].items():
                difference = ((got["grads"][param] - grad).abs().max() / grad.abs().max()).item()
                assert difference <= MAX_RELATIVE_DIFFERENCE, f"{name} rank {r} {param}: {difference:.2e}"
    # ArcFace's centres are the loss's own parameter: compared above, and trained (DDP averaged them).
    assert "loss.loss.W" in ranks[0]["subcenter_arcface"]["grads"]


def test_one_process_is_the_library_loss_of_the_batch():
    from pytorch_metric_learning import losses

    embeddings = F.normalize(_images()[:, :OUT], dim=-1)
    ours = _losses()
    assert ours["supcon"](embeddings, LABELS) == losses.SupConLoss(temperature=0.1)(embeddings, LABELS)
    assert ours["ntxent"](embeddings, LABELS) == losses.NTXentLoss(temperature=0.07)(embeddings, LABELS)
    arcface = ours["subcenter_arcface"]
    reference = losses.SubCenterArcFaceLoss(num_classes=CLASSES, embedding_size=OUT, margin=28.6, scale=16.0,
                                            sub_centers=2)
    reference.load_state_dict(arcface.loss.state_dict())
    assert arcface(embeddings, LABELS) == reference(embeddings, LABELS)
    assert arcface.loss.W.shape == (OUT, CLASSES * 2)
    assert arcface.config == {"name": "SubCenterArcFaceLoss", "num_classes": CLASSES, "embedding_dim": OUT,
                              "margin": 28.6, "scale": 16.0, "sub_centers": 2}
