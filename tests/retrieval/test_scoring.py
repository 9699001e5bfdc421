"""The one home of scoring: blocked top-k and first-relevant ranks follow one order (score descending, then position),
ties included, and pair evaluation and corpus search/evaluation rank alike."""

from __future__ import annotations

import math

import pytest
import torch

from vembed.evaluation.corpus import Cutoffs, corpus_metrics
from vembed.evaluation.pairs import retrieval_metrics
from vembed.retrieval.scoring import block_top_k, embeddings_for_scoring, first_ranks, query_chunks, scores_of, top_k


def _tied(n_queries: int, n_docs: int, seed: int = 0, dim: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Embeddings from 3 directions only: most scores are exactly equal to many others."""
    gen = torch.Generator().manual_seed(seed)
    directions = torch.randn(3, dim, generator=gen)
    return (directions[torch.arange(n_queries) % 3],
            directions[torch.randint(0, 3, (n_docs,), generator=gen)])


def _full_order(scores: torch.Tensor) -> torch.Tensor:
    """Every row's documents by score descending, equal scores by position (a stable sort), NaN last."""
    return torch.nan_to_num(scores, nan=-math.inf).argsort(dim=1, descending=True, stable=True)


def test_block_top_k_keeps_ties_beyond_the_slack_in_position_order():
    scores = torch.tensor([[0.5] * 30 + [0.9] + [0.5] * 30, [-math.inf] * 61])
    scores[0, 59] = 0.7
    found = block_top_k(scores, 5, doc_offset=100)
    assert found.indices.tolist() == [[130, 159, 100, 101, 102], [100, 101, 102, 103, 104]]
    assert found.scores[0].tolist() == pytest.approx([0.9, 0.7, 0.5, 0.5, 0.5])
    # A row without a tie at the k-th place and one with: both exact in one call.
    mixed = torch.stack([torch.arange(61, dtype=torch.float32), torch.zeros(61)])
    assert block_top_k(mixed, 3).indices.tolist() == [[60, 59, 58], [0, 1, 2]]
    # Fewer documents than k: the rest is empty.
    short = block_top_k(torch.tensor([[0.1, 0.3]]), 4)
    assert short.indices.tolist() == [[1, 0, -1, -1]] and math.isinf(short.scores[0, 3].item())


def test_top_k_of_tied_scores_in_any_blocks_is_the_stable_full_sort():
    queries, docs = _tied(13, 200)
    expected = _full_order(torch.nn.functional.normalize(queries, dim=-1)
                           @ torch.nn.functional.normalize(docs, dim=-1).T)[:, :40]
    for chunk_elements in (50, 999, 1 << 25):
        assert torch.equal(top_k(queries, docs, 40, chunk_elements=chunk_elements).indices, expected)
    assert torch.equal(top_k(queries, docs, 40, doc_offset=7).indices, expected + 7)


@pytest.mark.parametrize("dim", [8, 64, 384])
def test_equal_documents_score_equally_in_any_block_and_rank_by_position(dim):
    """A float32 product sums in an order its kernel picks from the block's shape: the same query and document scored
    1.0 in one block and 0.99999994 in another, so duplicates ranked by block shape and machine, not position."""
    queries, docs = _tied(13, 200, seed=dim, dim=dim)
    queries, docs = embeddings_for_scoring(queries, docs)
    whole = scores_of(queries, docs)
    assert all(len(row.unique()) <= 3 for row in whole)  # one score per direction, within one product too
    for rows in (1, 5, 13):
        for width in (1, 3, 7, 50):
            for start in range(0, 200, width):
                block = scores_of(queries[:rows], docs[start : start + width])
                assert torch.equal(block, whole[:rows, start : start + width]), (rows, width, start)
    expected = _full_order(whole)[:, :40]
    for chunk_elements in (1, 7, 50, 999, 1 << 25):
        found = top_k(queries, docs, 40, chunk_elements=chunk_elements)
        assert torch.equal(found.indices, expected), chunk_elements
        assert torch.equal(found.scores, whole.gather(1, expected)), chunk_elements


def test_first_ranks_are_ranks_in_the_full_order():
    gen = torch.Generator().manual_seed(1)
    scores = torch.randint(0, 4, (40, 25), generator=gen).float()  # many ties
    scores[0] = float("nan")  # NaN everywhere: position order
    scores[1, :5] = -math.inf  # relevant documents ranked last among finite ones
    wanted = torch.rand(40, 25, generator=gen) < 0.2
    wanted[:, 24] = True
    wanted[1] = False
    wanted[1, [2, 4]] = True
    ranks_of = _full_order(scores).argsort(dim=1) + 1  # the rank of each position
    expected = ranks_of.masked_fill(~wanted, 10**6).min(dim=1).values
    assert torch.equal(first_ranks(torch.nan_to_num(scores, nan=-math.inf), wanted), expected)
    assert expected[1] == 23 and expected[0] == wanted[0].nonzero()[0].item() + 1


def test_query_chunks_stay_within_the_bound_and_cover_every_query():
    queries, docs = torch.randn(10, 4), torch.randn(7, 4)
    chunks = list(query_chunks(queries, docs, chunk_elements=20))
    assert [(start, stop) for start, stop, _ in chunks] == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]
    torch.testing.assert_close(torch.cat([scores for _, _, scores in chunks]), queries @ docs.T, atol=1e-5, rtol=0)
    assert [stop - start for start, stop, _ in query_chunks(queries, docs, chunk_size=4)] == [4, 4, 2]
    assert [stop for _, stop, _ in query_chunks(queries, docs, chunk_elements=3)] == list(range(1, 11))  # >= 1


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_pair_evaluation_and_corpus_search_break_ties_the_same_way(chunk_size):
    """Collapsed-ish embeddings (3 directions): the pair evaluation's metrics equal those read off the corpus search's
    ranking of the same scores, and the corpus metrics of that ranking (one relevant document per query, so
    trec_eval's recall is the hit rate, accuracy@k, too)."""
    queries, docs = _tied(17, 23, seed=2)
    tied = [(docs == query).all(dim=1).nonzero().squeeze(1) for query in queries]  # each query's direction
    # Each query's relevant document: the 1st, 2nd or 3rd of its direction (all tied at the top) or, for a few, any.
    relevant = torch.tensor([int(tied[i][i % 3]) if i % 4 else 3 * i % 23 for i in range(17)])
    relevance = torch.zeros(17, 23, dtype=torch.bool)
    relevance[torch.arange(17), relevant] = True
    pair = retrieval_metrics(queries, docs, relevance, ks=(1, 5, 10), chunk_size=chunk_size)

    ranking = top_k(queries, docs, 23)  # the corpus search's full ranking
    ranks = (ranking.indices == relevant[:, None]).int().argmax(dim=1) + 1
    by_hand = {f"accuracy@{k}": (ranks <= k).double().mean().item() for k in (1, 5, 10)}
    by_hand["mrr"] = (1.0 / ranks.double()).mean().item()
    by_hand["ndcg@10"] = torch.where(ranks <= 10, 1 / torch.log2(ranks.double() + 1), 0.0).mean().item()
    assert pair == pytest.approx(by_hand)
    assert 0 < pair["accuracy@1"] < pair["accuracy@10"] < 1  # the ties decide ranks here

    qrels = {f"q{i}": {f"d{int(j)}": 1} for i, j in enumerate(relevant)}
    corpus = corpus_metrics(ranking, qrels, Cutoffs(ndcg=(10,), recall=(1, 5, 10), map=(), mrr=(23,)),
                            query_ids=list(qrels), doc_ids=[f"d{j}" for j in range(23)])
    assert corpus["ndcg@10"] == pytest.approx(pair["ndcg@10"]) and corpus["mrr@23"] == pytest.approx(pair["mrr"])
    assert [corpus[f"recall@{k}"] for k in (1, 5, 10)] == pytest.approx([pair[f"accuracy@{k}"] for k in (1, 5, 10)])


def test_top_k_ranks_by_cosine_whatever_the_norms_and_nan_documents_last():
    """Each row is scaled by its own norm (cosine, not dot product, unless normalize=False) and a NaN embedding scores
    -inf: ranked after every real document, never first (NaN would sort above +inf)."""
    queries = torch.tensor([[1.0, 0.0], [0.0, 3.0]])
    docs = torch.tensor([[10.0, 1.0], [0.6, 0.8], [float("nan"), 0.0], [0.0, -0.5], [1.0, 0.1]])
    found = top_k(queries, docs, 5)
    unit = torch.nn.functional.normalize(docs, dim=-1)
    assert found.indices[0].tolist() == [0, 4, 1, 3, 2]  # [10, 1] and [1, 0.1] point the same way: position breaks it
    assert found.indices[1].tolist() == [1, 0, 4, 3, 2]
    assert found.scores[0, :2].tolist() == pytest.approx([unit[0, 0].item()] * 2, abs=1e-7)
    assert found.scores[:, 4].tolist() == [-math.inf, -math.inf]
    dot = top_k(queries, docs, 2, normalize=False)
    assert dot.indices.tolist() == [[0, 4], [0, 1]] and dot.scores[1].tolist() == pytest.approx([3.0, 2.4])
