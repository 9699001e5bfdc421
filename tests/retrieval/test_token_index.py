"""The approximate MaxSim index (token_index.py): with candidates covering the corpus it returns exact search's top-k,
with few it misses documents but never misscores one, its candidates are the owners of each query token's nearest
document tokens, and the same corpus builds the same graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vembed.retrieval.maxsim_search import PackedTokens, maxsim_top_k
from vembed.retrieval.token_index import HnswSettings, TokenIndex

pytest.importorskip("voyager")

COVERING = HnswSettings(candidates_per_token=10_000, ef_search=10_000)


def _unit(*shape: int, seed: int) -> torch.Tensor:
    return F.normalize(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)), dim=-1)


def _corpus(n_documents: int = 120, dim: int = 8, seed: int = 0) -> PackedTokens:
    """Documents of 1 to 6 unit token vectors, stored as the exact path stores them (float16); documents 3 and 4
    are copies of document 2, so equal scores must be ordered by corpus position."""
    lengths = torch.randint(1, 7, (n_documents,), generator=torch.Generator().manual_seed(seed))
    documents = [_unit(int(n), dim, seed=seed + 1 + i) for i, n in enumerate(lengths)]
    documents[3] = documents[4] = documents[2]
    return PackedTokens.pack(documents)


def _exact_scores(queries: torch.Tensor, corpus: PackedTokens) -> list[dict[int, float]]:
    """Every document's exact MaxSim for each query, by document position."""
    every = maxsim_top_k(queries, corpus, len(corpus))
    return [dict(zip(indices, scores)) for indices, scores in zip(every.indices.tolist(), every.scores.tolist())]


def test_candidates_covering_the_corpus_give_exact_search_top_k():
    corpus, queries = _corpus(), _unit(7, 4, 8, seed=99)
    queries[1] = corpus.padded(2, 3)[0, :1].expand(4, -1)  # a query that ties documents 2, 3 and 4 at the top
    exact = maxsim_top_k(queries, corpus, 10)
    found = TokenIndex(corpus, COVERING).search(queries, 10)
    assert torch.equal(found.indices, exact.indices)
    assert torch.allclose(found.scores, exact.scores, atol=1e-6, rtol=0)
    assert found.indices[1, :3].tolist() == [2, 3, 4]


def test_few_candidates_miss_documents_but_every_returned_score_is_exact_maxsim():
    corpus, queries = _corpus(n_documents=300, seed=1), _unit(20, 4, 8, seed=7)
    exact = maxsim_top_k(queries, corpus, 10)
    found = TokenIndex(corpus, HnswSettings(candidates_per_token=2, m=2, ef_construction=4, ef_search=2)).search(
        queries, 10)
    overlap = sum(len(set(a) & set(b) - {-1}) for a, b in zip(found.indices.tolist(), exact.indices.tolist()))
    assert overlap / exact.indices.numel() < 0.9  # the approximation is real here
    scores = _exact_scores(queries, corpus)
    returned = 0
    for row, (indices, values) in enumerate(zip(found.indices.tolist(), found.scores.tolist())):
        hits = [(i, s) for i, s in zip(indices, values) if i >= 0]
        assert all(abs(s - scores[row][i]) <= 1e-6 for i, s in hits)
        assert [s for _, s in hits] == sorted((s for _, s in hits), reverse=True)
        assert all(s == -torch.inf for i, s in zip(indices, values) if i < 0)  # fewer candidates than k: none
        returned += len(hits)
    assert returned > 0


def test_candidates_are_the_documents_owning_each_query_tokens_nearest_document_tokens():
    corpus, queries = _corpus(n_documents=400, seed=2), _unit(5, 3, 8, seed=5)
    queries[2, 2] = 0  # a query of two tokens: its padding finds nothing
    owners = torch.repeat_interleave(torch.arange(len(corpus)), corpus.lengths)
    similarities = queries.double() @ corpus.vectors.double().T  # (queries, query tokens, document tokens)
    nearest = similarities.topk(3, dim=-1).indices
    # A poor graph searched with a candidate list as long as the corpus: exact only if ef_search reaches the search.
    index = TokenIndex(corpus, HnswSettings(candidates_per_token=3, m=4, ef_construction=8, ef_search=5000))
    for row, candidates in enumerate(index.candidates(queries)):
        tokens = 2 if row == 2 else 3
        assert candidates.tolist() == sorted(set(owners[nearest[row, :tokens]].flatten().tolist())), row


def test_the_same_corpus_builds_the_same_graph_and_the_index_size_counts_it():
    corpus = _corpus(n_documents=80, seed=3)
    first, second = TokenIndex(corpus), TokenIndex(corpus)
    assert first.graph.as_bytes() == second.graph.as_bytes()
    tuned = TokenIndex(corpus, HnswSettings(m=5, ef_construction=17))
    assert (tuned.graph.M, tuned.graph.ef_construction, tuned.graph.num_elements) == (5, 17, len(corpus.vectors))
    assert first.nbytes > corpus.nbytes + len(corpus.vectors) * corpus.dim * 4  # float32 vectors and links besides


def test_an_empty_corpus_finds_nothing_and_a_bad_setting_is_refused():
    found = TokenIndex(PackedTokens.joined([]), COVERING).search(_unit(2, 3, 8, seed=1), 4)
    assert found.indices.tolist() == [[-1] * 4] * 2
    with pytest.raises(ValueError, match="candidates_per_token must be a whole number of at least 1, got 0"):
        HnswSettings(candidates_per_token=0)
    with pytest.raises(ValueError, match="m must be a whole number of at least 2, got 1"):  # voyager fails at 1
        HnswSettings(m=1)
    smallest = HnswSettings(candidates_per_token=1, m=2, ef_construction=1, ef_search=1)
    corpus = _corpus(n_documents=5)
    best = TokenIndex(corpus, COVERING).search(_unit(1, 2, 8, seed=1), 1)  # k = 1
    assert best.indices.tolist() == maxsim_top_k(_unit(1, 2, 8, seed=1), corpus, 1).indices.tolist()
    assert TokenIndex(corpus, smallest).search(_unit(1, 2, 8, seed=1), 1).indices.shape == (1, 1)
    with pytest.raises(ValueError, match="k must be at least 1"):
        TokenIndex(_corpus(n_documents=5)).search(_unit(1, 2, 8, seed=1), 0)


def test_joined_blocks_and_subsets_keep_each_documents_vectors():
    corpus = _corpus(n_documents=9, seed=4)
    halves = [corpus.subset(torch.arange(0, 4)), corpus.subset(torch.arange(4, 9))]
    joined = PackedTokens.joined(halves)
    assert torch.equal(joined.vectors, corpus.vectors) and torch.equal(joined.lengths, corpus.lengths)
    picked = corpus.subset(torch.tensor([7, 1]))
    assert picked.vectors.dtype == corpus.vectors.dtype
    assert torch.equal(picked.padded(), corpus.select(torch.tensor([7, 1])))
    assert torch.equal(picked.padded(0, 1)[0, : corpus.lengths[7]], corpus.padded(7, 8)[0, : corpus.lengths[7]])
