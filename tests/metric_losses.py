"""The 2-rank check every metric-learning loss takes: a linear encoder and the loss in one module under DDP, each rank
encoding half of a labelled batch, against one process on the whole batch (loss and every gradient, the loss's own
parameters included). Used by tests/classification/test_metric_learning_losses.py and
tests/classification/test_pml.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ranks import run_on_ranks
from torch import nn

WORLD, B, IN, OUT = 2, 6, 12, 8  # ranks, images per rank, encoder sizes
# Rank 0's six images, then rank 1's: some positives on the same rank, some only on the other one (classes 2, 3).
LABELS = torch.tensor([0, 1, 0, 2, 1, 3, 1, 0, 2, 3, 0, 1])
MAX_RELATIVE_DIFFERENCE = 1e-5


class EncoderWithLoss(nn.Module):
    """What the task hands to DDP: the encoder and the loss in one module, so the loss's parameters are averaged."""

    def __init__(self, loss: nn.Module):
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Linear(IN, OUT)
        self.loss = loss

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss(F.normalize(self.encoder(images), dim=-1), labels)


def images() -> torch.Tensor:
    return torch.randn(WORLD * B, IN, generator=torch.Generator().manual_seed(1234))


def loss_and_gradients(model: nn.Module, forward: nn.Module, inputs, labels) -> dict:
    model.zero_grad()
    loss = forward(inputs, labels)
    loss.backward()
    return {"loss": loss.detach(), "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()}}


def _rank_worker(out_dir: str, make_losses: Callable[[], dict[str, nn.Module]]) -> None:
    rank = dist.get_rank()
    rows = slice(rank * B, (rank + 1) * B)
    results = {}
    for name, loss in make_losses().items():
        model = EncoderWithLoss(loss)
        results[name] = loss_and_gradients(model, nn.parallel.DistributedDataParallel(model), images()[rows],
                                           LABELS[rows])
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


def check_two_ranks_equal_one_process(out_dir: Path, make_losses: Callable[[], dict[str, nn.Module]]) -> list[dict]:
    """Each loss `make_losses()` builds (a module-level function: the ranks are spawned), on 2 gloo ranks and on one
    process; fails naming the loss, rank and parameter that differ. Returns each rank's results."""
    run_on_ranks(_rank_worker, str(out_dir), make_losses, world=WORLD)
    ranks = [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(WORLD)]
    for name, loss in make_losses().items():
        model = EncoderWithLoss(loss)
        expected = loss_and_gradients(model, model, images(), LABELS)
        assert expected["loss"] > 0, name
        for r, result in enumerate(ranks):
            got = result[name]
            assert abs(got["loss"] - expected["loss"]) <= MAX_RELATIVE_DIFFERENCE * expected["loss"], (name, r)
            assert got["grads"].keys() == expected["grads"].keys()
            for param, grad in expected["grads"].items():
                difference = ((got["grads"][param] - grad).abs().max() / grad.abs().max()).item()
                assert difference <= MAX_RELATIVE_DIFFERENCE, f"{name} rank {r} {param}: {difference:.2e}"
    return ranks
