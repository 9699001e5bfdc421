"""Corpus retrieval metrics (nDCG@k, recall@k, MAP@k, MRR@k) of a ranking against graded qrels, and the evaluation
of an adapter on a corpus folder (every query searched against the whole corpus, exactly, in blocks).

The definitions are trec_eval's, so numbers compare with BEIR, MTEB and sentence-transformers'
InformationRetrievalEvaluator (tests/evaluation/test_corpus_metrics.py checks them against pytrec_eval to 1e-6):
- ndcg@k (`ndcg_cut_k`): linear graded gains `grade / log2(rank + 1)` of the top k, divided by the same sum over the
  query's judged grades sorted best first (only grades > 0 count as gains).
- recall@k (`recall_k`): relevant documents (grade > 0) in the top k / all the query's relevant documents. This is
  not the pair evaluation's `q2d/accuracy@k` (a hit: at least one relevant document in the top k).
- map@k (`map_cut_k`): the sum of precision@rank at each relevant document in the top k / all relevant documents.
- mrr@k (`recip_rank` of the run cut to k): 1 / rank of the first relevant document in the top k, 0 if none.

Means run over the judged queries that have at least one relevant document; a query whose judgements are all 0 is
left out (and counted in `num_queries_without_relevant`), where trec_eval would average its zeros in. A judged query
missing from a run dict counts as a query that retrieved nothing (trec_eval's `-c`).

Ties: a ranking given as positions (a `TopK` from vembed.retrieval.scoring) is taken in its order (equal scores by
corpus position, the rule of every ranking vembed builds). A run dict `{query_id: {doc_id: score}}` is sorted as
trec_eval sorts it: score descending, equal scores by document id descending (string order).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator

    from vembed.data.corpus import CorpusSplit
    from vembed.models.base import EmbeddingAdapter
    from vembed.retrieval.scoring import TopK

Qrels = Mapping[str, Mapping[str, int]]
Run = Mapping[str, Mapping[str, float]]


@dataclass(frozen=True)
class Cutoffs:
    """The k of each metric. Defaults: nDCG@10, recall@1/10/100, MAP@100, MRR@10 (what BEIR and MTEB report)."""

    ndcg: tuple[int, ...] = (10,)
    recall: tuple[int, ...] = (1, 10, 100)
    map: tuple[int, ...] = (100,)
    mrr: tuple[int, ...] = (10,)

    def __post_init__(self) -> None:
        bad = [k for k in (*self.ndcg, *self.recall, *self.map, *self.mrr) if not isinstance(k, int) or k < 1]
        if bad:
            raise ValueError(f"cut-offs must be positive integers, got {bad}")

    @property
    def depth(self) -> int:
        """How many documents per query a ranking needs for every metric (the largest k)."""
        return max((*self.ndcg, *self.recall, *self.map, *self.mrr), default=1)

    def names(self) -> list[str]:
        """The metric names these cut-offs produce, in report order (`ndcg@10`, `recall@1`, ...)."""
        return ([f"ndcg@{k}" for k in self.ndcg] + [f"recall@{k}" for k in self.recall]
                + [f"map@{k}" for k in self.map] + [f"mrr@{k}" for k in self.mrr])


DEFAULT_CUTOFFS = Cutoffs()


def rankings_from_run(run: Run) -> dict[str, list[str]]:
    """Each query's document ids, best first, in trec_eval's order (score descending, then document id descending)."""
    rankings = {}
    for query, scores in run.items():
        by_id = sorted(scores, reverse=True)  # then a stable sort by score keeps equal scores in descending id order
        rankings[query] = sorted(by_id, key=lambda doc, scores=scores: -scores[doc])
    return rankings


def rankings_from_topk(top: "TopK", query_ids: Sequence[str], doc_ids: Sequence[str]) -> dict[str, list[str]]:
    """Each query's document ids, best first, from a TopK over corpus positions (-1 entries, "none", dropped)."""
    if len(query_ids) != top.indices.shape[0]:
        raise ValueError(f"{len(query_ids)} query ids for a ranking of {top.indices.shape[0]} queries")
    rows = top.indices.tolist()
    return {query: [doc_ids[i] for i in row if i >= 0] for query, row in zip(query_ids, rows)}


def query_metrics(ranking: Sequence[str], judged: Mapping[str, int], cutoffs: Cutoffs = DEFAULT_CUTOFFS
                  ) -> dict[str, float]:
    """The metrics of one query's ranking (document ids, best first) against its judgements {doc_id: grade}."""
    relevant = {doc: grade for doc, grade in judged.items() if grade > 0}
    n_relevant = len(relevant)
    depth = cutoffs.depth
    grades = [relevant.get(doc, 0) for doc in ranking[:depth]]
    hits = [grade > 0 for grade in grades]
    out: dict[str, float] = {}
    ideal = sorted(relevant.values(), reverse=True)
    for k in cutoffs.ndcg:
        ideal_dcg = sum(g / math.log2(r + 2) for r, g in enumerate(ideal[:k]))
        dcg = sum(g / math.log2(r + 2) for r, g in enumerate(grades[:k]) if g > 0)
        out[f"ndcg@{k}"] = dcg / ideal_dcg if ideal_dcg > 0 else 0.0
    for k in cutoffs.recall:
        out[f"recall@{k}"] = sum(hits[:k]) / n_relevant if n_relevant else 0.0
    for k in cutoffs.map:
        found, precision_sum = 0, 0.0
        for rank, hit in enumerate(hits[:k], start=1):
            if hit:
                found += 1
                precision_sum += found / rank
        out[f"map@{k}"] = precision_sum / n_relevant if n_relevant else 0.0
    for k in cutoffs.mrr:
        first = next((rank for rank, hit in enumerate(hits[:k], start=1) if hit), None)
        out[f"mrr@{k}"] = 1.0 / first if first else 0.0
    return out


def per_query_metrics(rankings: Mapping[str, Sequence[str]], qrels: Qrels, cutoffs: Cutoffs = DEFAULT_CUTOFFS
                      ) -> dict[str, dict[str, float]]:
    """`{query_id: {metric: value}}` for every judged query with at least one relevant document (a query absent from
    `rankings` retrieved nothing). Rankings of unjudged queries are ignored."""
    return {query: query_metrics(rankings.get(query, ()), judged, cutoffs)
            for query, judged in qrels.items() if any(grade > 0 for grade in judged.values())}


def mean_metrics(per_query: Mapping[str, Mapping[str, float]], cutoffs: Cutoffs = DEFAULT_CUTOFFS
                 ) -> dict[str, float]:
    """The mean of each metric over the queries of `per_query` (`per_query_metrics`)."""
    if not per_query:
        raise ValueError("no judged query has a relevant document (grade > 0); check the qrels")
    return {name: math.fsum(values[name] for values in per_query.values()) / len(per_query)
            for name in cutoffs.names()}


def corpus_metrics(ranking: "Run | Mapping[str, Sequence[str]] | TopK", qrels: Qrels,
                   cutoffs: Cutoffs = DEFAULT_CUTOFFS, *, query_ids: Sequence[str] | None = None,
                   doc_ids: Sequence[str] | None = None) -> dict[str, float]:
    """Mean metrics of a ranking: a run dict `{query_id: {doc_id: score}}`, ranked lists `{query_id: [doc_id, ...]}`,
    or a `TopK` over corpus positions (then `query_ids`, its rows' ids, and `doc_ids`, the corpus ids, are needed).

    Returns `{"ndcg@10": ..., "recall@1": ..., ..., "num_queries": n, "num_queries_without_relevant": m}`."""
    rankings = _as_rankings(ranking, query_ids, doc_ids)
    per_query = per_query_metrics(rankings, qrels, cutoffs)
    metrics = mean_metrics(per_query, cutoffs)
    metrics["num_queries"] = float(len(per_query))
    metrics["num_queries_without_relevant"] = float(len(qrels) - len(per_query))
    return metrics


def _as_rankings(ranking: Any, query_ids: Sequence[str] | None, doc_ids: Sequence[str] | None
                 ) -> Mapping[str, Sequence[str]]:
    if hasattr(ranking, "indices") and hasattr(ranking, "scores"):
        if query_ids is None or doc_ids is None:
            raise ValueError("a TopK ranking needs query_ids and doc_ids")
        return rankings_from_topk(ranking, query_ids, doc_ids)
    if ranking and isinstance(next(iter(ranking.values())), Mapping):
        return rankings_from_run(ranking)
    return ranking


# --- evaluation of an adapter on a corpus folder -------------------------------------------------------------------

CORPUS_PREFIX = "corpus"


def corpus_metric_names(cutoffs: Cutoffs = DEFAULT_CUTOFFS) -> list[str]:
    """The metric keys `evaluate_corpus` returns (without the counts): `corpus/ndcg@10`, ..."""
    return [f"{CORPUS_PREFIX}/{name}" for name in cutoffs.names()]


def judged_queries(split: "CorpusSplit", max_queries: int | None = None) -> list[str]:
    """The ids of the queries of `split` with a relevant document (grade > 0), in file order; the first
    `max_queries` only. A DataError naming the qrels file when there is none."""
    query_ids = [q for q in split.queries.ids if any(g > 0 for g in split.qrels.get(q, {}).values())]
    if max_queries is not None:
        query_ids = query_ids[:max_queries]
    if not query_ids:
        from vembed.errors import DataError

        raise DataError(f"no query of qrels/{split.split}.tsv has a relevant document (grade > 0)", split.folder)
    return query_ids


def evaluate_corpus(
    adapter: "EmbeddingAdapter",
    split: "CorpusSplit",
    *,
    cutoffs: Cutoffs = DEFAULT_CUTOFFS,
    batch_size: int = 64,
    accelerator: "Accelerator | None" = None,
    max_queries: int | None = None,
    show_progress: bool = False,
    forward: "Callable[[dict[str, Any]], torch.Tensor] | None" = None,
    documents_per_block: int | None = None,
    on_block: "Callable[[Any], None] | None" = None,
    on_queries: "Callable[[Any], None] | None" = None,
) -> dict[str, float]:
    """Search every judged query of `split` against its whole corpus (exact, in blocks: cosine, or MaxSim for a
    multi_vector model's token vectors; with an `accelerator`, each process encodes its share of the corpus) and
    score the top `cutoffs.depth`.

    Keys: `corpus/ndcg@10`, `corpus/recall@1`, `corpus/recall@10`, `corpus/recall@100`, `corpus/map@100`,
    `corpus/mrr@10`, `num_queries` (judged queries with a relevant document), `num_documents`. Every process returns
    the same. `max_queries`: only the first judged queries (file order); the corpus is always whole. `on_block`,
    `on_queries`: see `search_corpus`."""
    from vembed.retrieval.search import search_corpus

    queries = split.queries
    query_ids = judged_queries(split, max_queries)
    top = search_corpus(adapter, [queries.sides[queries.index[q]] for q in query_ids], split.corpus.sides,
                        cutoffs.depth, batch_size=batch_size, accelerator=accelerator, forward=forward,
                        documents_per_block=documents_per_block, show_progress=show_progress, on_block=on_block,
                        on_queries=on_queries)
    qrels = {q: split.qrels[q] for q in query_ids}
    found = corpus_metrics(top, qrels, cutoffs, query_ids=query_ids, doc_ids=split.corpus.ids)
    metrics = {f"{CORPUS_PREFIX}/{name}": found[name] for name in cutoffs.names()}
    metrics["num_queries"] = found["num_queries"]
    metrics["num_documents"] = float(len(split.corpus))
    return metrics
