"""What a learned sparse (SPLADE) model's vectors cost: active dimensions (non-zero weights) per query and per document,
and the size of the corpus as an inverted index would store it (CSR: a float32 weight and an int32 term id per
non-zero, an int64 offset per document), as sentence-transformers' SparseInformationRetrievalEvaluator reports its
`query_active_dims` and `corpus_active_dims`. Counted over the blocks a search is shown, summed over processes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from accelerate import Accelerator

CSR_BYTES_PER_NONZERO = 4 + 4  # float32 weight, int32 vocabulary id
CSR_BYTES_PER_ROW = 8  # int64 row offset


@dataclass
class SparseActivity:
    queries: int = 0
    query_nonzeros: int = 0
    documents: int = 0
    document_nonzeros: int = 0

    def add_queries(self, vectors: torch.Tensor) -> None:
        """The queries' vectors (every process holds all of them: counted once, on any process)."""
        self.queries = len(vectors)
        self.query_nonzeros = int((vectors != 0).sum())

    def add_documents(self, block: torch.Tensor) -> None:
        """One block of this process's share of the corpus."""
        self.documents += len(block)
        self.document_nonzeros += int((block != 0).sum())

    def across(self, accelerator: "Accelerator | None") -> "SparseActivity":
        """The whole corpus's counts on every process, each having been shown its own share of the documents."""
        if accelerator is None or accelerator.num_processes == 1:
            return self
        counts = torch.tensor([self.documents, self.document_nonzeros], dtype=torch.long, device=accelerator.device)
        documents, nonzeros = accelerator.gather(counts).view(accelerator.num_processes, 2).sum(dim=0).tolist()
        return SparseActivity(self.queries, self.query_nonzeros, documents, nonzeros)

    @property
    def csr_bytes(self) -> int:
        return self.document_nonzeros * CSR_BYTES_PER_NONZERO + (self.documents + 1) * CSR_BYTES_PER_ROW

    def metrics(self) -> dict[str, float]:
        return {"sparse/query_active_dims": self.query_nonzeros / max(self.queries, 1),
                "sparse/corpus_active_dims": self.document_nonzeros / max(self.documents, 1),
                "index/bytes_csr": float(self.csr_bytes)}

    def describe(self, vocabulary: int) -> str:
        """One line for people: active dimensions of each side, out of the vocabulary, and the index's size."""
        metrics = self.metrics()
        return (f"sparse vectors: {metrics['sparse/query_active_dims']:.1f} active dimensions per query, "
                f"{metrics['sparse/corpus_active_dims']:.1f} per document, of {vocabulary:,}; as an inverted index "
                f"(CSR) the corpus's {self.document_nonzeros:,} non-zeros take {self.csr_bytes / 2**20:.1f} MiB")


__all__ = ["SparseActivity"]
