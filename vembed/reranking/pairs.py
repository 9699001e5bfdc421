"""What every reranker shares: a (query, document) pair's parts as one type, and scoring lists of pairs in evaluation
mode (`PairScorer`, mixed into each reranker class)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Union

import torch

from vembed.data.records import Side

# A query or a document as the rerank data hands it over: text, or a Side when it holds an image.
PairPart = Union[str, Side]


def as_side(part: PairPart, role: str) -> Side:
    return part if isinstance(part, Side) else Side(text=part, role=role)


def pair_document(side: Side) -> PairPart:
    """A corpus or record side as a list document: its text, or the side itself when it holds an image (only a
    reranker that reads images takes it; the text cross-encoder refuses it)."""
    return side if side.images else (side.text or "")


# The pair the model card's snippets score (vembed/model_card.py).
EXAMPLE_QUERY = "how do I sort a list of numbers"
EXAMPLE_DOCUMENTS = ["Sort the integers in ascending order.", "Parse the dates, skipping bad input."]


class PairScorer:
    """`score(queries, documents)` for a reranker module whose `preprocess(queries, documents)` makes CPU tensors
    and whose forward gives one logit per pair; and what its model card says about loading it."""

    card_library: ClassVar[str] = "vembed"  # the card's library_name: the library that loads the folder as it is
    card_tags: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def card_usage(cls, path: str) -> list[str]:
        """The card's "How to use it" lines (Markdown) for a folder of this reranker at `path`: with vembed."""
        return ["With vembed (`pip install vembed`):", "", "```python",
                "from vembed.reranking import load_reranker",
                f"reranker = load_reranker({path!r})",
                f"scores = reranker.score([{EXAMPLE_QUERY!r}] * 2, {EXAMPLE_DOCUMENTS!r})  "
                "# one logit per (query, document) pair: higher ranks first",
                "```"]

    @torch.no_grad()
    def score(self, queries: Sequence[PairPart], documents: Sequence[PairPart], batch_size: int = 64) -> torch.Tensor:
        """(n,) logits of the pairs (queries[i], documents[i]), in evaluation mode, on the model's device."""
        if len(queries) != len(documents):
            raise ValueError(f"{len(queries)} queries for {len(documents)} documents; give one query per document")
        was_training = self.training
        self.eval()
        device = next(self.parameters()).device
        try:
            parts = [self({key: value.to(device) for key, value in
                           self.preprocess(queries[i:i + batch_size], documents[i:i + batch_size]).items()})
                     for i in range(0, len(queries), batch_size)]
        finally:
            self.train(was_training)
        return torch.cat(parts).cpu() if parts else torch.zeros(0)
