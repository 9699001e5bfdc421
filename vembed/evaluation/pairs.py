"""Pair evaluation: retrieval metrics (accuracy@k, MRR, nDCG@10) of an adapter on a split of (query, positive)
examples, in both directions, and zero-shot classification accuracy. A corpus folder with qrels is evaluated by
corpus.py; searching a corpus with a trained model is vembed.retrieval's job.

The corpus is the set of unique positives; relevance comes from labels when the examples carry them, otherwise from
each query's own positive. Scores are computed in chunks of queries so a large corpus never needs a full score matrix
(`vembed.retrieval.scoring`, which also orders equal scores).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F

from vembed.errors import DataError
from vembed.models.encoding import encode_sides, unwrapped
from vembed.retrieval.scoring import block_top_k, embeddings_for_scoring, first_ranks, query_chunks

if TYPE_CHECKING:
    from accelerate import Accelerator

    from vembed.data.records import Example, Side
    from vembed.models.base import EmbeddingAdapter

NDCG_K = 10


# --- relevance -----------------------------------------------------------------------------------------------------


@dataclass
class GroupRelevance:
    """Relevance as group ids: query i and document j are relevant iff `query_groups[i] == doc_groups[j]`.

    The compact equivalent of a boolean (n_queries, n_documents) matrix when relevance is an equivalence (shared
    label, or "this is my positive"): O(n) memory instead of O(n_queries x n_documents).
    """

    query_groups: torch.Tensor  # (n_queries,) int
    doc_groups: torch.Tensor  # (n_documents,) int

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.query_groups), len(self.doc_groups)

    def transpose(self) -> "GroupRelevance":
        return GroupRelevance(self.doc_groups, self.query_groups)

    def block(self, start: int, stop: int, device: torch.device) -> torch.Tensor:
        rows = self.query_groups[start:stop].to(device)
        return rows[:, None] == self.doc_groups.to(device)[None, :]


def _as_relevance(relevance: Any, shape: tuple[int, int]) -> GroupRelevance | torch.Tensor:
    if isinstance(relevance, GroupRelevance):
        rel: GroupRelevance | torch.Tensor = relevance
    else:
        rel = torch.as_tensor(relevance).bool()
    if tuple(rel.shape) != shape:
        raise ValueError(f"relevance has shape {tuple(rel.shape)}, expected (n_queries, n_documents) = {shape}")
    return rel


def _relevance_block(rel: GroupRelevance | torch.Tensor, start: int, stop: int, device: torch.device) -> torch.Tensor:
    if isinstance(rel, GroupRelevance):
        return rel.block(start, stop, device)
    return rel[start:stop].to(device)


# --- metrics -------------------------------------------------------------------------------------------------------


def retrieval_metrics(
    query_emb: torch.Tensor,
    doc_emb: torch.Tensor,
    relevance: torch.Tensor | GroupRelevance | Any,
    ks: Sequence[int] = (1, 5, 10),
    *,
    chunk_size: int | None = None,
) -> dict[str, float]:
    """Rank documents for each query by cosine similarity and score the ranking.

    Args:
        query_emb: `(n_queries, dim)`; rows are L2-normalised here, so scores are cosines.
        doc_emb: `(n_documents, dim)`.
        relevance: a boolean `(n_queries, n_documents)` matrix (tensor, array or nested lists), or a
            `GroupRelevance`.
        ks: cut-offs for accuracy.
        chunk_size: queries scored at once (default: as many as fit in ~128 MiB of scores).

    Returns `{"accuracy@k": ..., "mrr": ..., "ndcg@10": ...}`, averaged over queries that have at least one relevant
    document (queries with none are left out, as in trec_eval):
    - accuracy@k: the share of queries with at least one relevant document in the top k (sentence-transformers'
      InformationRetrievalEvaluator's name; often called recall@k in text-image papers, but it is not trec_eval's
      recall, the share of the relevant documents retrieved, which the corpus evaluation reports as recall@k).
    - mrr: mean reciprocal rank of the first relevant document, over the full ranking (no cut-off).
    - ndcg@10: binary gains `1 / log2(rank + 1)` of relevant documents in the top 10, divided by the ideal DCG of
      `min(n_relevant, 10)` relevant documents at the top.

    Ties are broken as everywhere in vembed (`vembed.retrieval.scoring`): equal scores by document position, lowest
    first; non-finite scores (NaN embeddings) rank last.
    """
    queries, docs = embeddings_for_scoring(query_emb, doc_emb)
    n_d = len(docs)
    rel = _as_relevance(relevance, (len(queries), n_d))
    device = queries.device
    top = min(NDCG_K, n_d)
    discounts = 1.0 / torch.log2(torch.arange(2, top + 2, device=device, dtype=torch.float64))
    ideal_by_count = torch.cumsum(discounts, 0)  # ideal DCG of 1..top relevant documents
    firsts, ndcgs = [], []
    for start, stop, scores in query_chunks(queries, docs, chunk_size=chunk_size):
        is_rel = _relevance_block(rel, start, stop, device)
        n_rel = is_rel.sum(dim=1)
        keep = n_rel > 0
        if not keep.all():
            scores, is_rel, n_rel = scores[keep], is_rel[keep], n_rel[keep]
        if not len(n_rel):
            continue
        firsts.append(first_ranks(scores, is_rel))
        # nDCG@10: binary gains of the top 10 in the same order.
        found = block_top_k(scores, top)
        gains = (is_rel.gather(1, found.indices) * discounts).sum(dim=1)
        ndcgs.append(gains / ideal_by_count[n_rel.clamp(max=top) - 1])

    if not firsts:
        raise ValueError("no query has a relevant document; check the relevance matrix")
    ranks_all = torch.cat(firsts).double()
    metrics = {f"accuracy@{k}": (ranks_all <= k).double().mean().item() for k in ks}
    metrics["mrr"] = (1.0 / ranks_all).mean().item()
    metrics[f"ndcg@{NDCG_K}"] = torch.cat(ndcgs).mean().item()
    return metrics


# --- evaluation of examples ----------------------------------------------------------------------------------------


def _side_key(side: "Side") -> tuple[Any, ...]:
    """Equal for sides with the same text and the same image files (decoded images compare by identity)."""
    return (side.text, *(image if isinstance(image, str) else ("pil", id(image)) for image in side.images))


def _corpus_and_relevance(examples: Sequence["Example"]) -> tuple[list["Side"], GroupRelevance]:
    """Unique positives as the corpus, and who is relevant to whom.

    Without labels, a query's relevant document is its own positive (identical positives are one document, relevant
    to every query that has it). With labels, documents are deduplicated within a label, and a document is relevant
    to every query of its label.
    """
    labelled = sum(ex.label is not None for ex in examples)
    if 0 < labelled < len(examples):
        raise DataError(
            f"{labelled} of {len(examples)} evaluation records have a label; give every record a label or none"
        )
    use_labels = labelled > 0
    label_ids: dict[Any, int] = {}
    doc_index: dict[tuple[Any, ...], int] = {}
    docs, doc_groups, query_groups = [], [], []
    for ex in examples:
        key = _side_key(ex.positive) + ((ex.label,) if use_labels else ())
        if key not in doc_index:
            doc_index[key] = len(docs)
            docs.append(ex.positive)
            doc_groups.append(label_ids.setdefault(ex.label, len(label_ids)) if use_labels else doc_index[key])
        query_groups.append(label_ids[ex.label] if use_labels else doc_index[key])
    return docs, GroupRelevance(torch.tensor(query_groups), torch.tensor(doc_groups))


def retrieval_metric_names(mrl_dims: Sequence[int] | None = None, ks: Sequence[int] = (1, 5, 10)) -> list[str]:
    """The metric keys `evaluate_retrieval` returns (without the counts), for checking a recipe's
    metric_for_best_model before training."""
    names = [f"accuracy@{k}" for k in ks] + ["mrr", f"ndcg@{NDCG_K}"]
    return [f"{direction}/{prefix}{name}" for prefix in [""] + [f"dim{d}/" for d in mrl_dims or ()]
            for direction in ("q2d", "d2q") for name in names]


# The hit rate was named recall@k before issue 23; a recipe naming it so still means it.
_OLD_HIT_RATE = re.compile(r"^((?:[^/]+/)?(?:q2d|d2q)/(?:dim\d+/)?)recall@(\d+)$")


def renamed_metric(name: str) -> str | None:
    """The current name of a pair-evaluation metric named by its old name (`q2d/recall@1` -> `q2d/accuracy@1`, with
    any source prefix and Matryoshka size), or None when `name` is not an old name."""
    found = _OLD_HIT_RATE.match(name)
    return f"{found[1]}accuracy@{found[2]}" if found else None


def evaluate_retrieval(
    adapter: "EmbeddingAdapter",
    examples: Sequence["Example"],
    *,
    batch_size: int = 64,
    mrl_dims: Sequence[int] | None = None,
    accelerator: "Accelerator | None" = None,
    show_progress: bool = False,
    forward: "Callable[[dict[str, Any]], torch.Tensor] | None" = None,
) -> dict[str, float]:
    """Encode the queries and the unique positives of `examples` and score retrieval both ways.

    Keys: `q2d/accuracy@1`, `q2d/accuracy@5`, `q2d/accuracy@10`, `q2d/mrr`, `q2d/ndcg@10` (queries retrieve documents),
    the same under `d2q/` (documents retrieve queries), the same again under `q2d/dim{d}/` and `d2q/dim{d}/` for each
    Matryoshka dimension in `mrl_dims` (embeddings truncated to `d`, then renormalised), and `num_queries`,
    `num_documents`. With an `accelerator`, encoding is sharded across processes and every process returns the same
    metrics. `forward`: as in `encode_sides`.
    """
    if not examples:
        raise DataError("no examples to evaluate")
    dim = unwrapped(adapter, accelerator).embedding_dim
    too_big = [d for d in mrl_dims or () if not 0 < d <= dim]
    if too_big:
        raise ValueError(f"mrl_dims {too_big} are not in 1..{dim}, the embedding size")
    docs, relevance = _corpus_and_relevance(examples)
    kwargs = dict(batch_size=batch_size, accelerator=accelerator, show_progress=show_progress, forward=forward)
    query_emb = encode_sides(adapter, [ex.query for ex in examples], desc="queries", **kwargs)
    doc_emb = encode_sides(adapter, docs, desc="documents", **kwargs)

    metrics: dict[str, float] = {}
    for dim_prefix, d in [("", None)] + [(f"dim{d}/", d) for d in mrl_dims or ()]:
        q, p = (query_emb, doc_emb) if d is None else (query_emb[:, :d], doc_emb[:, :d])
        for direction, scores in (
            ("q2d", retrieval_metrics(q, p, relevance)),
            ("d2q", retrieval_metrics(p, q, relevance.transpose())),
        ):
            metrics.update({f"{direction}/{dim_prefix}{name}": value for name, value in scores.items()})
    metrics["num_queries"] = float(len(examples))
    metrics["num_documents"] = float(len(docs))
    return metrics


def merge_source_metrics(per_source: "dict[Any, dict[str, float]]") -> dict[str, float]:
    """The metrics of named sources evaluated one by one: each source's under `<source>/` and, unprefixed, the mean
    over sources of every key they all have (as MTEB scores each task apart, then averages); sizes (`num_queries`,
    `index/bytes`, ...) are totals, not means. In-run evaluation and `vembed eval` report named sources so."""
    metrics = {f"{name}/{key}": value for name, found in per_source.items() for key, value in found.items()}
    shared = set.intersection(*(set(found) for found in per_source.values())) if per_source else set()
    for key in sorted(shared):
        total = sum(found[key] for found in per_source.values())
        metrics[key] = total if is_size(key) else total / len(per_source)
    return metrics


def is_size(key: str) -> bool:
    """A metric that counts what was searched (queries, documents, index vectors and bytes): added over sources."""
    return key.rsplit("/", 1)[-1].startswith("num_") or key.startswith("index/")


def zero_shot_accuracy(
    adapter: "EmbeddingAdapter",
    examples: Sequence["Example"],
    class_prompts: dict[Any, str],
    *,
    side: Literal["query", "positive"] = "positive",
    batch_size: int = 64,
    accelerator: "Accelerator | None" = None,
) -> float:
    """Share of examples whose `side` (default: the positive, e.g. an image) is nearest to its own label's prompt.

    `class_prompts` maps each label to a text (`{"7": "a photo of the digit seven"}`); labels are compared as strings,
    so integer keys match the string labels records carry.
    """
    from vembed.data.records import Side

    if not examples:
        raise DataError("no examples to evaluate")
    label_index = {str(key): i for i, key in enumerate(class_prompts)}
    unknown = sorted({str(ex.label) for ex in examples} - set(label_index))
    if unknown:
        raise DataError(f"labels {unknown[:5]} have no class prompt (records without a label count as 'None')")
    kwargs = dict(batch_size=batch_size, accelerator=accelerator)
    prompt_emb = F.normalize(encode_sides(adapter, [Side(text=t) for t in class_prompts.values()], **kwargs), dim=-1)
    item_emb = F.normalize(encode_sides(adapter, [getattr(ex, side) for ex in examples], **kwargs), dim=-1)
    predicted = (item_emb @ prompt_emb.T).argmax(dim=1).cpu()
    target = torch.tensor([label_index[str(ex.label)] for ex in examples])
    return (predicted == target).double().mean().item()
