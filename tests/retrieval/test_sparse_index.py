"""Sparse (SPLADE) search through the inverted index (vembed/retrieval/sparse_index.py): the corpus is kept as CSR
blocks, never densely beyond one block, and scores and rankings equal the dense-block dot product's (float32, ties by
corpus position, non-finite vectors last); pruning at search time; and the commands (`vembed search`, `eval`,
`mine`) search a saved sparse model through it, refusing dense-only options in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from corpora import make_corpus_folder

import vembed
from vembed.cli import main
from vembed.data.records import Side
from vembed.errors import ArgumentError
from vembed.models.encoding import encode_sides
from vembed.models.splade import keep_top_k
from vembed.retrieval import SCORINGS, sparse_index
from vembed.retrieval.scoring import top_k
from vembed.retrieval.search import document_blocks, search, search_corpus
from vembed.retrieval.sparse_index import SparseVectors, set_sparse_pruning, sparse_pairs, sparse_top_k

# Sentences over the tiny tokenizer's words: some share many tokens, two are duplicates (exact ties).
TEXTS = ["a photo of a red square", "two black lines crossing", "a small yellow star", "an empty white page",
         "a red square", "a photo of a red square", "the number three", "a blue circle on white",
         "two", "a yellow star on a white page", "black lines", "a small blue square"]
QUERIES = ["red square", "a star", "white page", "two lines", "three"]


def _config(vocab_size: int) -> dict:
    return {"model_type": "bert", "vocab_size": vocab_size, "hidden_size": 32, "intermediate_size": 37,
            "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 32,
            "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


@pytest.fixture(scope="module")
def splade(tiny_tokenizer_dir, tmp_path_factory):
    """A tiny random-init SPLADE (BERT with its MLM head, embedding: sparse) saved by vembed, and a corpus folder."""
    from vembed.components import recipe_from_dict
    from vembed.models import MODELS

    root = tmp_path_factory.mktemp("splade")
    recipe = recipe_from_dict({"model_type": "text", "tokenizer_name": tiny_tokenizer_dir, "model_config": _config(300),
                               "embedding": "sparse", "max_length": 24})
    torch.manual_seed(0)
    MODELS.get("text").from_recipe(recipe).save(root / "model")
    make_corpus_folder(root / "corpus")
    return root


@pytest.fixture
def adapter(splade):
    return vembed.load(str(splade / "model"), device="cpu").adapter


def _dense_reference(adapter, queries, documents, k):
    """What search did before the index: dense (n, vocabulary) vectors, dot products in float64 rounded to float32."""
    return top_k(encode_sides(adapter, queries), encode_sides(adapter, documents), k, normalize=False)


def test_the_index_finds_what_dense_blocks_find_on_a_tiny_splade_model(adapter):
    queries = [Side(text=t, role="query") for t in QUERIES]
    documents = [Side(text=t, role="document") for t in TEXTS * 3]  # repeats: ties across blocks
    dense = encode_sides(adapter, documents)
    assert 0 < int((dense != 0).sum()) < dense.numel()  # sparse vectors with zeros to drop
    expected = _dense_reference(adapter, queries, documents, 20)
    for per_block in (5, 1024):  # many CSR blocks folded, and one
        found = search_corpus(adapter, queries, documents, 20, documents_per_block=per_block)
        assert torch.equal(found.indices, expected.indices)
        torch.testing.assert_close(found.scores, expected.scores, atol=1e-5, rtol=0)


def _sparse_rows(n: int, vocabulary: int, active: int, generator: torch.Generator) -> torch.Tensor:
    weights = torch.rand(n, vocabulary, generator=generator) * 3
    return keep_top_k(weights, active)


def test_ties_documents_sharing_no_term_and_broken_vectors_rank_as_in_dense_search():
    generator = torch.Generator().manual_seed(1)
    queries = _sparse_rows(9, 400, 6, generator)
    documents = _sparse_rows(300, 400, 8, generator)
    documents[[120, 250]] = documents[7].clone()  # exact ties: lower positions first
    documents[40:60] = 0  # empty documents: score 0 with every query
    documents[13, 5] = float("nan")  # a diverged document scores -inf, ranked last
    documents[60][documents[60] != 0] = float("nan")  # right after empty rows: they still score 0
    queries[4, 9] = float("nan")  # a diverged query: every document -inf, corpus order
    queries[6] = 0  # a query with no term: every document scores 0, corpus order
    for k in (1, 25, 320):  # k past the documents that share a term, and past the corpus
        expected = search(queries, [(0, documents)], min(k, 300), score_block=top_k, normalize=False)
        blocks = [(start, SparseVectors.from_dense(documents[start : start + 64])) for start in range(0, 300, 64)]
        found = search(SparseVectors.from_dense(queries), blocks, min(k, 300), score_block=sparse_top_k)
        assert torch.equal(found.indices, expected.indices), k
        assert torch.equal(found.scores, expected.scores), k  # both summed in float64, rounded to float32


def test_positive_pairs_are_scored_as_the_dense_dot_product():
    generator = torch.Generator().manual_seed(2)
    # Hundreds of shared terms per pair: a float32 sum would round otherwise than the float64 one search uses.
    queries, documents = _sparse_rows(64, 500, 400, generator), _sparse_rows(30, 500, 400, generator)
    rows = torch.randint(0, 30, (64,), generator=generator)
    expected = (queries.double() * documents[rows].double()).sum(-1).float()
    assert torch.equal(sparse_pairs(SparseVectors.from_dense(queries), SparseVectors.from_dense(documents), rows),
                       expected)
    # One pair, no pair, and a diverged vector on either side: -inf, as search ranks it.
    assert torch.equal(sparse_pairs(queries[:1], documents, rows[:1]), expected[:1])
    assert sparse_pairs(queries[:0], documents, rows[:0]).shape == (0,)
    queries[2, 0], documents[rows[5], 0] = float("nan"), float("inf")
    found = sparse_pairs(queries, documents, rows)
    broken = (torch.arange(64) == 2) | (rows == rows[5])
    assert torch.isneginf(found[broken]).all() and torch.equal(found[~broken], expected[~broken])
    assert SCORINGS.get("sparse").pair_scores is sparse_pairs


def test_blocks_are_csr_encoded_one_block_at_a_time(adapter, monkeypatch):
    """The corpus is never dense beyond one block: each encode sees at most a block of documents, and what is kept
    is the CSR matrix of its non-zeros (float32 weights, int32 term ids)."""
    from scipy.sparse import csr_matrix

    encoded: list[int] = []
    real = sparse_index.encode_sides

    def counting(adapter, sides, **kwargs):
        encoded.append(len(sides))
        return real(adapter, sides, **kwargs)

    monkeypatch.setattr(sparse_index, "encode_sides", counting)
    documents = [Side(text=t) for t in TEXTS * 2]
    blocks = list(document_blocks(adapter, documents, documents_per_block=5))
    assert encoded == [5, 5, 5, 5, 4]
    assert all(isinstance(block, SparseVectors) for _, block in blocks)
    assert SCORINGS.get("sparse").documents_per_block == 1024  # 125 MB of float32 at BERT's 30,522 tokens
    first = blocks[0][1]
    reference = csr_matrix(encode_sides(adapter, documents[:5]).numpy())
    assert first.matrix.dtype == np.float32 and first.matrix.indices.dtype == np.int32
    assert first.nonzeros == reference.nnz and first.nbytes == reference.data.nbytes + reference.indices.nbytes + \
        reference.indptr.nbytes
    restored = SparseVectors.from_state(first.state())  # what the embedding cache stores and reads back
    assert (restored.matrix != first.matrix).nnz == 0 and restored.matrix.shape == first.matrix.shape


def test_pruning_keeps_each_sides_largest_weights_in_the_index(adapter):
    queries = [Side(text=t, role="query") for t in QUERIES]
    documents = [Side(text=t, role="document") for t in TEXTS]
    set_sparse_pruning(adapter, query=4, document=6)
    shown = []
    found = search_corpus(adapter, queries, documents, 8, on_block=shown.append, on_queries=shown.append)
    assert np.diff(shown[0].matrix.indptr).max() == 4 and np.diff(shown[1].matrix.indptr).max() == 6
    expected = top_k(keep_top_k(encode_sides(adapter, queries), 4), keep_top_k(encode_sides(adapter, documents), 6),
                     8, normalize=False)
    assert torch.equal(found.indices, expected.indices)
    torch.testing.assert_close(found.scores, expected.scores, atol=1e-5, rtol=0)


def test_pruning_is_refused_for_a_dense_model_and_below_one():
    from tiny_models import hashing_encoder

    with pytest.raises(ArgumentError, match="--sparse-document-top-k.*dense"):
        set_sparse_pruning(hashing_encoder(), None, 5)


def test_embedder_search_ranks_through_the_index_as_dense_blocks(splade):
    model = vembed.load(str(splade / "model"), device="cpu")
    expected = _dense_reference(model.adapter, [Side(text=t, role="query") for t in QUERIES],
                                [Side(text=t, role="document") for t in TEXTS], 6)
    hits = model.search(QUERIES, TEXTS, top_k=6)
    assert [[hit["corpus_id"] for hit in row] for row in hits] == expected.indices.tolist()
    scores = torch.tensor([[hit["score"] for hit in row] for row in hits])
    torch.testing.assert_close(scores, expected.scores, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="sparse vectors"):
        model.search(QUERIES, TEXTS, index="hnsw")
    set_sparse_pruning(model.adapter, query=4, document=6)  # the same index, pruned as the commands prune it
    pruned = top_k(keep_top_k(encode_sides(model.adapter, [Side(text=t, role="query") for t in QUERIES]), 4),
                   keep_top_k(encode_sides(model.adapter, [Side(text=t, role="document") for t in TEXTS]), 6), 6,
                   normalize=False)
    hits = model.search(QUERIES, TEXTS, top_k=6)
    assert [[hit["corpus_id"] for hit in row] for row in hits] == pruned.indices.tolist()


# --- the commands ----------------------------------------------------------------------------------------------------
def _run_file(path) -> dict[str, list[tuple[str, float]]]:
    ranked: dict[str, list[tuple[str, float]]] = {}
    for line in path.read_text().splitlines():
        query, _, doc, _, score, _ = line.split()
        ranked.setdefault(query, []).append((doc, float(score)))
    return ranked


def test_vembed_search_writes_the_run_dense_blocks_would(splade, tmp_path, capsys):
    from vembed.data.corpus import load_corpus_split
    from vembed.evaluation.corpus import judged_queries

    out = tmp_path / "run.trec"
    assert main(["search", str(splade / "model"), str(splade / "corpus"), "--split", "dev", "--top-k", "10",
                 "--out", str(out)]) == 0
    assert "inverted index" in capsys.readouterr().out
    split = load_corpus_split(splade / "corpus", "dev")
    query_ids = judged_queries(split, None)
    adapter = vembed.load(str(splade / "model"), device="cpu").adapter
    expected = _dense_reference(adapter, [split.queries.sides[split.queries.index[q]] for q in query_ids],
                                split.corpus.sides, 10)
    ranked = _run_file(out)
    for query, indices, scores in zip(query_ids, expected.indices.tolist(), expected.scores.tolist()):
        assert [doc for doc, _ in ranked[query]] == [split.corpus.ids[i] for i in indices]
        assert [score for _, score in ranked[query]] == pytest.approx(scores, abs=1e-5)


def test_vembed_eval_reports_the_real_csr_bytes_and_pruning_shrinks_them(splade, tmp_path, capsys):
    from scipy.sparse import csr_matrix

    from vembed.data.corpus import load_corpus_split

    full, pruned = tmp_path / "full.json", tmp_path / "pruned.json"
    assert main(["eval", str(splade / "model"), str(splade / "corpus"), "--split", "dev", "--output", str(full)]) == 0
    assert main(["eval", str(splade / "model"), str(splade / "corpus"), "--split", "dev", "--output", str(pruned),
                 "--sparse-document-top-k", "5", "--sparse-query-top-k", "3"]) == 0
    assert "active dimensions per query" in capsys.readouterr().err
    adapter = vembed.load(str(splade / "model"), device="cpu").adapter
    documents = encode_sides(adapter, load_corpus_split(splade / "corpus", "dev").corpus.sides)
    csr = csr_matrix(documents.numpy())  # 36 documents: one block
    metrics, smaller = json.loads(full.read_text()), json.loads(pruned.read_text())
    assert metrics["index/bytes_csr"] == csr.data.nbytes + csr.indices.nbytes + csr.indptr.nbytes
    assert metrics["sparse/corpus_active_dims"] == pytest.approx(csr.nnz / len(documents))
    assert smaller["sparse/corpus_active_dims"] == 5 and smaller["sparse/query_active_dims"] == 3
    assert smaller["index/bytes_csr"] == 36 * 5 * 8 + 37 * 4


def test_vembed_mine_searches_the_index_and_its_cache_knows_the_pruning(splade, tmp_path, capsys):
    out = tmp_path / "negatives.jsonl"
    args = ["mine", str(splade / "model"), str(splade / "corpus"), "--out", str(out), "--range-min", "0",
            "--max-score-ratio", "none", "--num-negatives", "2"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "exact (scipy, dot product (inverted index))" in printed
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and all(len(row["negative_ids"]) == 2 for row in rows)
    assert all(row["positive_score"] > 0 for row in rows)
    assert main([*args, "--overwrite", "--sparse-document-top-k", "4"]) == 0
    assert "emptied: model or corpus changed" in capsys.readouterr().out  # pruned documents are other embeddings


@pytest.mark.parametrize("command, flag", [
    (["search", "{model}", "{corpus}", "--out", "{out}", "--index", "hnsw"], "--index"),
    (["search", "{model}", "{corpus}", "--out", "{out}", "--pool-factor", "2"], "--pool-factor"),
    (["mine", "{model}", "{corpus}", "--out", "{out}", "--faiss", "yes"], "--faiss"),
    (["eval", "{model}", "{corpus}", "--pool-factor", "2"], "--pool-factor"),
])
def test_a_dense_only_option_with_a_sparse_model_is_one_line_exit_2_nothing_written(splade, tmp_path, capsys,
                                                                                     command, flag):
    if flag == "--faiss":
        pytest.importorskip("faiss")
    if flag == "--index":
        pytest.importorskip("voyager")
    out = tmp_path / "out.trec"
    argv = [part.format(model=splade / "model", corpus=splade / "corpus", out=out) for part in command]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err and "sparse vectors" in err, err
    assert not out.exists() and not list(tmp_path.iterdir())


def test_sparse_pruning_flags_with_a_dense_model_or_bm25_are_refused(splade, tmp_path, capsys):
    pytest.importorskip("bm25s")
    out = tmp_path / "out.trec"
    assert main(["search", "bm25", str(splade / "corpus"), "--out", str(out), "--sparse-query-top-k", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--sparse-query-top-k" in err, err
    assert main(["search", str(splade / "model"), str(splade / "corpus"), "--out", str(out),
                 "--sparse-document-top-k", "0"]) == 2
    assert "--sparse-document-top-k" in capsys.readouterr().err
    assert not out.exists()
