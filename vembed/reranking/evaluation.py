"""What a reranker adds: a first-stage run (the embedder's top k per query) reranked by the cross-encoder, both
measured on a corpus split's qrels with the corpus evaluation's trec_eval definitions (vembed/evaluation/corpus.py).

Both rankings are cut to the same `depth` candidates, so recall@k for k <= depth compares like with like (the
reranker can only reorder what the first stage found).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from vembed.errors import DataError

if TYPE_CHECKING:
    import torch

    from vembed.data.corpus import CorpusSplit
    from vembed.evaluation.corpus import Cutoffs

FIRST_STAGE_DEPTH = 100  # candidates per query reranked in-run (the top 100, as BEIR's reranking setup)
Scorer = Callable[[Sequence[str], Sequence[str]], "torch.Tensor"]  # (queries, documents) -> (n,) scores


def read_run_file(path: str | os.PathLike) -> dict[str, dict[str, float]]:
    """A TREC run file, `query-id Q0 doc-id rank score tag` per line (what trec_eval, pyserini and BEIR write), as
    `{query_id: {doc_id: score}}`. A line that is not 6 fields with a numeric score is a DataError naming it."""
    run: dict[str, dict[str, float]] = {}
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            fields = line.split()
            if not fields:
                continue
            try:
                if len(fields) != 6:
                    raise ValueError
                query, _, document, _, score, _ = fields
                run.setdefault(query, {})[document] = float(score)
            except ValueError:
                raise DataError("is not a TREC run line (query-id Q0 doc-id rank score tag)", str(path),
                                number) from None
    return run


def rerank_run(score: Scorer, split: "CorpusSplit", run: Mapping[str, Mapping[str, float]], depth: int = 100,
               cutoffs: "Cutoffs | None" = None) -> dict[str, float]:
    """`first_stage/<metric>` and `reranked/<metric>` (nDCG@10, recall@k, MAP@100, MRR@10 and the query counts) on
    the judged queries of `split`: each query's top `depth` candidates of `run`, then the same candidates ordered by
    `score(queries, documents)`. Candidates not in the corpus are a DataError naming the document."""
    from vembed.evaluation.corpus import DEFAULT_CUTOFFS, corpus_metrics, rankings_from_run

    cutoffs = cutoffs or DEFAULT_CUTOFFS
    first_stage = {query: ranking[:depth] for query, ranking in rankings_from_run(
        {query: run[query] for query in split.qrels if query in run}).items()}
    queries, documents, owners = [], [], []
    for query, candidates in first_stage.items():
        query_text = split.queries.sides[split.queries.index[query]].text or ""
        for document in candidates:
            if document not in split.corpus.index:
                raise DataError(f"candidate {document!r} of query {query!r} is not in the corpus of {split.folder}")
            queries.append(query_text)
            documents.append(split.corpus.sides[split.corpus.index[document]].text or "")
            owners.append((query, document))
    scores = score(queries, documents).tolist() if owners else []
    reranked: dict[str, dict[str, float]] = {query: {} for query in first_stage}
    for (query, document), value in zip(owners, scores):
        reranked[query][document] = float(value)
    before = corpus_metrics({q: {d: float(-rank) for rank, d in enumerate(r)} for q, r in first_stage.items()},
                            split.qrels, cutoffs)
    after = corpus_metrics(reranked, split.qrels, cutoffs)
    return {**{f"first_stage/{k}": v for k, v in before.items()}, **{f"reranked/{k}": v for k, v in after.items()}}
