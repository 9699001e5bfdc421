"""Corpus search with a multi_vector (ColBERT) model: exact MaxSim over packed float16 blocks, the same metrics as
trec_eval on a run computed by brute force here, block size without effect, one block held at a time, token pooling,
and mining through the same scorer."""

from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch
from corpora import make_corpus_folder

from vembed.data.corpus import load_corpus_split
from vembed.evaluation.corpus import Cutoffs, evaluate_corpus
from vembed.retrieval.maxsim_search import STORED_DTYPE, IndexSize, PackedTokens, maxsim_top_k, pool_tokens
from vembed.retrieval.search import SCORINGS, search_corpus

CUTOFFS = Cutoffs(ndcg=(1, 3, 10), recall=(1, 10, 100), map=(5, 100), mrr=(10,))


@pytest.fixture(scope="module")
def colbert(mask_tokenizer_dir):
    return _colbert(mask_tokenizer_dir)


def _colbert(mask_tokenizer_dir: str):
    """A tiny random-init ColBERT, the same weights in every process that builds it."""
    from vembed.components import recipe_from_dict
    from vembed.models import MODELS

    config = {"model_type": "bert", "vocab_size": 512, "hidden_size": 32, "intermediate_size": 37,
              "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 32,
              "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    recipe = recipe_from_dict({"model_type": "text", "tokenizer_name": mask_tokenizer_dir, "model_config": config,
                               "embedding": "multi_vector", "multi_vector_dim": 16, "query_length": 12,
                               "max_length": 30, "loss_type": "late_interaction"})
    torch.manual_seed(0)
    return MODELS.get("text").from_recipe(recipe).eval()


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    return load_corpus_split(make_corpus_folder(tmp_path_factory.mktemp("corpus")), "train")


def _vectors(adapter, sides) -> list[torch.Tensor]:
    """Each side's own token vectors, encoded one at a time (no batch padding at all)."""
    out = []
    with torch.no_grad():
        for side in sides:
            vectors = adapter.encode(adapter.preprocess([side]))[0]
            out.append(vectors[vectors.ne(0).any(dim=-1)])
    return out


def _brute_force_run(adapter, split, query_ids) -> dict[str, dict[str, float]]:
    """Every (query, document) MaxSim by loops over tokens, in float64, documents as the index stores them."""
    queries = _vectors(adapter, [split.queries.sides[split.queries.index[q]] for q in query_ids])
    documents = [d.to(STORED_DTYPE).double() for d in _vectors(adapter, split.corpus.sides)]
    run = {}
    for query_id, query in zip(query_ids, queries):
        query = query.double()
        run[query_id] = {doc_id: float(sum(max(float(q @ t) for t in doc) for q in query))
                         for doc_id, doc in zip(split.corpus.ids, documents)}
    return run


def test_corpus_metrics_of_a_multi_vector_model_equal_trec_eval_on_a_brute_force_maxsim_run(colbert, split):
    pytrec_eval = pytest.importorskip("pytrec_eval")
    query_ids = [q for q in split.queries.ids if any(g > 0 for g in split.qrels[q].values())]
    run = _brute_force_run(colbert, split, query_ids)
    measures = {"ndcg_cut.1,3,10", "recall.1,10,100", "map_cut.5,100", "recip_rank"}
    # recip_rank has no cut-off in trec_eval: the run cut to 10 gives MRR@10
    cut = {q: dict(sorted(docs.items(), key=lambda item: -item[1])[:10]) for q, docs in run.items()}
    qrels = {q: split.qrels[q] for q in query_ids}
    full = pytrec_eval.RelevanceEvaluator(qrels, measures).evaluate(run)
    at_10 = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"}).evaluate(cut)
    expected = {}
    for name in CUTOFFS.names():
        metric, k = name.split("@")
        trec = {"ndcg": f"ndcg_cut_{k}", "recall": f"recall_{k}", "map": f"map_cut_{k}"}.get(metric)
        values = [at_10[q]["recip_rank"] if trec is None else full[q][trec] for q in query_ids]
        expected[f"corpus/{name}"] = sum(values) / len(values)

    found = evaluate_corpus(colbert, split, cutoffs=CUTOFFS, documents_per_block=5, batch_size=4)
    assert found["num_documents"] == 36 and found["num_queries"] == len(query_ids)
    for name, value in expected.items():
        assert found[name] == pytest.approx(value, abs=1e-6), name
    assert 0 < found["corpus/ndcg@10"] < 1  # a ranking that is neither perfect nor empty was compared


def test_block_size_does_not_change_the_run(colbert, split):
    queries, documents = split.queries.sides[:4], split.corpus.sides[:13]
    runs = [search_corpus(colbert, queries, documents, 10, batch_size=7, documents_per_block=size)
            for size in (1, 3, len(documents))]
    for other in runs[1:]:
        assert torch.equal(other.indices, runs[0].indices)
        torch.testing.assert_close(other.scores, runs[0].scores, atol=1e-6, rtol=0)
    assert (runs[0].indices >= 0).all()


def test_the_scorer_holds_one_block_of_token_vectors_and_the_top_k(colbert, split, monkeypatch):
    scoring = SCORINGS.get("multi_vector")
    live: weakref.WeakSet = weakref.WeakSet()
    seen = {"held": [], "sizes": [], "scored": 0}

    def encode_share(adapter, sides, **kwargs):
        seen["held"].append(len(live))  # blocks still alive while the next one is made
        block = scoring.encode_share(adapter, sides, **kwargs)
        live.add(block)
        seen["sizes"].append(len(block))
        return block

    def top_k(queries, block, k, **kwargs):
        assert list(live) == [block]  # nothing but the block being scored
        seen["scored"] += 1
        found = scoring.top_k(queries, block, k, **kwargs)
        assert found.scores.shape == (len(queries), k)  # what is kept across blocks
        return found

    monkeypatch.setitem(SCORINGS._entries, "multi_vector", dataclasses.replace(scoring, encode_share=encode_share,
                                                                                top_k=top_k))
    found = search_corpus(colbert, split.queries.sides, split.corpus.sides, 10, batch_size=4, documents_per_block=5)
    assert seen["sizes"] == [5] * 7 + [1] and seen["scored"] == 8
    assert seen["held"] == [0] * 8
    assert not list(live) and found.indices.shape == (len(split.queries), 10)


def test_packed_blocks_keep_only_tokens_in_float16_and_unpack_to_the_padded_vectors():
    torch.manual_seed(0)
    padded = torch.nn.functional.normalize(torch.randn(3, 5, 4), dim=-1)
    padded[0, 3:] = 0
    padded[1, 1] = 0  # a skipped token inside a document
    padded[2] = 0  # a document without tokens
    packed = PackedTokens.pack(padded)
    assert packed.vectors.dtype == STORED_DTYPE and packed.lengths.tolist() == [3, 4, 0]
    assert packed.nbytes == 7 * 4 * 2 + 3 * 8
    unpacked = packed.padded()
    assert unpacked.shape == (3, 4, 4)
    torch.testing.assert_close(unpacked[0, :3], padded[0, :3].half().float())
    torch.testing.assert_close(unpacked[1], padded[1][[0, 2, 3, 4]].half().float())
    assert not unpacked[0, 3:].any() and not unpacked[2].any()
    round_trip = PackedTokens.from_state(packed.state())
    assert torch.equal(round_trip.vectors, packed.vectors) and torch.equal(round_trip.lengths, packed.lengths)
    # A document without tokens scores 0 and still ranks (after the others when their scores are positive).
    queries = padded[:1, :3]
    found = maxsim_top_k(queries, packed, 3, doc_offset=10)
    assert sorted(found.indices[0].tolist()) == [10, 11, 12] and found.scores[0, -1] == 0


def test_pooling_clusters_a_documents_tokens_into_unit_means():
    torch.manual_seed(0)
    centres = torch.nn.functional.normalize(torch.randn(3, 8), dim=-1)
    tokens = torch.nn.functional.normalize(centres.repeat_interleave(2, 0) + 0.01 * torch.randn(6, 8), dim=-1)
    pooled = pool_tokens(tokens, 2)
    assert pooled.shape == (3, 8)
    torch.testing.assert_close(pooled.norm(dim=-1), torch.ones(3))
    # Each pooled vector is the (renormalised) mean of one centre's two tokens.
    best = (pooled @ centres.T).max(dim=0).values
    assert (best > 0.999).all()
    assert torch.equal(pool_tokens(tokens, 1), tokens) and pool_tokens(tokens[:1], 3).shape == (1, 8)
    assert pool_tokens(tokens, 3).shape == (2, 8)


def test_a_pool_factor_shrinks_the_index_and_still_searches(colbert, split, monkeypatch):
    from vembed.retrieval.maxsim_search import encode_token_share, set_pool_factor

    sides = split.corpus.sides[:8]
    full = encode_token_share(colbert, sides, batch_size=4)
    set_pool_factor(colbert, 2)
    try:
        pooled = encode_token_share(colbert, sides, batch_size=4)
        found = search_corpus(colbert, split.queries.sides, split.corpus.sides, 5, documents_per_block=9)
    finally:
        set_pool_factor(colbert, 1)
    assert pooled.lengths.tolist() == [max(1, n // 2) for n in full.lengths.tolist()]
    assert pooled.nbytes < 0.6 * full.nbytes
    assert (found.indices >= 0).all()


def test_a_pool_factor_is_refused_for_a_single_vector_model_naming_the_flag(tiny_tokenizer_dir):
    from corpora import text_model_keys

    from vembed.components import recipe_from_dict
    from vembed.errors import RecipeError
    from vembed.models import MODELS
    from vembed.retrieval.maxsim_search import set_pool_factor

    dense = MODELS.get("text").from_recipe(recipe_from_dict(text_model_keys(tiny_tokenizer_dir)))
    set_pool_factor(dense, 1)  # no pooling asks nothing of the model
    with pytest.raises(RecipeError, match="--pool-factor: pools token vectors; this model gives one vector"):
        set_pool_factor(dense, 2)


def test_mining_with_a_multi_vector_model_scores_positives_and_negatives_by_maxsim(colbert, split, tmp_path):
    from vembed.retrieval.cache import EmbeddingCache
    from vembed.retrieval.mining import MiningSettings, mine_hard_negatives

    settings = MiningSettings(range_min=1, range_max=8, max_score_ratio=None, num_negatives=3)
    cache = EmbeddingCache(tmp_path / "cache", {"model": "colbert"}).open()
    rows, stats = mine_hard_negatives(colbert, split, settings, batch_size=4, cache=cache, documents_per_block=7)
    assert rows and stats.blocks_encoded == 6 and stats.blocks_reused == 0
    query_ids = sorted({row["query_id"] for row in rows})
    run = _brute_force_run(colbert, split, query_ids)
    for row in rows:
        scores = run[row["query_id"]]
        assert row["positive_score"] == pytest.approx(scores[row["positive_id"]], abs=1e-4)
        assert row["negative_scores"] == pytest.approx([scores[d] for d in row["negative_ids"]], abs=1e-4)
        assert row["positive_id"] not in row["negative_ids"]
    again, stats = mine_hard_negatives(colbert, split, settings, batch_size=4,
                                       cache=EmbeddingCache(tmp_path / "cache", {"model": "colbert"}).open(),
                                       documents_per_block=7)
    assert stats.blocks_reused == 6 and stats.blocks_encoded == 0 and again == rows


def _search_on_ranks(tokenizer_dir: str, folder: str, out_file: str) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    assert accelerator.num_processes == 2
    split = load_corpus_split(folder, "train")
    index = IndexSize()
    found = search_corpus(_colbert(tokenizer_dir), split.queries.sides, split.corpus.sides, 10,
                          accelerator=accelerator, batch_size=4, documents_per_block=4, on_block=index.add)
    total = index.across(accelerator)  # a collective: every rank calls it
    if accelerator.is_main_process:
        torch.save({"scores": found.scores, "indices": found.indices, "index": torch.tensor(total.counts())}, out_file)


def test_two_ranks_each_scoring_a_share_of_each_block_find_what_one_process_finds(mask_tokenizer_dir, split,
                                                                                   tmp_path):
    from ranks import run_on_ranks

    index = IndexSize()
    expected = search_corpus(_colbert(mask_tokenizer_dir), split.queries.sides, split.corpus.sides, 10,
                             batch_size=4, documents_per_block=8, on_block=index.add)
    out = tmp_path / "found.pt"
    run_on_ranks(_search_on_ranks, mask_tokenizer_dir, str(split.folder), str(out), world=2, timeout=240)
    found = torch.load(out, weights_only=True)
    assert torch.equal(found["indices"], expected.indices)
    # each rank saw its share of the blocks; summed, the index size one process reports (vembed eval's index/...)
    assert found["index"].tolist() == index.counts() and index.documents == len(split.corpus)
    torch.testing.assert_close(found["scores"], expected.scores, atol=1e-6, rtol=0)


# --- the packed block and the scorer on token vectors written here (no model) ---------------------------------------
def _unit_tokens(lengths: list[int], dim: int = 4, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.functional.normalize(torch.randn(n, dim, generator=g), dim=-1) for n in lengths]


def _brute_scores(queries: torch.Tensor, documents: list[torch.Tensor]) -> torch.Tensor:
    """(n_queries, n_documents) MaxSim by loops, documents as stored (float16), a document without tokens 0."""
    out = torch.zeros(len(queries), len(documents))
    for i, query in enumerate(queries):
        for j, doc in enumerate(documents):
            doc = doc.to(STORED_DTYPE).float()
            out[i, j] = sum(float((q @ doc.T).max()) for q in query if q.any()) if len(doc) else 0.0
    return out


def test_packed_tokens_refuse_lengths_that_do_not_sum_to_the_vectors():
    with pytest.raises(ValueError, match="^3 token vectors for document lengths summing to 4$"):
        PackedTokens(torch.zeros(3, 4), torch.tensor([1, 3]))
    with pytest.raises(ValueError, match="^3 token vectors for document lengths summing to 3$"):
        PackedTokens(torch.zeros(3, 4), torch.tensor([[1, 2]]))  # lengths must be one per document
    empty = PackedTokens.pack([])
    assert len(empty) == 0 and empty.vectors.shape == (0, 0) and empty.vectors.dtype == STORED_DTYPE


def test_a_packed_list_slices_selects_and_moves_documents_by_position():
    docs = _unit_tokens([2, 0, 3, 1])
    packed = PackedTokens.pack(docs)
    assert packed.lengths.tolist() == [2, 0, 3, 1] and packed.lengths.dtype == torch.long and packed.dim == 4
    middle = packed.padded(1, 3)
    assert middle.shape == (2, 3, 4) and middle.dtype == torch.float32
    assert not middle[0].any() and torch.equal(middle[1], docs[2].half().float())
    assert torch.equal(packed.padded(3), docs[3].half().float()[None])  # to the end
    assert packed.padded(1, 2).shape == (1, 0, 4)  # only a document without tokens
    assert packed.padded(2, 2).shape == (0, 0, 4)  # no document
    picked = packed.select(torch.tensor([3, 0]))
    assert picked.shape == (2, 2, 4) and picked.dtype == torch.float32
    assert torch.equal(picked[0, :1], docs[3].half().float()) and not picked[0, 1:].any()
    assert torch.equal(picked[1], docs[0].half().float())
    assert packed.select(torch.tensor([], dtype=torch.long)).shape == (0, 0, 4)
    moved = packed.to("cpu")
    assert torch.equal(moved.vectors, packed.vectors) and torch.equal(moved.lengths, packed.lengths)


@pytest.mark.parametrize("chunk_elements", [1, 4 * 3 + 1, 1 << 24])  # one document a chunk, two, all
def test_maxsim_top_k_equals_loops_for_any_chunk_and_offsets_the_indices(chunk_elements):
    docs = _unit_tokens([2, 3, 1, 0, 3, 2, 1], seed=1)
    queries = torch.stack([torch.cat([q, q.new_zeros(3 - len(q), 4)]) for q in _unit_tokens([3, 2, 1], seed=2)])
    expected = _brute_scores(queries, docs)
    found = maxsim_top_k(queries.double(), PackedTokens.pack(docs), 4, doc_offset=100, chunk_elements=chunk_elements)
    assert found.scores.dtype == torch.float32 and found.indices.shape == (3, 4)
    order = expected.sort(dim=1, descending=True, stable=True)
    torch.testing.assert_close(found.scores, order.values[:, :4], atol=1e-5, rtol=0)
    assert torch.equal(found.indices, order.indices[:, :4] + 100)


def test_maxsim_top_k_keeps_k_beyond_the_block_and_ranks_nan_last():
    docs = _unit_tokens([1, 2], seed=3)
    queries = torch.nn.functional.normalize(torch.randn(1, 2, 4), dim=-1)
    found = maxsim_top_k(queries, PackedTokens.pack(docs), 3)
    assert found.indices[0, 2] == -1 and found.scores[0, 2] == -torch.inf  # 2 documents for k 3: one empty slot
    nan = PackedTokens(torch.full((2, 4), float("nan")).half(), torch.tensor([2]))
    both = maxsim_top_k(queries, PackedTokens(torch.cat([nan.vectors, PackedTokens.pack(docs).vectors]),
                                              torch.tensor([2, 1, 2])), 3)
    assert both.indices[0, 2] == 0  # the NaN document ranks after both others


def test_maxsim_top_k_refuses_bad_queries_and_k_and_scores_empty_sides():
    packed = PackedTokens.pack(_unit_tokens([2, 1]))
    with pytest.raises(ValueError, match=r"^token vectors must be \(n, tokens, 4\), got \(2, 4\)$"):
        maxsim_top_k(torch.zeros(2, 4), packed, 1)
    with pytest.raises(ValueError, match=r"^token vectors must be \(n, tokens, 4\), got \(2, 3, 5\)$"):
        maxsim_top_k(torch.zeros(2, 3, 5), packed, 1)
    with pytest.raises(ValueError, match="^k must be at least 1, got 0$"):
        maxsim_top_k(torch.zeros(2, 3, 4), packed, 0)
    assert maxsim_top_k(torch.nn.functional.normalize(torch.ones(2, 3, 4), dim=-1), packed, 1).indices.shape == (2, 1)
    none = maxsim_top_k(torch.zeros(0, 3, 4), packed, 2)
    assert none.scores.shape == (0, 2)
    no_docs = maxsim_top_k(torch.zeros(2, 3, 4), PackedTokens(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long)), 2)
    assert no_docs.scores.shape == (2, 2) and (no_docs.indices == -1).all()


def test_maxsim_pairs_scores_each_query_with_its_own_document():
    from vembed.retrieval.maxsim_search import maxsim_pairs

    docs = _unit_tokens([2, 3, 1], seed=4)
    queries = torch.nn.functional.normalize(torch.randn(2, 3, 4, dtype=torch.float64), dim=-1)
    rows = torch.tensor([2, 0])
    scores = maxsim_pairs(queries, PackedTokens.pack(docs), rows)
    expected = _brute_scores(queries.float(), docs)
    assert scores.shape == (2,) and scores.dtype == torch.float32
    torch.testing.assert_close(scores, torch.stack([expected[0, 2], expected[1, 0]]), atol=1e-5, rtol=0)
    assert maxsim_pairs(queries, PackedTokens.pack(docs), torch.tensor([], dtype=torch.long)).shape == (0,)


def test_pooling_keeps_at_least_one_vector_and_packs_each_document_pooled():
    from vembed.retrieval.maxsim_search import pack_documents

    tokens = _unit_tokens([2], dim=8, seed=5)[0]
    assert pool_tokens(tokens, 3).shape == (1, 8)  # 2 // 3 is 0 clusters: one
    assert pool_tokens(tokens, 2).shape == (1, 8)
    padded = torch.zeros(2, 4, 8)
    padded[0, :4], padded[1, :2] = _unit_tokens([4], dim=8, seed=6)[0], tokens
    pooled = pack_documents(padded, 2)
    assert pooled.lengths.tolist() == [2, 1] and pooled.vectors.dtype == STORED_DTYPE
    torch.testing.assert_close(pooled.vectors[2:].float(), pool_tokens(tokens, 2).half().float())
    assert pack_documents(padded, 1).lengths.tolist() == [4, 2]


def test_pooling_clusters_by_ward_not_by_the_nearest_pair():
    """Tokens along an arc, each gap a little wider than the last: Ward's two clusters are the two halves; linking
    nearest pairs (single linkage) would chain all but the last token into one."""
    angles = torch.tensor([0, 1, 2.01, 3.03, 4.06, 5.1, 6.15, 7.21]) * 0.05
    tokens = torch.zeros(8, 4)
    tokens[:, 0], tokens[:, 1] = angles.cos(), angles.sin()
    halves = torch.nn.functional.normalize(torch.stack([tokens[:4].mean(0), tokens[4:].mean(0)]), dim=-1)
    pooled = pool_tokens(tokens, 4)
    torch.testing.assert_close(pooled[pooled[:, 1].argsort()], halves)


def test_pooling_without_scipy_is_refused_naming_the_key_before_a_document_is_pooled(monkeypatch):
    import sys
    from types import SimpleNamespace

    from vembed.errors import RecipeError
    from vembed.retrieval.maxsim_search import require_token_pooling, set_pool_factor

    monkeypatch.setitem(sys.modules, "scipy.cluster.hierarchy", None)  # an import of it raises ImportError
    missing = (r"token pooling needs scipy: pip install 'vembed\[colbert\]', or index without pooling "
               r"\(a pool factor of 1\)$")
    with pytest.raises(RecipeError, match=r"^environment error: document_pool_factor: " + missing):
        pool_tokens(torch.eye(4), 2)
    # The commands that pool (vembed eval, vembed mine) set the factor before the corpus is encoded: refused there.
    colbert = SimpleNamespace(embedding_kind="multi_vector", settings=SimpleNamespace(document_pool_factor=1))
    with pytest.raises(RecipeError, match=r"^environment error: --pool-factor: " + missing):
        set_pool_factor(colbert, 2)
    saved_pooled = SimpleNamespace(embedding_kind="multi_vector", settings=SimpleNamespace(document_pool_factor=3))
    with pytest.raises(RecipeError, match=r"^environment error: document_pool_factor: " + missing):
        set_pool_factor(saved_pooled, None)  # the model's own factor, as it was saved
    set_pool_factor(colbert, 1)  # no pooling needs no scipy
    set_pool_factor(colbert, None)
    require_token_pooling(1, "document_pool_factor")


def test_pool_factor_keys_and_flags():
    from types import SimpleNamespace

    from vembed.errors import RecipeError
    from vembed.retrieval.maxsim_search import pool_factor_key, pool_factor_of, set_pool_factor

    colbert = SimpleNamespace(embedding_kind="multi_vector", settings=SimpleNamespace(document_pool_factor=None))
    assert pool_factor_of(colbert) == 1 and pool_factor_key(colbert) == {}  # unpooled: older caches stay valid
    set_pool_factor(colbert, None)
    assert colbert.settings.document_pool_factor is None  # None keeps the model's own setting
    set_pool_factor(colbert, 2)  # the smallest factor that pools: a cache of it is not the unpooled one
    assert pool_factor_of(colbert) == 2 and pool_factor_key(colbert) == {"document_pool_factor": 2}
    set_pool_factor(colbert, 3)
    assert pool_factor_of(colbert) == 3 and pool_factor_key(colbert) == {"document_pool_factor": 3}
    with pytest.raises(RecipeError, match=r"^argument error: --pool-factor: must be at least 1 \(1: no pooling\), "
                                          r"got 0$"):
        set_pool_factor(colbert, 0)
    with pytest.raises(RecipeError, match="^recipe error: index.pool: must be at least 1"):
        set_pool_factor(colbert, -1, key="index.pool")
    set_pool_factor(colbert, 1)
    assert pool_factor_of(colbert) == 1 and pool_factor_key(colbert) == {}
    dense = SimpleNamespace(embedding_kind="single", settings=SimpleNamespace())
    set_pool_factor(dense, 1)  # no pooling asks nothing of the model
    assert pool_factor_of(dense) == 1 and not hasattr(dense.settings, "document_pool_factor")
    with pytest.raises(RecipeError, match="^argument error: --pool-factor: pools token vectors; this model gives one "
                                          "vector per document: remove the flag$"):
        set_pool_factor(dense, 2)


def test_duplicate_documents_score_equally_in_any_chunk_and_rank_by_position():
    """The same document twice (common in real corpora) gets one MaxSim score whatever chunk shape scores it, so
    the duplicates rank by corpus position for any `chunk_elements`, and `maxsim_pairs` scores as the search does."""
    from vembed.retrieval.maxsim_search import maxsim_pairs

    distinct = _unit_tokens([3, 5, 2, 4], seed=5, dim=32)
    gen = torch.Generator().manual_seed(6)
    docs = [distinct[int(i)] for i in torch.randint(0, 4, (60,), generator=gen)]
    queries = torch.nn.functional.normalize(torch.randn(7, 4, 32, generator=gen), dim=-1)
    packed = PackedTokens.pack(docs)
    reference = maxsim_top_k(queries, packed, 60, chunk_elements=1 << 24)
    assert all(len(row.unique()) <= 4 for row in reference.scores)  # one score per distinct document
    assert torch.equal(reference.indices.sort(dim=1).values, torch.arange(60).expand(7, 60))
    for chunk_elements in (1, 5 * 32 + 1, 11 * 5 * 32):  # one document a chunk, two, eleven
        found = maxsim_top_k(queries, packed, 20, chunk_elements=chunk_elements)
        assert torch.equal(found.scores, reference.scores[:, :20]), chunk_elements
        assert torch.equal(found.indices, reference.indices[:, :20]), chunk_elements
    for row in range(7):  # within each run of equal scores, corpus positions ascend
        for score in reference.scores[row].unique():
            run = reference.indices[row][reference.scores[row] == score]
            assert torch.equal(run, run.sort().values)
    pairs = maxsim_pairs(queries, packed, reference.indices[:, 0])
    assert torch.equal(pairs, reference.scores[:, 0])
