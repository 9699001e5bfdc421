"""BM25 over a corpus folder's texts with bm25s (a sparse-matrix BM25, Lucene's scoring by default): the classic
first stage a reranker reorders, and the lexical baseline dense and late-interaction search are compared with.

Documents are their text (the title and body as the corpus folder joins them); tokens are bm25s's (lower-cased
words of two or more characters, English stop words removed, no stemming). A document that shares no token with a
query scores 0 and is left out of that query's list, as Lucene-based tools leave it out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from vembed.errors import DataError

if TYPE_CHECKING:
    from vembed.data.corpus import CorpusSplit

BM25 = "bm25"  # the name `vembed search` takes in place of a model folder
STOPWORDS = "en"


def bm25_run(split: "CorpusSplit", query_ids: Sequence[str], depth: int, *, k1: float = 1.5, b: float = 0.75,
             method: str = "lucene", show_progress: bool = False) -> dict[str, dict[str, float]]:
    """Each query's top `depth` documents of `split.corpus` by BM25 as a run `{query_id: {doc_id: score}}`."""
    import bm25s

    texts = [_text(split, "corpus", i) for i in range(len(split.corpus))]
    retriever = bm25s.BM25(k1=k1, b=b, method=method)
    retriever.index(bm25s.tokenize(texts, stopwords=STOPWORDS, show_progress=False), show_progress=show_progress)
    queries = [_text(split, "queries", split.queries.index[query]) for query in query_ids]
    found, scores = retriever.retrieve(bm25s.tokenize(queries, stopwords=STOPWORDS, show_progress=False),
                                       k=min(depth, len(texts)), show_progress=show_progress)
    doc_ids = split.corpus.ids
    return {query: {doc_ids[int(i)]: float(s) for i, s in zip(rows, values) if s > 0}
            for query, rows, values in zip(query_ids, found, scores)}


def _text(split: "CorpusSplit", part: str, position: int) -> str:
    """An item's text; an item without one (an image) cannot be searched by words: one line naming it."""
    items = getattr(split, part)
    text = items.sides[position].text
    if not text:
        raise DataError(f"{part} item {items.ids[position]!r} has no text: BM25 searches words; search an image "
                        "corpus with an embedding model", f"{split.folder}/{part}.jsonl")
    return text


__all__ = ["BM25", "bm25_run"]
