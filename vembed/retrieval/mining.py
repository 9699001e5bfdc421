"""Hard-negative mining: each query's nearest corpus documents that are not judged relevant, kept inside a rank window
and below a fraction of the positive's score, written as a training file (`vembed mine` is the command).

The corpus is encoded block by block, each process its share (`search.document_blocks`), optionally through an
on-disk cache (`cache.EmbeddingCache`) so that a long job resumes; the top-k is exact (`search.search`), or faiss's
flat inner-product index when asked. The choice of negatives runs on every process over the same merged top-k and is
deterministic, so one process and several write the same file.

The two filters, and where their defaults come from:
- rank window `[range_min, range_max)`, counted among the non-relevant candidates (0 = the closest non-relevant
  document): the top ranks of a corpus with incomplete judgements hold unjudged positives, so FlagEmbedding's
  `hn_mine` samples from ranks 10-210 (its README) and sentence-transformers' example uses 10-50. Defaults: 10, 100.
- positive-aware threshold ("TopK-PercPos", NV-Retriever, Moreira et al. 2024, arXiv:2407.15831): drop candidates
  scoring above `max_score_ratio` x the positive's score; 0.95 was their best setting. A query with several positives
  is measured against its lowest-scoring one: a candidate the model rates above a judged-relevant document is as
  likely an unjudged positive as a negative, and the lowest positive is the one every training row of that query
  shares, so all its rows get the same negatives.

Their order (`filter_order`, `vembed mine --filter-order`): by default the window is taken first and the threshold
drops candidates inside it ("window-first": ranks 10-100 stay the ranks the model gave, and a query whose window is
mostly above the threshold gets fewer negatives, or none). sentence-transformers' `mine_hard_negatives` with
`relative_margin=1 - max_score_ratio` applies the same threshold (`score_threshold`) first and then counts the window
among the candidates it kept ("threshold-first": the window slides down past the dropped ones). With `top` sampling
the two differ where the threshold drops a candidate ranked above `range_min` (threshold-first then reaches further
down the ranking); `tests/retrieval/test_mining.py` checks both orders against sentence-transformers.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from vembed.errors import RecipeError
from vembed.files import replace_atomically
from vembed.models.encoding import encode_sides, unwrapped
from vembed.retrieval.maxsim_search import IndexSize, PackedTokens
from vembed.retrieval.scoring import TopK, top_k
from vembed.retrieval.search import Scoring, document_blocks, scoring_of, search

if TYPE_CHECKING:
    from accelerate import Accelerator

    from vembed.data.corpus import CorpusSplit
    from vembed.data.records import Side
    from vembed.models.base import EmbeddingAdapter
    from vembed.retrieval.cache import EmbeddingCache

SAMPLING = ("top", "random")
# Which filter runs first (see the module docstring): the rank window over every non-relevant candidate, then the
# threshold over the window (vembed's default); or the threshold over every candidate, then the window over the
# candidates it kept (sentence-transformers' mine_hard_negatives with relative_margin).
FILTER_ORDERS = ("window-first", "threshold-first")


@dataclass(frozen=True)
class MiningSettings:
    """Which candidates become negatives (see the module docstring for the literature behind the defaults)."""

    range_min: int = 10  # skip this many closest non-relevant documents (likely unjudged positives)
    range_max: int = 100  # consider candidates up to this rank (exclusive), counted among non-relevant documents
    # Keep a candidate only if its score <= this x the query's lowest positive score. None: no threshold, for corpora
    # whose judgements are complete (synthetic ones), where a document scored near or above the positive is a true
    # negative and the most useful one (see docs/benchmarks.md: on such a corpus 0.95 drops exactly those).
    max_score_ratio: float | None = 0.95
    num_negatives: int = 7  # negatives per training row (7 + the positive = BGE's train_group_size 8)
    sampling: str = "top"  # "top": the closest kept candidates; "random": a seeded sample of them (FlagEmbedding)
    seed: int = 0  # for sampling="random"
    filter_order: str = "window-first"  # one of FILTER_ORDERS

    def check(self) -> None:
        """One RecipeError naming the flag for a setting that cannot work."""
        if self.range_min < 0:
            raise RecipeError("--range-min", f"must be at least 0, got {self.range_min}")
        if self.range_min >= self.range_max:
            raise RecipeError("--range-min", f"must be below --range-max ({self.range_max}), got {self.range_min}")
        if self.max_score_ratio is not None and not 0 < self.max_score_ratio <= 1:
            raise RecipeError("--max-score-ratio", f"must be in (0, 1] (a fraction of the positive's score), got "
                                                   f"{self.max_score_ratio}")
        if self.num_negatives < 1:
            raise RecipeError("--num-negatives", f"must be at least 1, got {self.num_negatives}")
        if self.num_negatives > self.range_max - self.range_min:
            raise RecipeError("--num-negatives", f"{self.num_negatives} cannot fit in ranks {self.range_min}-"
                                                 f"{self.range_max}; widen the range or ask for fewer")
        if self.sampling not in SAMPLING:
            raise RecipeError("--sampling", f"must be one of {', '.join(SAMPLING)}, got {self.sampling!r}")
        if self.filter_order not in FILTER_ORDERS:
            raise RecipeError("--filter-order", f"must be one of {', '.join(FILTER_ORDERS)}, got {self.filter_order!r}")


@dataclass
class MinedQuery:
    """One query's negatives: corpus positions and scores, closest first."""

    negatives: list[int]
    scores: list[float]


@dataclass
class MiningStats:
    queries: int = 0  # queries with at least one positive
    mined: int = 0  # of those, queries that got num_negatives negatives
    too_few: int = 0  # queries left out: fewer than num_negatives candidates passed the filters
    candidates: int = 0  # candidates the threshold saw: inside the rank window (window-first), or all (threshold-first)
    dropped_by_threshold: int = 0  # of those, dropped for scoring above max_score_ratio x the positive
    blocks_encoded: int = 0
    blocks_reused: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def score_threshold(positive_score: float, ratio: float) -> float:
    """The highest score a negative may have. ratio x score for a positive score; for a negative positive score
    (an untrained model can give one) the same margin, |score| x (1 - ratio), is taken below it, so the threshold
    never climbs above the positive."""
    return positive_score - (1.0 - ratio) * abs(positive_score)


def select_negatives(found: TopK, positives: Sequence[Iterable[int]], positive_scores: Sequence[float],
                     settings: MiningSettings, stats: MiningStats | None = None) -> list[MinedQuery | None]:
    """Each query's negatives from its ranked candidates `found` (corpus positions), skipping its `positives`
    (corpus positions of every judged-relevant document), keeping ranks `[range_min, range_max)` of the rest and
    scores at most `score_threshold(positive_scores[q])`, in `settings.filter_order`. None for a query with fewer
    than `num_negatives`."""
    stats = stats if stats is not None else MiningStats()
    rng = random.Random(settings.seed)
    scores, indices = found.scores.tolist(), found.indices.tolist()
    mined: list[MinedQuery | None] = []
    for q, relevant in enumerate(positives):
        relevant = set(relevant)
        candidates = [(i, s) for i, s in zip(indices[q], scores[q]) if i >= 0 and i not in relevant]
        threshold = (math.inf if settings.max_score_ratio is None
                     else score_threshold(positive_scores[q], settings.max_score_ratio))
        window_first = settings.filter_order == "window-first"
        seen = candidates[settings.range_min : settings.range_max] if window_first else candidates
        below = [(i, s) for i, s in seen if s <= threshold]
        # threshold-first: ranks counted among the candidates below the threshold
        kept = below if window_first else below[settings.range_min : settings.range_max]
        stats.queries += 1
        stats.candidates += len(seen)
        stats.dropped_by_threshold += len(seen) - len(below)
        if len(kept) < settings.num_negatives:
            stats.too_few += 1
            mined.append(None)
            continue
        if settings.sampling == "random":
            chosen = sorted(rng.sample(range(len(kept)), settings.num_negatives))
            kept = [kept[c] for c in chosen]
        kept = kept[: settings.num_negatives]
        stats.mined += 1
        mined.append(MinedQuery([i for i, _ in kept], [s for _, s in kept]))
    return mined


def faiss_top_k(query_emb: torch.Tensor, doc_emb: torch.Tensor, k: int, *, doc_offset: int = 0,
                normalize: bool = True) -> TopK:
    """`scoring.top_k` through faiss's exact flat inner-product index (needs `pip install faiss-cpu`)."""
    import faiss
    import numpy as np

    queries, docs = query_emb.float().cpu(), doc_emb.float().cpu()
    if normalize:
        queries, docs = F.normalize(queries, dim=-1), F.normalize(docs, dim=-1)
    index = faiss.IndexFlatIP(docs.shape[1])
    index.add(np.ascontiguousarray(docs.numpy()))
    take = min(len(docs), k + 8)  # as top_k does: a few extra so exact ties reach the position ordering
    scores, where = index.search(np.ascontiguousarray(queries.numpy()), take)
    scores, where = torch.from_numpy(scores), torch.from_numpy(where).long()
    where = torch.where(where >= 0, where + doc_offset, where)
    found = TopK.empty(len(queries), k).merge(TopK(scores, where))
    return TopK(found.scores.to(query_emb.device), found.indices.to(query_emb.device))


def faiss_available() -> bool:
    try:
        import faiss  # noqa: F401
    except ImportError:
        return False
    return True


def _with_positive_scores(blocks: Iterable[tuple[int, Any]], query_emb: torch.Tensor, pair_query: torch.Tensor,
                          pair_doc: torch.Tensor, into: torch.Tensor,
                          scoring: Scoring) -> Iterator[tuple[int, Any]]:
    """Pass `blocks` on, scoring on the way every (query, relevant document) pair whose document is in this share:
    positives are scored where their embedding is, wherever they rank."""
    for offset, emb in blocks:
        here = (pair_doc >= offset) & (pair_doc < offset + len(emb))
        if here.any():
            into[here] = scoring.pair_scores(query_emb[pair_query[here]], emb, pair_doc[here] - offset).to(into.device)
        yield offset, emb
        del emb  # one block held at a time


def _max_across_processes(values: torch.Tensor, accelerator: "Accelerator | None") -> torch.Tensor:
    if accelerator is None or accelerator.num_processes == 1:
        return values
    return accelerator.gather(values.contiguous()).reshape(accelerator.num_processes, -1).max(dim=0).values


def mine_hard_negatives(
    adapter: "EmbeddingAdapter",
    split: "CorpusSplit",
    settings: MiningSettings = MiningSettings(),
    *,
    batch_size: int = 64,
    accelerator: "Accelerator | None" = None,
    cache: "EmbeddingCache | None" = None,
    use_faiss: bool = False,
    documents_per_block: int | None = None,
    show_progress: bool = False,
) -> tuple[list[dict[str, Any]], MiningStats]:
    """Mine `split`'s queries against its corpus; returns the training rows (`training_rows`) and the counts.
    Every process returns the same rows. `cache`: an opened `EmbeddingCache` for this model and corpus. The score
    is the adapter's (`search.scoring_of`: cosine, dot product for sparse vectors, or MaxSim for token vectors; faiss
    only for the first)."""
    settings.check()
    scoring = scoring_of(adapter)
    if use_faiss and not scoring.faiss:
        raise RecipeError("--faiss", f"faiss's flat index scores one vector per document by cosine; this model "
                                     f"gives {scoring.vectors} (scored exactly by {scoring.name}): pass --faiss no")
    corpus, queries = split.corpus, split.queries
    relevant = [[corpus.index[d] for d in split.relevant(q)] for q in queries.ids]
    judged = [q for q, docs in enumerate(relevant) if docs]
    # Every (query row, relevant document) pair, query rows numbered among the judged queries.
    pair_row = torch.tensor([row for row, q in enumerate(judged) for _ in relevant[q]], dtype=torch.long)
    pair_doc = torch.tensor([d for q in judged for d in relevant[q]], dtype=torch.long)
    device = accelerator.device if accelerator is not None else torch.device("cpu")
    pair_scores = torch.full((len(pair_doc),), -torch.inf, device=device)

    query_sides = [queries.sides[q] for q in judged]
    query_emb = scoring.queries(unwrapped(adapter, accelerator),
                                encode_sides(adapter, query_sides, batch_size=batch_size, accelerator=accelerator,
                                             desc="queries", show_progress=show_progress))
    most_relevant = max((len(relevant[q]) for q in judged), default=0)
    k = max(1, min(len(corpus), settings.range_max + most_relevant))  # room for the positives the window skips
    blocks = document_blocks(adapter, corpus.sides, batch_size=batch_size, accelerator=accelerator,
                             documents_per_block=documents_per_block, show_progress=show_progress, cache=cache)
    counted = _Counted(blocks)
    found = search(query_emb, _with_positive_scores(counted, query_emb, pair_row.to(device), pair_doc.to(device),
                                                    pair_scores, scoring),
                   k, accelerator=accelerator, score_block=faiss_top_k if use_faiss else scoring.top_k)
    pair_scores = _max_across_processes(pair_scores, accelerator).cpu()

    lowest = torch.full((len(judged),), torch.inf)
    lowest.scatter_reduce_(0, pair_row, pair_scores, reduce="amin")
    stats = MiningStats()
    mined = select_negatives(found, [relevant[q] for q in judged], lowest.tolist(), settings, stats)
    stats.blocks_reused = cache.reused if cache is not None else 0
    stats.blocks_encoded = counted.blocks - stats.blocks_reused
    if scoring.stored is PackedTokens:  # token vectors: what the index holds, all processes' shares
        stats.extra["index"] = counted.index.across(accelerator)
    scores_of = {(int(q), int(d)): float(s) for q, d, s in zip(pair_row, pair_doc, pair_scores)}
    rows = training_rows(split, judged, relevant, mined, scores_of)
    return rows, stats


class _Counted:
    """Blocks passed through, counted (this process's shares: encoded or read from the cache), and the index size of
    packed token vectors (`index`: what `--pool-factor` promises to shrink)."""

    def __init__(self, blocks: Iterable[tuple[int, Any]]):
        self.inner, self.blocks, self.index = blocks, 0, IndexSize()

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        for item in self.inner:
            self.blocks += 1
            if isinstance(item[1], PackedTokens):
                self.index.add(item[1])
            yield item
            del item  # one block held at a time


def _side_columns(sides: Sequence["Side"], text_key: str, image_key: str, as_list: bool) -> dict[str, Any]:
    """A side's (or a list of sides') text and image columns, each only when every side has one."""
    columns: dict[str, Any] = {}
    texts, images = [s.text for s in sides], [s.image for s in sides]
    if all(t is not None for t in texts):
        columns[text_key] = texts if as_list else texts[0]
    if all(i is not None for i in images):
        columns[image_key] = [str(i) for i in images] if as_list else str(images[0])
    return columns


def training_rows(split: "CorpusSplit", judged: Sequence[int], relevant: Sequence[Sequence[int]],
                  mined: Sequence[MinedQuery | None], positive_scores: dict[tuple[int, int], float]) -> list[dict]:
    """One row per (query, relevant document) of each query that got its negatives, positives by grade (highest
    first, then corpus order). Ids for corpus-format training; texts/images as the `query`, `positive`, `negatives`
    (`query_image`, `positive_image`, `negative_images`) columns vembed's training reads."""
    corpus, queries = split.corpus, split.queries
    rows = []
    for row, (q, negatives) in enumerate(zip(judged, mined)):
        if negatives is None:
            continue
        query_id = queries.ids[q]
        grades = split.relevant(query_id)
        for d in sorted(relevant[q], key=lambda d: (-grades[corpus.ids[d]], d)):
            rows.append({
                "query_id": query_id, "positive_id": corpus.ids[d],
                "negative_ids": [corpus.ids[n] for n in negatives.negatives],
                "positive_score": round(positive_scores[(row, d)], 6),
                "negative_scores": [round(s, 6) for s in negatives.scores],
                **_side_columns([queries.sides[q]], "query", "query_image", as_list=False),
                **_side_columns([corpus.sides[d]], "positive", "positive_image", as_list=False),
                **_side_columns([corpus.sides[n] for n in negatives.negatives], "negatives", "negative_images",
                                as_list=True),
            })
    return rows


def write_jsonl_atomic(path: str | os.PathLike, rows: Iterable[dict]) -> Path:
    """Rows as JSON lines, written under a temporary name and renamed: a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as handle:
            for row in rows:
                handle.write(json.dumps(row, ensure_ascii=False) + "\n")

    return replace_atomically(path, write)
