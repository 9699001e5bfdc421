"""Exact nearest-neighbour search of a corpus: blocks of documents folded into a running top-k, any number of ranks.

Memory is bounded for corpora of millions of documents: documents are encoded and scored a block at a time (each
process its own share of each block), only `(n_queries, k)` best scores and positions are kept, and the processes'
top-k lists are merged at the end. Exact search is brute force on purpose: it is the reference the metrics are
defined against (an approximate index such as faiss is an accelerator a caller may choose, not the default).

Scores, the top-k of a block and the order of equal scores are `vembed.retrieval.scoring`'s (score descending, then
corpus position): one process and several give the same ranking, ties included.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from vembed.models.encoding import encode_sides, share_bounds
from vembed.retrieval.scoring import TopK, best_of, top_k

if TYPE_CHECKING:
    from accelerate import Accelerator

    from vembed.data.records import Side
    from vembed.models.base import EmbeddingAdapter
    from vembed.retrieval.cache import EmbeddingCache

DOCUMENTS_PER_BLOCK = 1 << 15  # documents encoded per process before their scores are folded into the top-k


def merge_across_processes(local: TopK, accelerator: "Accelerator | None") -> TopK:
    """Every process's top-k merged into the global one (every process returns the same)."""
    if accelerator is None or accelerator.num_processes == 1:
        return local
    scores = accelerator.gather(local.scores.contiguous()).reshape(accelerator.num_processes, *local.scores.shape)
    indices = accelerator.gather(local.indices.contiguous()).reshape(accelerator.num_processes, *local.indices.shape)
    return best_of(torch.cat(list(scores), dim=1), torch.cat(list(indices), dim=1), local.k)


def document_blocks(
    adapter: "EmbeddingAdapter",
    documents: Sequence["Side"],
    *,
    batch_size: int = 64,
    accelerator: "Accelerator | None" = None,
    documents_per_block: int = DOCUMENTS_PER_BLOCK,
    forward: "Callable[[dict[str, Any]], torch.Tensor] | None" = None,
    show_progress: bool = False,
    cache: "EmbeddingCache | None" = None,
) -> Iterator[tuple[int, torch.Tensor]]:
    """(corpus position of the first row, embeddings) of this process's share of each block of the corpus.

    Every process runs the same number of forwards (sharded models need that); each block of
    `documents_per_block x num_processes` documents is split into contiguous shares. With a `cache` (an opened
    `vembed.retrieval.cache.EmbeddingCache`), a block every process finds stored is read instead of encoded (one
    process missing its share makes all encode it: the forwards stay in step) and each encoded share is stored.
    """
    world = accelerator.num_processes if accelerator is not None else 1
    rank = accelerator.process_index if accelerator is not None else 0
    block = documents_per_block * world
    starts: Iterable[int] = range(0, len(documents), block)
    if show_progress and rank == 0:
        from tqdm.auto import tqdm

        starts = tqdm(starts, desc="corpus", unit="block", leave=False)
    for start in starts:
        part = documents[start : start + block]
        first, stop = share_bounds(len(part), rank, world)
        stored = cache.load(start + first, start + stop) if cache is not None else None
        if cache is not None and _on_every_process(stored is not None, accelerator):
            cache.reused += 1
            yield start + first, stored.to(accelerator.device if accelerator is not None else "cpu")
            continue
        emb = encode_sides(adapter, part, batch_size=batch_size, accelerator=accelerator, forward=forward,
                           gather=False)
        if cache is not None:
            cache.store(start + first, start + stop, emb)
        yield start + first, emb


def _on_every_process(flag: bool, accelerator: "Accelerator | None") -> bool:
    if accelerator is None or accelerator.num_processes == 1:
        return flag
    flags = accelerator.gather(torch.tensor([int(flag)], device=accelerator.device))
    return bool(flags.min().item())


def search(
    query_emb: torch.Tensor,
    blocks: Iterable[tuple[int, torch.Tensor]],
    k: int,
    *,
    accelerator: "Accelerator | None" = None,
    normalize: bool = True,
    score_block: Callable[..., TopK] = top_k,
) -> TopK:
    """Fold `blocks` ((corpus offset, document embeddings), e.g. from `document_blocks`) into each query's top-k,
    then merge the processes' lists: every process returns the global top-k. `score_block` finds one block's top-k
    (`top_k`'s signature; mining passes faiss's when asked)."""
    best = TopK.empty(len(query_emb), k, query_emb.device)
    for offset, emb in blocks:
        if len(emb):
            best = best.merge(score_block(query_emb, emb, k, doc_offset=offset, normalize=normalize))
    return merge_across_processes(best, accelerator)


def search_corpus(
    adapter: "EmbeddingAdapter",
    queries: Sequence["Side"],
    documents: Sequence["Side"],
    k: int,
    *,
    batch_size: int = 64,
    accelerator: "Accelerator | None" = None,
    documents_per_block: int = DOCUMENTS_PER_BLOCK,
    forward: "Callable[[dict[str, Any]], torch.Tensor] | None" = None,
    show_progress: bool = False,
) -> TopK:
    """Encode `queries` (shared by every process) and the corpus (each process its share), and return each query's
    `k` best documents by cosine. The same on one process and on many."""
    kwargs = dict(batch_size=batch_size, accelerator=accelerator, forward=forward)
    query_emb = encode_sides(adapter, queries, desc="queries", show_progress=show_progress, **kwargs)
    blocks = document_blocks(adapter, documents, documents_per_block=documents_per_block,
                             show_progress=show_progress, **kwargs)
    return search(query_emb, blocks, min(k, max(1, len(documents))), accelerator=accelerator)
