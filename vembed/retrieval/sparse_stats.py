"""What a learned sparse (SPLADE) model's vectors cost: active dimensions (non-zero weights) per query and per document,
and the bytes of the inverted index the search built (`sparse_index.SparseVectors.nbytes`: a float32 weight and an
int32 term id per non-zero, an int32 offset per document and block: scipy's CSR), as sentence-transformers'
SparseInformationRetrievalEvaluator reports its `query_active_dims` and `corpus_active_dims`. Counted over the
blocks a search is shown, summed over processes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vembed.retrieval.sparse_index import SparseVectors, as_sparse

if TYPE_CHECKING:
    from accelerate import Accelerator


@dataclass
class SparseActivity:
    queries: int = 0
    query_nonzeros: int = 0
    documents: int = 0
    document_nonzeros: int = 0
    csr_bytes: int = 0  # the index's bytes: every block's CSR as the search held it

    def add_queries(self, vectors: "SparseVectors | torch.Tensor") -> None:
        """The queries' vectors as they were scored (every process holds all of them: counted once, on any)."""
        self.queries = len(vectors)
        self.query_nonzeros = as_sparse(vectors).nonzeros

    def add_documents(self, block: "SparseVectors | torch.Tensor") -> None:
        """One block of this process's share of the corpus, as the index holds it."""
        block = as_sparse(block)
        self.documents += len(block)
        self.document_nonzeros += block.nonzeros
        self.csr_bytes += block.nbytes

    def across(self, accelerator: "Accelerator | None") -> "SparseActivity":
        """The whole corpus's counts on every process, each having been shown its own share of the documents."""
        if accelerator is None or accelerator.num_processes == 1:
            return self
        counts = torch.tensor([self.documents, self.document_nonzeros, self.csr_bytes], dtype=torch.long,
                              device=accelerator.device)
        documents, nonzeros, nbytes = accelerator.gather(counts).view(accelerator.num_processes, 3).sum(dim=0).tolist()
        return SparseActivity(self.queries, self.query_nonzeros, documents, nonzeros, nbytes)

    def metrics(self) -> dict[str, float]:
        return {"sparse/query_active_dims": self.query_nonzeros / max(self.queries, 1),
                "sparse/corpus_active_dims": self.document_nonzeros / max(self.documents, 1),
                "index/bytes_csr": float(self.csr_bytes)}

    def describe(self, vocabulary: int) -> str:
        """One line for people: active dimensions of each side, out of the vocabulary, and the index's size."""
        metrics = self.metrics()
        return (f"sparse vectors: {metrics['sparse/query_active_dims']:.1f} active dimensions per query, "
                f"{metrics['sparse/corpus_active_dims']:.1f} per document, of {vocabulary:,}; the inverted index (CSR) "
                f"of the corpus's {self.document_nonzeros:,} non-zeros took {self.csr_bytes / 2**20:.2f} MiB")


__all__ = ["SparseActivity"]
