"""Approximate late-interaction (MaxSim) search: an HNSW index (voyager) over every document token vector finds the
candidates, exact MaxSim ranks them. The alternative to maxsim_search.py's exact scan, for corpora it is too slow on.

PyLate's retrieval: each query token's `candidates_per_token` nearest document tokens (inner product of unit vectors)
name the documents worth scoring; their union is scored by `maxsim_top_k` (the exact path's scorer), so every returned
document carries exactly the score exact search gives it. What is approximate is which documents are looked at: a
document none of whose tokens is near a query token is missed, and a query whose candidates are fewer than k gets
fewer than k documents. Documents are encoded, pooled and stored as the exact path stores them (`encode_token_share`:
`document_pool_factor`, float16); the index holds them as float32. The build adds vectors on one thread with a fixed
seed, so the same corpus gives the same graph (several threads insert in a racing order); queries use every thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vembed.models.encoding import encode_sides
from vembed.models.token_vectors import token_mask
from vembed.retrieval.maxsim_search import PackedTokens, maxsim_top_k
from vembed.retrieval.scoring import TopK

if TYPE_CHECKING:
    from vembed.data.records import Side
    from vembed.models.base import EmbeddingAdapter

HNSW = "hnsw"
EXACT = "exact"
INDEXES = (EXACT, HNSW)
SEED = 1  # voyager's level generator: a fixed seed, one thread, the same graph for the same vectors


@dataclass(frozen=True)
class HnswSettings:
    """The approximate index's knobs (the one home of their defaults). `candidates_per_token`: document tokens taken
    per query token (PyLate's k_token); `m`: links per vector in the graph (more: better recall, a bigger and slower
    build); `ef_construction`: the candidate list while building; `ef_search`: the candidate list while searching
    (raised to `candidates_per_token` when below it)."""

    candidates_per_token: int = 64
    m: int = 16
    ef_construction: int = 200
    ef_search: int = 128

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            least = 2 if name == "m" else 1  # one link per vector: voyager cannot build the graph (no level spread)
            if not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be a whole number of at least {least}, got {value!r}")


class TokenIndex:
    """Every document token vector of a corpus in an HNSW graph (ids: token positions in `documents`), with the
    packed vectors kept for exact re-scoring. `search` gives the same `TopK` as `maxsim_top_k` on the documents it
    looks at."""

    def __init__(self, documents: PackedTokens, settings: HnswSettings = HnswSettings()):
        import voyager

        self.documents, self.settings = documents, settings
        # Which document each token vector belongs to, by its id in the graph.
        self.token_document = torch.repeat_interleave(torch.arange(len(documents)), documents.lengths)
        self.graph = voyager.Index(voyager.Space.InnerProduct, num_dimensions=max(1, documents.dim), M=settings.m,
                                   ef_construction=settings.ef_construction, random_seed=SEED,
                                   max_elements=max(1, len(documents.vectors)))
        if len(documents.vectors):
            self.graph.add_items(documents.vectors.float().numpy(), ids=list(range(len(documents.vectors))),
                                 num_threads=1)

    @property
    def nbytes(self) -> int:
        """Bytes held: the serialised graph (its float32 vectors and links) and the packed vectors re-scored."""
        return len(self.graph.as_bytes()) + self.documents.nbytes + self.token_document.numel() * 8

    def candidates(self, queries: torch.Tensor) -> list[torch.Tensor]:
        """Each query's candidate documents (ascending corpus positions): the owners of its tokens' nearest document
        tokens. `queries` `(n, Tq, dim)`, zero vectors where a query has no token."""
        kept = token_mask(queries)
        owners = torch.arange(len(queries)).repeat_interleave(kept.sum(dim=1).cpu())
        neighbours = self._nearest_tokens(queries[kept].float().cpu())
        documents = self.token_document[neighbours]  # (query tokens, k): -1 ids never occur (k <= tokens held)
        return [documents[owners == row].unique() for row in range(len(queries))]

    def _nearest_tokens(self, vectors: torch.Tensor) -> torch.Tensor:
        """`(n, k)` graph ids of each vector's k nearest tokens, k = candidates_per_token (at most the tokens held)."""
        held = len(self.documents.vectors)
        k = min(self.settings.candidates_per_token, held)
        if k == 0 or len(vectors) == 0:
            return torch.zeros(len(vectors), 0, dtype=torch.long)
        ids, _ = self.graph.query(vectors.numpy(), k=k, num_threads=torch.get_num_threads(),
                                  query_ef=max(self.settings.ef_search, k))
        return torch.from_numpy(ids.astype("int64")).reshape(len(vectors), k)

    def search(self, queries: torch.Tensor, k: int) -> TopK:
        """Each query's `k` best candidates by exact MaxSim (`maxsim_top_k`: its scores, its order of equal scores,
        corpus positions as indices); -1/-inf past a query's candidates."""
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        best = TopK.empty(len(queries), k)
        for row, documents in enumerate(self.candidates(queries)):
            if len(documents):
                found = maxsim_top_k(queries[row : row + 1].cpu(), self.documents.subset(documents), k)
                kept = found.indices >= 0
                best.scores[row], best.indices[row] = found.scores[0], torch.where(
                    kept, documents[found.indices.clamp(min=0)], found.indices)[0]
        return best


def require_voyager(key: str = "--index") -> None:
    """Refuse, before any work, an approximate index this installation cannot build (voyager missing)."""
    from vembed.errors import require_package

    require_package("voyager", key, f"an approximate MaxSim index ({key} {HNSW})", "search")


def index_corpus(adapter: "EmbeddingAdapter", documents: Sequence["Side"], settings: HnswSettings = HnswSettings(),
                 *, batch_size: int = 64, show_progress: bool = False) -> TokenIndex:
    """The corpus encoded as the exact path encodes it (block by block, pooled, float16) and indexed."""
    from vembed.retrieval.search import document_blocks

    blocks = [block.to("cpu") for _, block in document_blocks(adapter, documents, batch_size=batch_size,
                                                              show_progress=show_progress)]
    return TokenIndex(PackedTokens.joined(blocks), settings)


def search_corpus_approximately(adapter: "EmbeddingAdapter", queries: Sequence["Side"], documents: Sequence["Side"],
                                k: int, settings: HnswSettings = HnswSettings(), *, batch_size: int = 64,
                                show_progress: bool = False) -> TopK:
    """`search.search_corpus` for a multi_vector model through a `TokenIndex` (one process)."""
    index = index_corpus(adapter, documents, settings, batch_size=batch_size, show_progress=show_progress)
    query_vectors = encode_sides(adapter, queries, batch_size=batch_size, desc="queries", show_progress=show_progress)
    return index.search(query_vectors.cpu(), min(k, max(1, len(documents))))


__all__ = ["EXACT", "HNSW", "INDEXES", "HnswSettings", "TokenIndex", "index_corpus", "require_voyager",
           "search_corpus_approximately"]
