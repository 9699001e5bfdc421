"""Learned sparse (SPLADE) corpus search through an inverted index: only each vector's non-zero weights are kept
(scipy.sparse CSR: a float32 weight and an int32 term id per non-zero, an offset per row), never the dense
`(n, vocabulary)` matrix, and queries are scored term at a time against the postings of each block.

Documents are encoded `DOCUMENTS_PER_BLOCK` at a time (each process its share), the only moment they are dense (one
block: 125 MB at BERT's 30,522 tokens), and kept as `SparseVectors`, which is also what the embedding cache stores.
A block's postings (its CSR transposed: each term's documents and weights) score a chunk of queries with one sparse
product, CSR(queries) @ CSR(documents).T, which touches only the (query term, document) pairs that share a term.
Scores follow `vembed.retrieval.scoring`: summed in float64 and rounded to float32, so they equal the dense dot
product's, and each block's top-k is `scoring.block_top_k` over the chunk's scores (documents sharing no term with a
query score 0 and follow, by corpus position, the ones that do), so rankings equal dense search's, ties included.
A vector with a non-finite weight (a diverged model) scores -inf with every other, as the dense product's NaN does.

`sparse_query_top_k` / `sparse_document_top_k` (the model's keys, or `--sparse-query-top-k` /
`--sparse-document-top-k` for one command) keep each query's / document's largest weights only: a smaller index and
faster scoring for a little recall. Chosen for adapters whose `embedding_kind` is "sparse" through
`vembed.retrieval.SCORINGS`, so `vembed search`, `vembed eval`, in-run corpus evaluation, `vembed mine` and
`Embedder.search` all search this index.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vembed.models.encoding import encode_sides, unwrapped
from vembed.models.splade import SPARSE, keep_top_k
from vembed.retrieval import SCORINGS
from vembed.retrieval.scoring import SCORE_CHUNK_ELEMENTS, TopK, block_top_k
from vembed.retrieval.search import Scoring

if TYPE_CHECKING:
    from scipy.sparse import csr_matrix

    from vembed.data.records import Side
    from vembed.models.base import EmbeddingAdapter

# Documents encoded (densely) per block and process before they are made sparse: the block's dense bytes bound the
# search's memory (1024 x 30,522 float32 = 125 MB).
DOCUMENTS_PER_BLOCK = 1024
CPU = torch.device("cpu")


@dataclass(eq=False)  # compared by identity: matrices have no one truth value
class SparseVectors:
    """Rows of sparse vectors as a scipy CSR matrix `(rows, vocabulary)`, float32 weights and int32 term ids.
    `device`: where scores computed from them are returned (the encoder's); the weights themselves stay in host
    memory, where scipy computes."""

    matrix: "csr_matrix"
    device: torch.device = field(default=CPU)

    def __len__(self) -> int:
        return self.matrix.shape[0]

    @property
    def vocabulary(self) -> int:
        return self.matrix.shape[1]

    @property
    def nonzeros(self) -> int:
        return int(self.matrix.nnz)

    @property
    def nbytes(self) -> int:
        """Bytes the index holds: weights, term ids and row offsets (what `index/bytes_csr` reports)."""
        return int(self.matrix.data.nbytes + self.matrix.indices.nbytes + self.matrix.indptr.nbytes)

    @classmethod
    def from_dense(cls, vectors: torch.Tensor, top_k: int | None = None) -> "SparseVectors":
        """`(n, vocabulary)` vectors with their zeros dropped; `top_k`: each row's k largest weights only."""
        from scipy.sparse import csr_matrix

        if vectors.dim() != 2:
            raise ValueError(f"sparse vectors must be (n, vocabulary), got {tuple(vectors.shape)}")
        dense = keep_top_k(vectors.detach().float(), top_k) if top_k is not None else vectors.detach().float()
        matrix = csr_matrix(dense.cpu().numpy())
        return cls(_with_int32_ids(matrix), vectors.device)

    def __getitem__(self, rows: torch.Tensor | Sequence[int]) -> "SparseVectors":
        """The rows at `rows` (positions, any order), as vectors of their own."""
        positions = rows.cpu().numpy() if isinstance(rows, torch.Tensor) else np.asarray(rows, dtype=np.int64)
        return SparseVectors(self.matrix[positions.astype(np.int64)], self.device)

    def to(self, device: torch.device | str) -> "SparseVectors":
        return SparseVectors(self.matrix, torch.device(device))

    def broken(self) -> np.ndarray:
        """`(rows,)` bool: rows holding a non-finite weight."""
        broken = np.zeros(len(self), dtype=bool)
        bad = ~np.isfinite(self.matrix.data)
        if bad.any():  # each stored weight's row, from the row offsets (empty rows own none)
            rows = np.repeat(np.arange(len(self)), np.diff(self.matrix.indptr))
            broken[rows[bad]] = True
        return broken

    def state(self) -> dict[str, torch.Tensor]:
        """What a cache file holds (plain tensors: loaded with torch.load(weights_only=True))."""
        matrix = self.matrix
        return {"data": torch.from_numpy(matrix.data.copy()), "indices": torch.from_numpy(matrix.indices.copy()),
                "indptr": torch.from_numpy(matrix.indptr.copy()), "shape": torch.tensor(matrix.shape)}

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor]) -> "SparseVectors":
        from scipy.sparse import csr_matrix

        shape = tuple(int(n) for n in state["shape"])
        return cls(csr_matrix((state["data"].numpy(), state["indices"].numpy(), state["indptr"].numpy()), shape=shape))


def _with_int32_ids(matrix: "csr_matrix") -> "csr_matrix":
    """scipy picks int32 term ids and offsets while they fit; int64 offsets only past 2**31 non-zeros."""
    matrix.indices = matrix.indices.astype(np.int32, copy=False)
    return matrix


def as_sparse(vectors: "SparseVectors | torch.Tensor") -> SparseVectors:
    """`vectors` as SparseVectors (dense `(n, vocabulary)` tensors are converted, unpruned)."""
    return vectors if isinstance(vectors, SparseVectors) else SparseVectors.from_dense(vectors)


def exact_sparse_scores(queries: SparseVectors, postings: "csr_matrix") -> torch.Tensor:
    """`(n_queries, n_documents)` float32 dot products of `queries` with the documents whose postings (`(vocabulary,
    n_documents)` float64 CSR) are given, summed in float64 as `scoring.exact_scores` sums them; NaN as -inf."""
    product = (queries.matrix.astype(np.float64) @ postings).toarray()
    return torch.nan_to_num(torch.from_numpy(product).float(), nan=-torch.inf)


def postings_of(documents: SparseVectors) -> "csr_matrix":
    """The inverted index of a block: its CSR transposed, `(vocabulary, n_documents)` float64 (each term's documents
    and weights), what the queries' product runs over."""
    return documents.matrix.T.tocsr().astype(np.float64)


def sparse_top_k(query_emb: "SparseVectors | torch.Tensor", doc_emb: "SparseVectors | torch.Tensor", k: int, *,
                 doc_offset: int = 0, normalize: bool = True, chunk_elements: int = SCORE_CHUNK_ELEMENTS) -> TopK:
    """The `k` best documents of `doc_emb` for every query by dot product (`search.top_k`'s signature; `normalize` is
    ignored: a sparse vector's size is part of its score), through the block's postings. Queries are taken in chunks
    of at most `chunk_elements` scores; indices + `doc_offset`; -1/-inf past the block's size."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    queries, documents = as_sparse(query_emb), as_sparse(doc_emb)
    if queries.vocabulary != documents.vocabulary:
        raise ValueError(f"queries have {queries.vocabulary} dimensions, documents {documents.vocabulary}")
    n_q, n_d = len(queries), len(documents)
    if n_q == 0 or n_d == 0:
        return TopK.empty(n_q, k, queries.device)
    postings = postings_of(documents)
    broken_queries, broken_documents = torch.from_numpy(queries.broken()), torch.from_numpy(documents.broken())
    chunk = max(1, chunk_elements // n_d)
    parts = []
    for start in range(0, n_q, chunk):
        scores = exact_sparse_scores(queries[range(start, min(start + chunk, n_q))], postings)
        scores[broken_queries[start : start + chunk]] = -torch.inf
        scores[:, broken_documents] = -torch.inf
        parts.append(block_top_k(scores, k, doc_offset=doc_offset))
    return TopK(torch.cat([p.scores for p in parts]).to(queries.device),
                torch.cat([p.indices for p in parts]).to(queries.device))


def sparse_pairs(queries: "SparseVectors | torch.Tensor", block: "SparseVectors | torch.Tensor",
                 rows: torch.Tensor) -> torch.Tensor:
    """`(p,)` dot product of query i with block row `rows[i]`, summed in float64 (mining scores every positive so)."""
    queries, block = as_sparse(queries), as_sparse(block)
    if len(rows) == 0:
        return torch.zeros(0)
    documents = block[rows]
    dots = np.asarray(queries.matrix.astype(np.float64).multiply(documents.matrix.astype(np.float64)).sum(axis=1))
    scores = torch.from_numpy(dots.reshape(-1)).float()
    scores[torch.from_numpy(queries.broken() | documents.broken())] = -torch.inf  # NaN only comes from these
    return scores


def document_top_k(adapter: "EmbeddingAdapter") -> int | None:
    return getattr(adapter.settings, "sparse_document_top_k", None)


def query_top_k(adapter: "EmbeddingAdapter") -> int | None:
    return getattr(adapter.settings, "sparse_query_top_k", None)


def encode_sparse_share(adapter: "EmbeddingAdapter", sides: Sequence["Side"], **kwargs: Any) -> SparseVectors:
    """A share of documents encoded (`encode_sides`' arguments) and kept sparse, each pruned to the adapter's
    `sparse_document_top_k`: one block as `search.document_blocks` yields it."""
    vectors = encode_sides(adapter, sides, **kwargs)
    return SparseVectors.from_dense(vectors, document_top_k(unwrapped(adapter, kwargs.get("accelerator"))))


def sparse_queries(adapter: "EmbeddingAdapter", vectors: torch.Tensor) -> SparseVectors:
    """Encoded queries kept sparse, each pruned to the adapter's `sparse_query_top_k` (made once per search)."""
    return SparseVectors.from_dense(vectors, query_top_k(adapter))


def set_sparse_pruning(adapter: "EmbeddingAdapter", query: int | None, document: int | None,
                       keys: tuple[str, str] = ("--sparse-query-top-k", "--sparse-document-top-k")) -> None:
    """Prune the adapter's queries / documents to this many weights in the index from now on (None: keep the model's
    own setting); refused, naming the flag, for a model that gives no sparse vectors."""
    from vembed.errors import ArgumentError

    for key, value in zip(keys, (query, document)):
        if value is None:
            continue
        if getattr(adapter, "embedding_kind", None) != SPARSE:
            raise ArgumentError(key, "prunes sparse (SPLADE) vectors; this model gives dense ones: remove the flag")
        if value < 1:
            raise ArgumentError(key, f"must be at least 1 (unset: keep every non-zero weight), got {value}")
    if query is not None:
        adapter.settings.sparse_query_top_k = query
    if document is not None:
        adapter.settings.sparse_document_top_k = document


def sparse_index_key(adapter: "EmbeddingAdapter") -> dict[str, int]:
    """What the embedding cache's key adds for pruned documents (nothing when unpruned: older caches stay valid)."""
    k = document_top_k(adapter)
    return {"sparse_document_top_k": k} if k is not None else {}


def require_scipy(key: str) -> None:
    """Refuse, before any work, a sparse search this installation cannot run (scipy missing), naming `key`."""
    from vembed.errors import require_package

    require_package("scipy", key, "searching sparse (SPLADE) vectors through an inverted index", "sparse")


SCORINGS.register(SPARSE)(Scoring(top_k=sparse_top_k, pair_scores=sparse_pairs, encode_share=encode_sparse_share,
                                  prepare_queries=sparse_queries, documents_per_block=DOCUMENTS_PER_BLOCK,
                                  stored=SparseVectors, faiss=False, name="dot product (inverted index)",
                                  vectors="sparse vectors (SPLADE)"))

__all__ = ["SparseVectors", "as_sparse", "encode_sparse_share", "exact_sparse_scores", "postings_of",
           "require_scipy", "set_sparse_pruning", "sparse_index_key", "sparse_pairs", "sparse_queries",
           "sparse_top_k"]
