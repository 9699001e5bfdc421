"""Late interaction (ColBERT): MaxSim scoring and the in-batch contrastive loss over it, against plain loops written
here, and two gloo ranks against one process on the whole batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ranks import run_on_ranks
from torch import nn

from vembed.losses.late_interaction import LateInteractionLoss
from vembed.models.token_vectors import cat_tokens, pad_tokens, token_mask
from vembed.models.maxsim import maxsim

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


def test_cat_tokens_pads_to_the_longest_and_mask_reads_back():
    g = torch.Generator().manual_seed(2)
    a, b = _token_vectors([2, 1], 2, g), _token_vectors([3], 5, g)
    joined = cat_tokens([a, b])
    assert joined.shape == (3, 5, D)
    assert token_mask(joined).sum(1).tolist() == [2, 1, 3]


@pytest.mark.parametrize("with_negatives,with_labels", [(False, False), (True, False), (True, True)])
def test_loss_equals_cross_entropy_over_brute_force_maxsim(with_negatives, with_labels):
    g = torch.Generator().manual_seed(3)
    query = _token_vectors([4, 4, 4, 4], 4, g)  # expanded queries: every position a token
    positive = _token_vectors([3, 6, 1, 5], 6, g)
    negatives = _token_vectors([2, 4, 3, 1, 6, 2, 5, 3], 6, g).view(4, 2, 6, D) if with_negatives else None
    labels = torch.tensor([7, 8, 7, 9]) if with_labels else None
    loss = LateInteractionLoss(temperature=0.5)(query, positive, negatives, labels=labels)
    expected = _brute_loss(query, positive, negatives, 0.5, labels)
    assert loss.dtype == torch.float64
    assert abs(loss.item() - expected.item()) <= 1e-6 * max(1.0, abs(expected.item()))


def test_loss_refuses_one_vector_per_side():
    with pytest.raises(ValueError, match="token vectors"):
        LateInteractionLoss()(torch.randn(2, 4), torch.randn(2, 4))


# --- two gloo ranks = one process on the whole batch ---------------------------------------------------------------
Q_LENGTHS = [5, 5, 5, 5, 5, 5]  # expanded queries
P_LENGTHS = [2, 4, 3, 7, 1, 6]  # rank 0's positives are at most 4 long, rank 1's 7: the gather pads
N_LENGTHS = [[1, 3], [2, 2], [4, 1], [5, 2], [3, 3], [2, 6]]


class TokenEncoderWithLoss(nn.Module):
    """A linear token encoder (normalised, zero where there is no token) and the loss, as the loop wraps them."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Linear(IN, D, bias=False)
        self.loss = LateInteractionLoss(temperature=0.2, learnable_temperature=True)

    def encode(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        width = int(lengths.max())  # each rank pads only to its own longest row
        keep = torch.arange(width)[None, :] < lengths[:, None]
        return F.normalize(self.encoder(tokens[:, :width]), dim=-1) * keep[..., None]

    def forward(self, batch):
        queries, q_len, positives, p_len, negatives, n_len = batch
        n = negatives.shape[0]
        encoded = self.encode(negatives.flatten(0, 1), n_len.flatten())
        return self.encode(queries, q_len), self.encode(positives, p_len), encoded.view(n, K, *encoded.shape[1:])


def _global_token_batch():
    g = torch.Generator().manual_seed(99)
    n = WORLD * B
    return (torch.randn(n, 5, IN, generator=g), torch.tensor(Q_LENGTHS), torch.randn(n, 7, IN, generator=g),
            torch.tensor(P_LENGTHS), torch.randn(n, K, 6, IN, generator=g), torch.tensor(N_LENGTHS))


def _loss_and_grads(model, forward, batch):
    model.zero_grad()
    loss = model.loss(*forward(batch))
    loss.backward()
    return {"loss": loss.detach(), "grads": {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}}


def _late_interaction_rank(out_dir: str) -> None:
    rank = dist.get_rank()
    model = TokenEncoderWithLoss()
    ddp = nn.parallel.DistributedDataParallel(model)
    local = tuple(t[rank * B : (rank + 1) * B] for t in _global_token_batch())
    torch.save(_loss_and_grads(model, ddp, local), Path(out_dir) / f"rank{rank}.pt")


def test_late_interaction_two_ranks_equal_one_process_on_the_whole_batch(tmp_path):
    run_on_ranks(_late_interaction_rank, str(tmp_path), world=WORLD)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    model = TokenEncoderWithLoss()
    expected = _loss_and_grads(model, model, _global_token_batch())
    assert set(expected["grads"]) == {"encoder.weight", "loss._infonce.log_scale"}
    mean = torch.stack([r["loss"] for r in ranks]).mean()
    assert abs(mean - expected["loss"]) <= 1e-5 * expected["loss"].abs()
    for result in ranks:
        for name, grad in expected["grads"].items():
            difference = ((result["grads"][name] - grad).abs().max() / grad.abs().max()).item()
            assert difference <= 1e-5, f"{name}: relative difference {difference:.2e}"
