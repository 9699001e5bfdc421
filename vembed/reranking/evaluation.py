"""What a reranker adds: a first-stage run (the embedder's top k per query) reranked by the cross-encoder, both
measured on a corpus split's qrels with the corpus evaluation's trec_eval definitions (vembed/evaluation/corpus.py).

Both rankings are cut to the same `depth` candidates, so recall@k for k <= depth compares like with like (the
reranker can only reorder what the first stage found).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from vembed.errors import DataError
from vembed.reranking.metric_names import before_after
from vembed.reranking.pairs import pair_document

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator

    from vembed.data.corpus import CorpusSplit
    from vembed.evaluation.corpus import Cutoffs
    from vembed.models.base import EmbeddingAdapter
    from vembed.retrieval.token_index import HnswSettings

FIRST_STAGE_DEPTH = 100  # candidates per query reranked in-run (the top 100, as BEIR's reranking setup)
Scorer = Callable[[Sequence[str], Sequence[str]], "torch.Tensor"]  # (queries, documents) -> (n,) scores


def rerank(score: Scorer, split: "CorpusSplit", run: Mapping[str, Mapping[str, float]], depth: int = 100
           ) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """(first stage, reranked) as runs over the judged queries of `split` that `run` holds: each query's top `depth`
    candidates of `run` with their first-stage scores, and the same candidates with `score(queries, documents)`.
    Candidates not in the corpus are a DataError naming the document."""
    from vembed.evaluation.corpus import rankings_from_run

    first_stage = {query: ranking[:depth] for query, ranking in rankings_from_run(
        {query: run[query] for query in split.qrels if query in run}).items()}
    queries, documents, owners = [], [], []
    for query, candidates in first_stage.items():
        query_text = split.queries.sides[split.queries.index[query]].text or ""
        for document in candidates:
            if document not in split.corpus.index:
                raise DataError(f"candidate {document!r} of query {query!r} is not in the corpus of {split.folder}")
            queries.append(query_text)
            documents.append(pair_document(split.corpus.sides[split.corpus.index[document]]))
            owners.append((query, document))
    scores = score(queries, documents).tolist() if owners else []
    reranked: dict[str, dict[str, float]] = {query: {} for query in first_stage}
    for (query, document), value in zip(owners, scores):
        reranked[query][document] = float(value)
    # The cut run keeps its scores: ranked again in trec_eval's order it gives the same top `depth`.
    cut = {query: {document: float(run[query][document]) for document in ranking}
           for query, ranking in first_stage.items()}
    return cut, reranked


def rerank_run(score: Scorer, split: "CorpusSplit", run: Mapping[str, Mapping[str, float]], depth: int = 100,
               cutoffs: "Cutoffs | None" = None) -> dict[str, float]:
    """`first_stage/<metric>` and `reranked/<metric>` (nDCG@10, recall@k, MAP@100, MRR@10 and the query counts) on
    the judged queries of `split`: each query's top `depth` candidates of `run`, then the same candidates ordered by
    `score(queries, documents)` (`rerank`)."""
    from vembed.evaluation.corpus import DEFAULT_CUTOFFS, corpus_metrics

    cutoffs = cutoffs or DEFAULT_CUTOFFS
    before, after = (corpus_metrics(ranking, split.qrels, cutoffs) for ranking in rerank(score, split, run, depth))
    return {**{f"first_stage/{k}": v for k, v in before.items()}, **{f"reranked/{k}": v for k, v in after.items()}}


def cutoffs_for(top_k: int) -> "Cutoffs":
    """nDCG@10, MRR@10, recall@1/10/top_k and MAP@top_k: with top_k = 100, the corpus evaluation's defaults."""
    from vembed.evaluation.corpus import Cutoffs

    return Cutoffs(ndcg=(10,), recall=tuple(sorted({1, 10, top_k})), map=(top_k,), mrr=(10,))


def embedder_run(adapter: "EmbeddingAdapter", split: "CorpusSplit", depth: int, *, batch_size: int = 64,
                 accelerator: "Accelerator | None" = None, max_queries: int | None = None,
                 show_progress: bool = False, index: "HnswSettings | None" = None) -> dict[str, dict[str, float]]:
    """The first stage as a run: each judged query's `depth` nearest documents by the embedder's cosine (the corpus
    evaluation's exact search over the whole corpus; with an `accelerator`, each process encodes its share), or, with
    an `index`, a multi_vector model's MaxSim over the candidates of an approximate index (one process)."""
    from vembed.evaluation.corpus import judged_queries
    from vembed.retrieval.search import search_corpus
    from vembed.retrieval.token_index import search_corpus_approximately

    query_ids = judged_queries(split, max_queries)
    queries = split.queries
    query_sides = [queries.sides[queries.index[q]] for q in query_ids]
    if index is None:
        top = search_corpus(adapter, query_sides, split.corpus.sides, depth, batch_size=batch_size,
                            accelerator=accelerator, show_progress=show_progress)
    else:
        top = search_corpus_approximately(adapter, query_sides, split.corpus.sides, depth, index,
                                          batch_size=batch_size, show_progress=show_progress)
    doc_ids = split.corpus.ids
    return {query: {doc_ids[i]: float(s) for i, s in zip(indices, scores) if i >= 0}
            for query, indices, scores in zip(query_ids, top.indices.tolist(), top.scores.tolist())}


def judged_split(split: "CorpusSplit", max_queries: int | None) -> "CorpusSplit":
    """`split` judging only its first `max_queries` queries with a relevant document (all of them: None)."""
    import dataclasses

    from vembed.evaluation.corpus import judged_queries

    if max_queries is None:
        return split
    return dataclasses.replace(split, qrels={q: split.qrels[q] for q in judged_queries(split, max_queries)})


def metrics_table(metrics: Mapping[str, float]) -> str:
    """The before/after table of `rerank_run`'s metrics: one row per metric, first stage, reranked and the change."""
    lines = [f"{'metric':<12}{'first stage':>13}{'reranked':>11}{'change':>10}"]
    for name, before, after in before_after(metrics):
        lines.append(f"{name:<12}{before:>13.4f}{after:>11.4f}{after - before:>+10.4f}")
    lines.append(f"{int(metrics['reranked/num_queries'])} judged queries with a relevant document")
    return "\n".join(lines)
