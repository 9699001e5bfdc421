"""MaxSim, the late-interaction score (ColBERT): for a query and a document, the sum over the query's tokens of the
best dot product with any of the document's tokens. The one place it is computed: the loss scores batches with it,
search will score corpus blocks with it.

Token vectors follow `vembed.models.token_vectors`: `(n, T, d)` with zero vectors where there is no token. Document
padding is excluded from the max (not merely scored 0: real scores can be negative); query padding adds nothing.
"""

from __future__ import annotations

import torch

from vembed.models.token_vectors import token_mask

# Elements of the (queries, query tokens, documents, document tokens) similarity block computed at once: documents are
# scored in blocks small enough to stay under it (4 bytes each: 256 MiB in float32), whatever the batch.
MAX_BLOCK_ELEMENTS = 1 << 26


def maxsim(queries: torch.Tensor, documents: torch.Tensor,
           max_block_elements: int = MAX_BLOCK_ELEMENTS) -> torch.Tensor:
    """`(Bq, Bd)` scores of queries `(Bq, Tq, d)` against documents `(Bd, Td, d)`, differentiable in both.

    A document without any token scores 0 with every query."""
    if queries.dim() != 3 or documents.dim() != 3 or queries.shape[2] != documents.shape[2]:
        raise ValueError(f"maxsim takes (Bq, Tq, d) queries and (Bd, Td, d) documents; got {tuple(queries.shape)} "
                         f"and {tuple(documents.shape)}")
    if documents.shape[1] == 0:  # no document has a token slot (a search chunk of empty documents): the max is over
        return queries.new_zeros(queries.shape[0], documents.shape[0])  # nothing, every score 0
    query_tokens = token_mask(queries)  # (Bq, Tq)
    document_tokens = token_mask(documents)  # (Bd, Td)
    per_document = max(1, queries.shape[0] * queries.shape[1] * documents.shape[1])
    block = max(1, max_block_elements // per_document)
    scores = []
    for start in range(0, documents.shape[0], block):
        kept = document_tokens[start : start + block]  # (c, Td)
        similarity = torch.einsum("qid,cjd->qcij", queries, documents[start : start + block])
        similarity = similarity.masked_fill(~kept[None, :, None, :], float("-inf"))
        best = similarity.amax(dim=-1)  # (Bq, c, Tq)
        scored = query_tokens[:, None, :] & kept.any(dim=-1)[None, :, None]
        scores.append(best.masked_fill(~scored, 0.0).sum(dim=-1))
    return torch.cat(scores, dim=1) if scores else queries.new_zeros(queries.shape[0], 0)


def maxsim_candidates(queries: torch.Tensor, candidates: torch.Tensor,
                      max_block_elements: int = MAX_BLOCK_ELEMENTS) -> torch.Tensor:
    """`(B, c)` scores of each query `(B, Tq, d)` against its own c candidates `(B, c, Td, d)` only (a candidate list
    per query, as distillation scores it), by the rules of `maxsim`; queries are scored in blocks of rows."""
    if queries.dim() != 3 or candidates.dim() != 4 or candidates.shape[0] != queries.shape[0] \
            or candidates.shape[3] != queries.shape[2]:
        raise ValueError(f"maxsim_candidates takes (B, Tq, d) queries and (B, c, Td, d) candidates; got "
                         f"{tuple(queries.shape)} and {tuple(candidates.shape)}")
    if candidates.shape[2] == 0:  # no candidate has a token slot: every score 0, as in `maxsim`
        return queries.new_zeros(queries.shape[0], candidates.shape[1])
    per_query = max(1, queries.shape[1] * candidates.shape[1] * candidates.shape[2])
    block = max(1, max_block_elements // per_query)
    scores = []
    for start in range(0, queries.shape[0], block):
        query, candidate = queries[start : start + block], candidates[start : start + block]
        kept = token_mask(candidate.flatten(0, 1)).view(candidate.shape[:3])  # (b, c, Td)
        similarity = torch.einsum("bid,bcjd->bcij", query, candidate)
        best = similarity.masked_fill(~kept[:, :, None, :], float("-inf")).amax(dim=-1)  # (b, c, Tq)
        scored = token_mask(query)[:, None, :] & kept.any(dim=-1)[:, :, None]
        scores.append(best.masked_fill(~scored, 0.0).sum(dim=-1))
    return torch.cat(scores, dim=0) if scores else queries.new_zeros(0, candidates.shape[1])


__all__ = ["MAX_BLOCK_ELEMENTS", "maxsim", "maxsim_candidates"]
