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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from vembed.models.encoding import encode_sides, share_bounds, unwrapped
from vembed.retrieval import SCORINGS
from vembed.retrieval.scoring import TopK, best_of, top_k

if TYPE_CHECKING:
    from accelerate import Accelerator

    from vembed.data.records import Side
    from vembed.models.base import EmbeddingAdapter
    from vembed.retrieval.cache import EmbeddingCache

DOCUMENTS_PER_BLOCK = 1 << 15  # documents encoded per process before their scores are folded into the top-k


def cosine_pairs(queries: torch.Tensor, block: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`(p,)` cosine of query i `(p, dim)` with block row `rows[i]` (mining scores every positive so)."""
    docs = F.normalize(block.float()[rows].to(queries.device), dim=-1)
    return (F.normalize(queries.float(), dim=-1) * docs).sum(-1)


@dataclass(frozen=True)
class Scoring:
    """How the documents of one embedding kind are kept and scored, chosen by the adapter's `embedding_kind` in
    SCORINGS: one vector per side by cosine (here), token vectors by MaxSim (vembed.retrieval.maxsim_search), sparse
    vectors by dot product through an inverted index (vembed.retrieval.sparse_index)."""

    top_k: Callable[..., TopK]  # one block's top-k for every query (`top_k`'s signature)
    pair_scores: Callable[[torch.Tensor, Any, torch.Tensor], torch.Tensor]  # `cosine_pairs`' signature
    encode_share: Callable[..., Any] | None = None  # documents -> a block, given encode_sides' arguments (None: it)
    documents_per_block: int = DOCUMENTS_PER_BLOCK  # the default block, per process
    stored: Any = None  # a block class with state()/from_state() for the cache; None: blocks are tensors
    faiss: bool = True  # whether faiss's flat index can score its blocks (one vector per document)
    name: str = "cosine"  # the score, as commands report it
    vectors: str = "one vector per document"  # what the model gives, as refusals name it
    # (adapter, encoded queries) -> what top_k and pair_scores take (sparse vectors: CSR, once); None: the tensor
    prepare_queries: Callable[["EmbeddingAdapter", torch.Tensor], Any] | None = None

    def queries(self, adapter: "EmbeddingAdapter", embeddings: torch.Tensor) -> Any:
        """The encoded queries as this Scoring's top_k takes them (`adapter`: unwrapped, for its settings)."""
        return embeddings if self.prepare_queries is None else self.prepare_queries(adapter, embeddings)


SCORINGS.register("single")(Scoring(top_k=top_k, pair_scores=cosine_pairs))


def scoring_of(adapter: "EmbeddingAdapter") -> Scoring:
    """The Scoring of the adapter's `embedding_kind` (of the adapter inside a DDP/DeepSpeed wrapper: `.module`)."""
    kind = getattr(adapter, "embedding_kind", None) or getattr(getattr(adapter, "module", None), "embedding_kind", None)
    return SCORINGS.get(kind or "single")


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
    documents_per_block: int | None = None,
    forward: "Callable[[dict[str, Any]], torch.Tensor] | None" = None,
    show_progress: bool = False,
    cache: "EmbeddingCache | None" = None,
) -> Iterator[tuple[int, Any]]:
    """(corpus position of the first row, embeddings) of this process's share of each block of the corpus.

    Every process runs the same number of forwards (sharded models need that); each block of
    `documents_per_block x num_processes` documents is split into contiguous shares. With a `cache` (an opened
    `vembed.retrieval.cache.EmbeddingCache`), a block every process finds stored is read instead of encoded (one
    process missing its share makes all encode it: the forwards stay in step) and each encoded share is stored.
    A block is what the adapter's `scoring_of(...).encode_share` makes (embeddings, or packed token vectors); only
    the one being yielded is held (`documents_per_block`: None, that Scoring's default).
    """
    scoring = scoring_of(adapter)
    world = accelerator.num_processes if accelerator is not None else 1
    rank = accelerator.process_index if accelerator is not None else 0
    block = (documents_per_block or scoring.documents_per_block) * world
    starts: Iterable[int] = range(0, len(documents), block)
    if show_progress and rank == 0:
        from tqdm.auto import tqdm

        starts = tqdm(starts, desc="corpus", unit="block", leave=False)
    encode = scoring.encode_share or encode_sides
    for start in starts:
        emb = stored = None  # the previous block is the caller's to drop: never two held here
        part = documents[start : start + block]
        first, stop = share_bounds(len(part), rank, world)
        stored = cache.load(start + first, start + stop, scoring.stored) if cache is not None else None
        if cache is not None and _on_every_process(stored is not None, accelerator):
            cache.reused += 1
            yield start + first, stored.to(accelerator.device if accelerator is not None else "cpu")
            continue
        emb = encode(adapter, part, batch_size=batch_size, accelerator=accelerator, forward=forward, gather=False)
        if cache is not None:
            cache.store(start + first, start + stop, emb)
        yield start + first, emb


def _shown_to(on_block: Callable[[Any], None], blocks: Iterable[tuple[int, Any]]) -> Iterator[tuple[int, Any]]:
    """`blocks`, each passed to `on_block` first; dropped before the next is made (one block held at a time)."""
    for offset, block in blocks:
        on_block(block)
        yield offset, block
        del block


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
        del emb  # before the next block is made: one block held at a time
    return merge_across_processes(best, accelerator)


def search_corpus(
    adapter: "EmbeddingAdapter",
    queries: Sequence["Side"],
    documents: Sequence["Side"],
    k: int,
    *,
    batch_size: int = 64,
    accelerator: "Accelerator | None" = None,
    documents_per_block: int | None = None,
    forward: "Callable[[dict[str, Any]], torch.Tensor] | None" = None,
    show_progress: bool = False,
    on_block: Callable[[Any], None] | None = None,
    on_queries: Callable[[Any], None] | None = None,
) -> TopK:
    """Encode `queries` (shared by every process) and the corpus (each process its share), and return each query's
    `k` best documents by the score of the adapter's embedding kind (cosine, MaxSim for token vectors, or dot product
    through an inverted index for sparse vectors: `Scoring`). The same on one process and on many. `on_block(block)`
    sees each block of this process's share before it is scored (e.g. `maxsim_search.IndexSize.add`, to report what
    the index holds); `on_queries(queries)` the queries as they are scored (e.g.
    `sparse_stats.SparseActivity.add_queries`)."""
    scoring = scoring_of(adapter)
    kwargs = dict(batch_size=batch_size, accelerator=accelerator, forward=forward)
    query_emb = scoring.queries(unwrapped(adapter, accelerator),
                                encode_sides(adapter, queries, desc="queries", show_progress=show_progress, **kwargs))
    if on_queries is not None:
        on_queries(query_emb)
    blocks = document_blocks(adapter, documents, documents_per_block=documents_per_block,
                             show_progress=show_progress, **kwargs)
    if on_block is not None:
        blocks = _shown_to(on_block, blocks)
    return search(query_emb, blocks, min(k, max(1, len(documents))), accelerator=accelerator,
                  score_block=scoring.top_k)
