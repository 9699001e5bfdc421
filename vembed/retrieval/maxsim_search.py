"""Exact late-interaction (MaxSim, ColBERT) search of a corpus: search.py's cosine search, for token vectors.

Each block of documents is encoded (each process its share), optionally pooled (`pool_tokens`: fewer vectors per
document), and packed without padding (`PackedTokens`: every document's token vectors one after another in float16,
with each document's count), which is also what the embedding cache stores. A block is scored against every query
by MaxSim (`vembed.models.maxsim`, the one place it is computed) a chunk at a time and folded into the running top-k
(`search.search`), then dropped: memory holds one block of token vectors and `(n_queries, k)` scores. Padding never
reaches a score: packed blocks hold only tokens, and unpacking pads with zero vectors, which `maxsim` excludes.

Chosen for adapters whose `embedding_kind` is "multi_vector" through `vembed.retrieval.SCORINGS`, so `vembed eval` on a corpus
folder, in-run corpus evaluation and `vembed mine` search token vectors as they search single vectors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from vembed.models.encoding import encode_sides, unwrapped
from vembed.models.maxsim import MAX_BLOCK_ELEMENTS, maxsim
from vembed.models.token_vectors import token_mask
from vembed.retrieval import SCORINGS
from vembed.retrieval.scoring import SCORE_CHUNK_ELEMENTS, TopK, block_top_k, exact_scores
from vembed.retrieval.search import Scoring, scoring_of

if TYPE_CHECKING:
    from accelerate import Accelerator

    from vembed.data.records import Side
    from vembed.models.base import EmbeddingAdapter

STORED_DTYPE = torch.float16  # a unit vector's components keep ~3 decimal digits: scores move by ~1e-3 at most
# Documents per block and process: token vectors take ~100x the room of one vector per document, so blocks are
# smaller than search.DOCUMENTS_PER_BLOCK (4096 documents of 200 tokens at 128 dims: 200 MiB of float16).
DOCUMENTS_PER_BLOCK = 1 << 12
# Documents unpacked to float32 at once while a block is scored (their padded token vectors, in elements).
UNPACKED_ELEMENTS = 1 << 24
MULTI_VECTOR = "multi_vector"
_PAIRS_AT_ONCE = 4096  # (query, document) pairs whose query vectors are gathered at once when pairs are scored


@dataclass(eq=False)  # compared by identity: tensors have no one truth value
class PackedTokens:
    """The token vectors of a block of documents without padding: `vectors` `(total tokens, dim)`, document after
    document, and `lengths` `(n_documents,)`, each document's number of vectors (0: a document with no token).
    `unpooled`: how many token vectors the documents had before `pool_tokens` (None: not pooled)."""

    vectors: torch.Tensor
    lengths: torch.Tensor
    unpooled: int | None = None

    def __post_init__(self) -> None:
        if self.lengths.dim() != 1 or int(self.lengths.sum()) != len(self.vectors):
            raise ValueError(f"{len(self.vectors)} token vectors for document lengths summing to "
                             f"{int(self.lengths.sum())}")

    def __len__(self) -> int:
        return self.lengths.numel()

    @classmethod
    def pack(cls, documents: torch.Tensor | Sequence[torch.Tensor], dtype: torch.dtype = STORED_DTYPE
             ) -> "PackedTokens":
        """From padded token vectors `(n, T, dim)` (zero vectors: no token, `vembed.models.token_vectors`), or from a
        list of each document's own `(t_i, dim)` vectors."""
        if isinstance(documents, torch.Tensor):
            kept = token_mask(documents)
            return cls(documents[kept].to(dtype), kept.sum(dim=1).cpu())  # row-major: document after document
        lengths = torch.tensor([len(doc) for doc in documents], dtype=torch.long)
        vectors = torch.cat(list(documents)) if documents else torch.empty(0, 0)
        return cls(vectors.to(dtype), lengths)

    @property
    def dim(self) -> int:
        return self.vectors.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of the stored vectors and lengths: the index size of the block."""
        return self.vectors.numel() * self.vectors.element_size() + self.lengths.numel() * self.lengths.element_size()

    @property
    def unpooled_nbytes(self) -> int:
        """Bytes the block would take without pooling: what `document_pool_factor` saves is the difference."""
        if self.unpooled is None:
            return self.nbytes
        return self.nbytes + (self.unpooled - len(self.vectors)) * self.dim * self.vectors.element_size()

    def _offsets(self) -> torch.Tensor:
        return torch.cat([self.lengths.new_zeros(1), self.lengths.cumsum(0)])

    def padded(self, start: int = 0, stop: int | None = None, device: torch.device | str | None = None
               ) -> torch.Tensor:
        """Documents `[start, stop)` as float32 `(n, longest, dim)` on `device`, zero vectors after their tokens."""
        stop = len(self) if stop is None else stop
        offsets, lengths = self._offsets(), self.lengths[start:stop]
        flat = self.vectors[int(offsets[start]) : int(offsets[stop])].to(device=device, dtype=torch.float32)
        longest = int(lengths.max()) if len(lengths) else 0
        out = flat.new_zeros(len(lengths), longest, self.vectors.shape[1])
        out[(torch.arange(longest)[None, :] < lengths[:, None]).to(out.device)] = flat
        return out

    def select(self, rows: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
        """The documents at `rows` (block positions, any order) as float32 `(len(rows), longest, dim)`."""
        return self.subset(rows).padded(device=device) if len(rows) else torch.zeros(0, 0, self.dim, device=device)

    def subset(self, rows: torch.Tensor) -> "PackedTokens":
        """The documents at `rows` (block positions, any order), packed in that order, their vectors unchanged."""
        offsets = self._offsets()
        parts = [self.vectors[int(offsets[r]) : int(offsets[r + 1])] for r in rows.tolist()]
        return PackedTokens.pack(parts, self.vectors.dtype) if parts else \
            PackedTokens(self.vectors[:0], self.lengths[:0])

    @classmethod
    def joined(cls, blocks: Sequence["PackedTokens"]) -> "PackedTokens":
        """Blocks one after another as one (a whole corpus, for an index that needs every vector at once)."""
        if not blocks:
            return cls(torch.empty(0, 0, dtype=STORED_DTYPE), torch.zeros(0, dtype=torch.long))
        return cls(torch.cat([block.vectors for block in blocks]), torch.cat([block.lengths for block in blocks]))

    def to(self, device: torch.device | str) -> "PackedTokens":
        return PackedTokens(self.vectors.to(device), self.lengths, self.unpooled)

    def state(self) -> dict[str, torch.Tensor]:
        """What a cache file holds (plain tensors: loaded with torch.load(weights_only=True))."""
        state = {"vectors": self.vectors.detach().cpu().contiguous(), "lengths": self.lengths.cpu().contiguous()}
        if self.unpooled is not None:  # so a block read back reports the index size it was pooled from
            state["unpooled"] = torch.tensor(self.unpooled)
        return state

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor]) -> "PackedTokens":
        unpooled = state.get("unpooled")
        return cls(state["vectors"], state["lengths"], None if unpooled is None else int(unpooled))


def pool_tokens(vectors: torch.Tensor, pool_factor: int) -> torch.Tensor:
    """One document's token vectors `(t, dim)` pooled to about t / pool_factor (hierarchical token pooling, Clavié et
    al. 2024, what PyLate's `pool_factor` does):
    Ward clustering of the vectors (euclidean distance between unit vectors orders pairs as cosine does), each
    cluster replaced by its mean, renormalised. Deterministic; `pool_factor` 1 or a single token: unchanged."""
    if pool_factor <= 1 or len(vectors) <= 1:
        return vectors
    fcluster, linkage = _hierarchical_clustering("document_pool_factor")
    clusters = max(1, len(vectors) // pool_factor)
    points = vectors.detach().double().cpu()
    labels = fcluster(linkage(points.numpy(), method="ward"), t=clusters, criterion="maxclust")
    labels = torch.as_tensor(labels, dtype=torch.long) - 1
    sums = torch.zeros(int(labels.max()) + 1, vectors.shape[1], dtype=torch.float64).index_add_(0, labels, points)
    return F.normalize(sums, dim=-1).to(vectors.dtype).to(vectors.device)  # the mean's direction


def require_token_pooling(pool_factor: int, key: str) -> None:
    """Refuse, before any work, a pool factor this installation cannot apply (scipy missing), naming `key`: the recipe
    key or flag that asked for it. Without this, a run or a mining job stopped at its first pooled document."""
    if pool_factor > 1:
        _hierarchical_clustering(key)


def _hierarchical_clustering(key: str) -> tuple[Any, Any]:
    """scipy's (fcluster, linkage): token pooling's one dependency."""
    try:
        from scipy.cluster.hierarchy import fcluster, linkage
    except ImportError:
        from vembed.errors import EnvironmentProblem

        raise EnvironmentProblem(key, "token pooling needs scipy: pip install 'vembed[colbert]', or index without pooling "
                                      "(a pool factor of 1)") from None
    return fcluster, linkage


def pool_factor_of(adapter: "EmbeddingAdapter") -> int:
    """How much the adapter's documents are pooled when indexed (`document_pool_factor`; 1: not at all)."""
    return int(getattr(adapter.settings, "document_pool_factor", 1) or 1)


def set_pool_factor(adapter: "EmbeddingAdapter", factor: int | None, key: str = "--pool-factor") -> None:
    """Index the adapter's documents pooled by `factor` from now on (None: keep the model's own setting)."""
    from vembed.errors import RecipeError

    if factor is None:  # the model's own document_pool_factor, which it was saved with
        require_token_pooling(pool_factor_of(adapter), "document_pool_factor")
        return
    if factor < 1:
        raise RecipeError(key, f"must be at least 1 (1: no pooling), got {factor}")
    if adapter.embedding_kind != MULTI_VECTOR:
        if factor == 1:
            return
        raise RecipeError(key, f"pools token vectors; this model gives {scoring_of(adapter).vectors}: remove the flag")
    require_token_pooling(factor, key)
    adapter.settings.document_pool_factor = factor


def pool_factor_key(adapter: "EmbeddingAdapter") -> dict[str, int]:
    """What the embedding cache's key adds for pooled documents (nothing when unpooled: older caches stay valid)."""
    factor = pool_factor_of(adapter)
    return {"document_pool_factor": factor} if factor > 1 else {}


def encode_token_share(adapter: "EmbeddingAdapter", sides: Sequence["Side"], **kwargs: Any) -> PackedTokens:
    """A share of documents encoded (`encode_sides`' arguments), pooled by the adapter's `document_pool_factor`, and
    packed in float16: one block as `search.document_blocks` yields it."""
    padded = encode_sides(adapter, sides, **kwargs)
    return pack_documents(padded, pool_factor_of(unwrapped(adapter, kwargs.get("accelerator"))))


def pack_documents(padded: torch.Tensor, pool_factor: int = 1) -> PackedTokens:
    """Documents' padded token vectors `(n, T, dim)`, each pooled by `pool_factor` (1: not), packed in float16."""
    if pool_factor <= 1:
        return PackedTokens.pack(padded)
    kept = token_mask(padded)
    packed = PackedTokens.pack([pool_tokens(doc[mask], pool_factor) for doc, mask in zip(padded, kept)])
    packed.unpooled = int(kept.sum())
    return packed


@dataclass
class IndexSize:
    """What a search stored of the corpus, summed over the blocks it was shown (`add`) and over processes
    (`across`): documents, token vectors and bytes, before and after `document_pool_factor`."""

    documents: int = 0
    vectors: int = 0
    nbytes: int = 0
    unpooled_vectors: int = 0
    unpooled_nbytes: int = 0

    def add(self, block: PackedTokens) -> None:
        self.documents += len(block)
        self.vectors += len(block.vectors)
        self.nbytes += block.nbytes
        self.unpooled_vectors += len(block.vectors) if block.unpooled is None else block.unpooled
        self.unpooled_nbytes += block.unpooled_nbytes

    def across(self, accelerator: "Accelerator | None") -> "IndexSize":
        """The whole corpus's size, on every process, when each process was shown only its own share."""
        if accelerator is None or accelerator.num_processes == 1:
            return self
        counts = torch.tensor(self.counts(), dtype=torch.long, device=accelerator.device)
        totals = accelerator.gather(counts).view(accelerator.num_processes, -1).sum(dim=0)
        return IndexSize(*totals.tolist())

    def counts(self) -> list[int]:
        """(documents, vectors, bytes, unpooled vectors, unpooled bytes): the fields, in order."""
        return [self.documents, self.vectors, self.nbytes, self.unpooled_vectors, self.unpooled_nbytes]

    def metrics(self) -> dict[str, float]:
        """`index/...` keys for the metrics JSON: what is stored, and what would be without pooling."""
        return {"index/token_vectors": float(self.vectors), "index/bytes": float(self.nbytes),
                "index/token_vectors_unpooled": float(self.unpooled_vectors),
                "index/bytes_unpooled": float(self.unpooled_nbytes)}

    def describe(self, pool_factor: int) -> str:
        """One line for people: the stored index and, when pooled, its share of the unpooled one."""
        stored = f"index: {self.vectors:,} token vectors of {self.documents:,} documents, {_mib(self.nbytes)} (float16)"
        if pool_factor <= 1:
            return f"{stored}, not pooled"
        ratio = self.nbytes / self.unpooled_nbytes if self.unpooled_nbytes else 1.0
        return (f"{stored}; pooled by {pool_factor} from {self.unpooled_vectors:,} token vectors, "
                f"{_mib(self.unpooled_nbytes)}: {ratio:.2f}x the bytes")


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def maxsim_top_k(queries: torch.Tensor, block: PackedTokens, k: int, *, doc_offset: int = 0,
                 normalize: bool = True, chunk_elements: int = UNPACKED_ELEMENTS) -> TopK:
    """The `k` best documents of `block` for every query `(n, Tq, dim)` by MaxSim (`search.top_k`'s signature;
    `normalize` is ignored: token vectors are unit vectors already). `doc_offset` is added to the indices.

    Documents are unpacked `chunk_elements` at a time and queries taken in chunks that keep `maxsim`'s similarity
    block near its bound; scores by `scoring.exact_scores` (equal documents score equally in any block), ranked by
    `scoring.block_top_k` (non-finite scores last, equal scores by corpus position, ties past k's slack included)."""
    if queries.dim() != 3 or queries.shape[2] != block.dim:
        raise ValueError(f"token vectors must be (n, tokens, {block.dim}), got {tuple(queries.shape)}")
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    device, queries = queries.device, queries.float()
    n_q, n_d = len(queries), len(block)
    if n_q == 0 or n_d == 0:
        return TopK.empty(n_q, k, device)
    longest = max(1, int(block.lengths.max()))
    doc_chunk = max(1, min(n_d, chunk_elements // (longest * block.dim)))
    # At least 16 documents per similarity block of maxsim (it chunks documents, never queries).
    query_chunk = max(1, min(n_q, MAX_BLOCK_ELEMENTS // (queries.shape[1] * longest * 16),
                             SCORE_CHUNK_ELEMENTS // doc_chunk))
    best = [TopK.empty(min(query_chunk, n_q - q), k, device) for q in range(0, n_q, query_chunk)]
    for d_start in range(0, n_d, doc_chunk):
        d_stop = min(d_start + doc_chunk, n_d)
        documents = block.padded(d_start, d_stop, device)
        for part, q_start in enumerate(range(0, n_q, query_chunk)):
            scores = exact_scores(_maxsim_in_float64, queries[q_start : q_start + query_chunk], documents)
            best[part] = best[part].merge(block_top_k(scores, k, doc_offset=doc_offset + d_start))
        del documents
    return TopK(torch.cat([b.scores for b in best]), torch.cat([b.indices for b in best]))


def maxsim_pairs(queries: torch.Tensor, block: PackedTokens, rows: torch.Tensor) -> torch.Tensor:
    """`(p,)` MaxSim of query i `(p, Tq, dim)` with block document `rows[i]` (mining scores every positive so)."""
    if len(rows) == 0:
        return queries.new_zeros(0)
    documents = block.select(rows, device=queries.device)
    return torch.stack([exact_scores(_maxsim_in_float64, queries[i : i + 1], documents[i : i + 1])[0, 0]
                        for i in range(len(rows))])


def maxsim_pair_scorer(adapter: "EmbeddingAdapter", *, batch_size: int = 64,
                       accelerator: Any = None) -> "Callable[[Sequence[Any], Sequence[Any]], torch.Tensor]":
    """`score(queries, documents)`: the `(n,)` MaxSim of each pair (texts, or Sides for image documents), as a
    reranker's `score` gives logits, so a late-interaction model reorders a first stage's candidates (PyLate's
    `rank.rerank`). Each distinct query and document is encoded once; documents are pooled as the index pools them
    (`document_pool_factor`) and scored as search scores them (`exact_scores`)."""
    from vembed.data.records import Side

    def as_side(part: Any, role: str) -> "Side":
        return part if isinstance(part, Side) else Side(text=part, role=role)

    def score(queries: Sequence[Any], documents: Sequence[Any]) -> torch.Tensor:
        query_rows, distinct_queries = _distinct(queries)
        document_rows, distinct_documents = _distinct(documents)
        kwargs = dict(batch_size=batch_size, accelerator=accelerator)
        query_vectors = encode_sides(adapter, [as_side(q, "query") for q in distinct_queries], **kwargs)
        packed = encode_token_share(adapter, [as_side(d, "document") for d in distinct_documents], **kwargs)
        pairs = range(0, len(query_rows), _PAIRS_AT_ONCE)  # the pairs' query vectors, a chunk at a time
        return torch.cat([maxsim_pairs(query_vectors[query_rows[i : i + _PAIRS_AT_ONCE]], packed,
                                       document_rows[i : i + _PAIRS_AT_ONCE]) for i in pairs]) \
            if len(query_rows) else torch.zeros(0)

    return score


def _distinct(parts: Sequence[Any]) -> tuple[torch.Tensor, list[Any]]:
    """Each part's row among the distinct parts (texts by value, Sides by identity), and those parts in order."""
    rows: dict[Any, int] = {}
    distinct = []
    for part in parts:
        key = part if isinstance(part, str) else id(part)
        if key not in rows:
            rows[key] = len(distinct)
            distinct.append(part)
    return torch.tensor([rows[part if isinstance(part, str) else id(part)] for part in parts], dtype=torch.long), \
        distinct


def _maxsim_in_float64(queries: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
    """`maxsim` for `exact_scores`: its float64 similarity block takes twice the bytes, so half the elements."""
    return maxsim(queries, documents, max_block_elements=MAX_BLOCK_ELEMENTS // 2)


SCORINGS.register(MULTI_VECTOR)(Scoring(top_k=maxsim_top_k, pair_scores=maxsim_pairs, encode_share=encode_token_share,
                                        documents_per_block=DOCUMENTS_PER_BLOCK, stored=PackedTokens, faiss=False,
                                        name="MaxSim", vectors="token vectors (multi_vector)"))

__all__ = ["IndexSize", "PackedTokens", "encode_token_share", "maxsim_pair_scorer", "maxsim_pairs", "maxsim_top_k",
           "pack_documents", "pool_factor_key", "pool_tokens", "require_token_pooling", "set_pool_factor"]
