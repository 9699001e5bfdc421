"""Scoring queries against documents: cosine scores in bounded-memory blocks, each query's top k, and the one rule
that orders documents, shared by corpus search, mining and pair evaluation.

The order: score descending; equal scores by document position, lowest first; non-finite scores (NaN embeddings)
count as -inf and so rank last. Positions, not relevance, break ties because search and mining know no relevance, and
one rule everywhere means a ranking is the same whichever caller built it (one process or several, one block or
many, pair or corpus evaluation). A collapsed model (every score equal) therefore ranks documents in corpus order:
it scores what that fixed order scores, never a perfect ranking by accident of the ties.

For that rule to hold, equal documents must get equal scores whatever block they are scored in and on whatever
machine: a float32 matrix product sums in an order that depends on the kernel the block's shape selects, so the same
query and document scored 1.0 in one block and 0.99999994 in another. Scores are therefore accumulated in float64
and rounded to float32 (`exact_scores`): kernels still differ, by ~1e-16, far below float32's resolution, so the
rounded scores agree (unless a score lies within ~1e-16 of a float32 rounding boundary: about one tie in 1e8).
The cost is the float64 product (2-3x a float32 one on a CPU, more on consumer GPUs), small beside encoding the
documents in the first place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

SCORE_CHUNK_ELEMENTS = 1 << 25  # query x document scores held at once (128 MiB of float32)
_SLACK = 8  # extra candidates taken from torch.topk so that a tie at the k-th place rarely needs a full sort


@dataclass
class TopK:
    """Each query's best documents: `scores` and corpus `indices`, `(n_queries, k)`, best first (-1/-inf: none)."""

    scores: torch.Tensor
    indices: torch.Tensor

    @classmethod
    def empty(cls, n_queries: int, k: int, device: torch.device | str = "cpu") -> "TopK":
        return cls(torch.full((n_queries, k), -torch.inf, device=device),
                   torch.full((n_queries, k), -1, dtype=torch.long, device=device))

    @property
    def k(self) -> int:
        return self.scores.shape[1]

    def merge(self, other: "TopK") -> "TopK":
        """The best `k` of both lists, in the module's order."""
        scores = torch.cat([self.scores, other.scores.to(self.scores.device)], dim=1)
        indices = torch.cat([self.indices, other.indices.to(self.indices.device)], dim=1)
        return best_of(scores, indices, self.k)


def best_of(scores: torch.Tensor, indices: torch.Tensor, k: int) -> TopK:
    """The best `k` of candidate lists `(n_queries, m)` (scores and corpus positions, in any order), in the module's
    order; missing entries (index -1) last."""
    # Sort by position first, then stably by score: ties end up lowest position first.
    positions = torch.where(indices < 0, torch.iinfo(torch.long).max, indices)
    by_position = positions.argsort(dim=1, stable=True)
    scores, indices = scores.gather(1, by_position), indices.gather(1, by_position)
    order = scores.argsort(dim=1, descending=True, stable=True)[:, :k]
    return TopK(scores.gather(1, order), indices.gather(1, order))


def exact_scores(score: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
    """`score(*tensors)` computed in float64 and rounded to float32, NaN as -inf (ranked last): the same float32
    scores for the same inputs whatever the block shape or machine (the module's docstring says why)."""
    return torch.nan_to_num(score(*(tensor.double() for tensor in tensors)).float(), nan=-torch.inf)


def embeddings_for_scoring(query_emb: torch.Tensor, doc_emb: torch.Tensor, normalize: bool = True
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Both as float32 on the queries' device, L2-normalised (scores are cosines) unless `normalize=False`; each row
    normalised in float64, so equal rows stay equal whatever the kernel."""
    if query_emb.ndim != 2 or doc_emb.ndim != 2 or query_emb.shape[1] != doc_emb.shape[1]:
        raise ValueError(f"embeddings must be (n, dim) with the same dim, got {tuple(query_emb.shape)} and "
                         f"{tuple(doc_emb.shape)}")
    queries, docs = query_emb.float(), doc_emb.float().to(query_emb.device)
    if normalize:
        queries, docs = (F.normalize(side.double(), dim=-1).float() for side in (queries, docs))
    return queries, docs


def scores_of(queries: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
    """`queries @ docs.T` by `exact_scores`."""
    return exact_scores(lambda q, d: q @ d.T, queries, docs)


def query_chunks(queries: torch.Tensor, docs: torch.Tensor, *, chunk_size: int | None = None,
                 chunk_elements: int = SCORE_CHUNK_ELEMENTS) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(first query, last query + 1, their scores against every document) for chunks of queries: `chunk_size`
    queries at once, by default as many as keep a chunk within `chunk_elements` scores (at least one query)."""
    chunk = chunk_size or max(1, chunk_elements // max(len(docs), 1))
    for start in range(0, len(queries), chunk):
        stop = min(start + chunk, len(queries))
        yield start, stop, scores_of(queries[start:stop], docs)


def block_top_k(scores: torch.Tensor, k: int, *, doc_offset: int = 0) -> TopK:
    """The `k` best of a block of scores `(n_queries, n_documents)` in the module's order (indices + `doc_offset`);
    -1/-inf beyond the block's size."""
    n = scores.shape[1]
    take = min(n, k + _SLACK)
    values, where = scores.topk(take, dim=1)
    if take < n:
        # torch.topk picks among equal scores arbitrarily: where the k-th score equals the last one taken, the tie may
        # continue past what was taken, so those rows are sorted in full (a stable sort keeps equals by position).
        cut = values[:, k - 1] == values[:, -1]
        if cut.any():
            rows = cut.nonzero().squeeze(1)
            sorted_values, sorted_where = scores[rows].sort(dim=1, descending=True, stable=True)
            values[rows], where[rows] = sorted_values[:, :take], sorted_where[:, :take]
    return TopK.empty(len(scores), k, scores.device).merge(TopK(values, where + doc_offset))


def top_k(query_emb: torch.Tensor, doc_emb: torch.Tensor, k: int, *, doc_offset: int = 0,
          normalize: bool = True, chunk_elements: int = SCORE_CHUNK_ELEMENTS) -> TopK:
    """The `k` best documents of `doc_emb` for every query, by cosine (or dot product with `normalize=False`).

    `doc_offset` is added to the returned indices (the corpus position of `doc_emb[0]`). Scores are computed in
    blocks of at most `chunk_elements`.
    """
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    queries, docs = embeddings_for_scoring(query_emb, doc_emb, normalize)
    n_q, n_d = len(queries), len(docs)
    if n_d == 0 or n_q == 0:
        return TopK.empty(n_q, k, queries.device)
    doc_chunk = max(1, min(n_d, chunk_elements // max(1, min(n_q, 1024))))
    query_chunk = max(1, chunk_elements // doc_chunk)
    parts = []
    for q_start in range(0, n_q, query_chunk):
        q_stop = min(q_start + query_chunk, n_q)
        best = TopK.empty(q_stop - q_start, k, queries.device)
        for d_start in range(0, n_d, doc_chunk):
            d_stop = min(d_start + doc_chunk, n_d)
            scores = scores_of(queries[q_start:q_stop], docs[d_start:d_stop])
            best = best.merge(block_top_k(scores, k, doc_offset=doc_offset + d_start))
        parts.append(best)
    return TopK(torch.cat([p.scores for p in parts]), torch.cat([p.indices for p in parts]))


def first_ranks(scores: torch.Tensor, wanted: torch.Tensor) -> torch.Tensor:
    """Each row's 1-based rank, in the module's order over the whole row, of its best `wanted` document.

    `scores` `(n_queries, n_documents)`; `wanted` a boolean mask of the same shape with at least one True per row.
    """
    best = scores.masked_fill(~wanted, -torch.inf).max(dim=1).values[:, None]
    at_best = wanted & (scores == best)
    position = at_best.int().argmax(dim=1)[:, None]  # the first True: the lowest position among equal best scores
    columns = torch.arange(scores.shape[1], device=scores.device)[None, :]
    ahead = (scores > best) | ((scores == best) & (columns < position))
    return 1 + ahead.sum(dim=1)
