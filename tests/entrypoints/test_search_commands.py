"""Runs as files: `vembed search` (embedder, ColBERT, BM25) writes the run brute-force scoring gives, `vembed rerank`
reorders it with the scores `load_reranker(...).score` / MaxSim give, `vembed fuse` equals ranx on the same runs, and
`vembed eval RUN_FILE` equals pytrec_eval; bad input is one line, exit 2, nothing written."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch
from corpora import make_corpus_folder, text_model_keys
from rerank_lists import TINY_BERT, write_first_stage_run

from vembed.cli import main

pytrec_eval = pytest.importorskip("pytrec_eval")


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_tokenizer_dir, mask_tokenizer_dir):
    """A tiny embedder, a tiny ColBERT and a tiny cross-encoder saved by vembed, and the corpus folder of
    tests/corpora.py."""
    from vembed.components import recipe_from_dict
    from vembed.models import MODELS
    from vembed.reranking import RERANKERS

    root = tmp_path_factory.mktemp("search_commands")
    torch.manual_seed(0)
    MODELS.get("text").from_recipe(recipe_from_dict(text_model_keys(tiny_tokenizer_dir))).save(root / "embedder")
    colbert = {**text_model_keys(mask_tokenizer_dir), "embedding": "multi_vector", "multi_vector_dim": 16,
               "query_length": 12, "max_length": 30, "loss_type": "late_interaction"}
    colbert["model_config"] = {**colbert["model_config"], "vocab_size": 512}
    MODELS.get("text").from_recipe(recipe_from_dict(colbert)).save(root / "colbert")
    recipe = recipe_from_dict({"model_type": "cross_encoder", "loss_type": "rerank_bce", "model_config": TINY_BERT,
                               "tokenizer_name": tiny_tokenizer_dir, "max_length": 32})
    RERANKERS.get("cross_encoder").from_recipe(recipe).save(root / "reranker")
    return root, make_corpus_folder(root / "corpus")


def _trec_lines(path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines()]


def _pytrec_means(qrels: dict, run: dict) -> dict[str, float]:
    """pytrec_eval's nDCG@10, recall@1/10/100 and MAP@100 over the queries with a relevant document."""
    judged = [q for q, grades in qrels.items() if any(g > 0 for g in grades.values())]
    found = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10", "recall.1,10,100", "map_cut.100"}).evaluate(run)
    names = {"ndcg@10": "ndcg_cut_10", "recall@1": "recall_1", "recall@10": "recall_10", "recall@100": "recall_100",
             "map@100": "map_cut_100"}
    return {ours: sum(found.get(q, {}).get(theirs, 0.0) for q in judged) / len(judged)
            for ours, theirs in names.items()}


def test_embedder_search_writes_the_brute_force_top_k_and_eval_of_the_file_equals_pytrec_eval(models, tmp_path,
                                                                                             capsys):
    from vembed.data.corpus import load_corpus_split
    from vembed.evaluation.runs import read_run
    from vembed.models.encoding import encode_sides
    from vembed.models.foreign import load_embedding_model

    root, corpus = models
    out = tmp_path / "dense.trec"
    assert main(["search", str(root / "embedder"), str(corpus), "--out", str(out), "--top-k", "5",
                 "--batch-size", "7"]) == 0
    assert "wrote" in capsys.readouterr().out
    split = load_corpus_split(corpus, "test")
    adapter = load_embedding_model(root / "embedder")
    queries = [q for q in split.queries.ids if any(g > 0 for g in split.qrels[q].values())]
    unit = [torch.nn.functional.normalize(encode_sides(adapter, sides).double(), dim=-1)
            for sides in ([split.queries.sides[split.queries.index[q]] for q in queries], split.corpus.sides)]
    scores = (unit[0] @ unit[1].T).float()
    lines = _trec_lines(out)
    assert len(lines) == 5 * len(queries) and {line[5] for line in lines} == {"embedder"}
    for row, query in enumerate(queries):
        mine = [line for line in lines if line[0] == query]
        assert [int(line[3]) for line in mine] == [1, 2, 3, 4, 5]
        order = scores[row].argsort(descending=True, stable=True)[:5]
        assert [line[2] for line in mine] == [split.corpus.ids[i] for i in order]  # identical top k
        assert [float(line[4]) for line in mine] == pytest.approx(scores[row, order].tolist(), abs=1e-6)

    metrics_file = tmp_path / "metrics.json"
    assert main(["eval", str(out), str(corpus), "--output", str(metrics_file)]) == 0
    metrics = json.loads(metrics_file.read_text())
    for name, value in _pytrec_means(split.qrels, read_run(out)).items():
        assert metrics[f"corpus/{name}"] == pytest.approx(value, abs=1e-6), name
    # JSONL: the same hits with their texts.
    rows = tmp_path / "dense.jsonl"
    assert main(["search", str(root / "embedder"), str(corpus), "--out", str(rows), "--top-k", "5"]) == 0
    hits = [json.loads(line) for line in rows.read_text().splitlines()]
    assert [(h["query_id"], h["doc_id"], h["rank"]) for h in hits] == [(t[0], t[2], int(t[3])) for t in lines]
    first = hits[0]
    assert first["query"] == split.queries.sides[split.queries.index[first["query_id"]]].text
    assert first["document"] == split.corpus.sides[split.corpus.index[first["doc_id"]]].text


def _bm25_by_hand(split, k1: float = 1.5, b: float = 0.75) -> dict[str, dict[str, float]]:
    """Lucene's BM25 over bm25s's tokens, every (query, document): idf = ln(1 + (N - df + 0.5) / (df + 0.5)) times
    tf / (tf + k1 (1 - b + b dl / avgdl)) (Lucene 8 dropped the constant factor k1 + 1, which orders nothing)."""
    import bm25s

    def tokens(texts):
        found = bm25s.tokenize(texts, stopwords="en", show_progress=False, return_ids=False)
        return [Counter(words) for words in found]

    documents = tokens([side.text for side in split.corpus.sides])
    average = sum(sum(d.values()) for d in documents) / len(documents)
    df = Counter(word for d in documents for word in d)
    run = {}
    for query, words in zip(split.queries.ids, tokens([side.text for side in split.queries.sides])):
        scores = {}
        for doc_id, counts in zip(split.corpus.ids, documents):
            length = sum(counts.values())
            score = sum(math.log(1 + (len(documents) - df[w] + 0.5) / (df[w] + 0.5))
                        * counts[w] / (counts[w] + k1 * (1 - b + b * length / average))
                        for w in words if counts[w])
            if score > 0:
                scores[doc_id] = score
        run[query] = scores
    return run


def test_bm25_search_equals_bm25_computed_by_hand(models, tmp_path):
    from vembed.data.corpus import load_corpus_split
    from vembed.evaluation.runs import read_run

    _, corpus = models
    out = tmp_path / "bm25.trec"
    assert main(["search", "bm25", str(corpus), "--split", "train", "--out", str(out), "--top-k", "7"]) == 0
    split = load_corpus_split(corpus, "train")
    expected = _bm25_by_hand(split)
    found = read_run(out)
    assert set(found) <= set(split.qrels)
    for query, hits in found.items():
        best = sorted(expected[query].items(), key=lambda item: -item[1])[:7]
        assert len(hits) == min(7, len(expected[query]))
        assert sorted(hits.values(), reverse=True) == pytest.approx([s for _, s in best], abs=1e-4)
        for doc, score in hits.items():  # each listed document's own score
            assert score == pytest.approx(expected[query][doc], abs=1e-4)
    assert {line[5] for line in _trec_lines(out)} == {"bm25"}


def test_colbert_search_and_rerank_score_by_maxsim(models, tmp_path, capsys):
    from vembed.data.corpus import load_corpus_split
    from vembed.evaluation.runs import read_run
    from vembed.models.foreign import load_embedding_model
    from vembed.models.maxsim import maxsim
    from vembed.retrieval.maxsim_search import STORED_DTYPE

    root, corpus = models
    out = tmp_path / "colbert.trec"
    assert main(["search", str(root / "colbert"), str(corpus), "--out", str(out), "--top-k", "6"]) == 0
    assert "MaxSim" in capsys.readouterr().out
    split = load_corpus_split(corpus, "test")
    adapter = load_embedding_model(root / "colbert").eval()
    with torch.no_grad():
        def vectors(side):
            encoded = adapter.encode(adapter.preprocess([side]))[0]
            return encoded[encoded.ne(0).any(dim=-1)]

        documents = [vectors(side).to(STORED_DTYPE).double() for side in split.corpus.sides]
        found = read_run(out)
        for query, hits in found.items():
            q = vectors(split.queries.sides[split.queries.index[query]]).double()[None]
            scores = torch.tensor([maxsim(q, d[None])[0, 0].item() for d in documents])
            order = scores.argsort(descending=True, stable=True)[:6]
            assert list(hits) == [split.corpus.ids[i] for i in order]
            assert list(hits.values()) == pytest.approx(scores[order].tolist(), abs=1e-4)

    # The same model reorders a poor first stage by MaxSim: the order its own search gives those candidates.
    first = write_first_stage_run(split, tmp_path / "first.trec")
    reranked = tmp_path / "reranked.trec"
    assert main(["rerank", str(root / "colbert"), str(corpus), "--run", str(first), "--out", str(reranked),
                 "--top-k", "12"]) == 0
    wide = tmp_path / "wide.trec"
    assert main(["search", str(root / "colbert"), str(corpus), "--out", str(wide), "--top-k", "36"]) == 0
    whole, again = read_run(wide), read_run(reranked)
    for query, hits in again.items():
        assert set(hits) == set(read_run(first)[query])  # the same candidates
        for doc, score in hits.items():
            assert score == pytest.approx(whole[query][doc], abs=1e-5)


def test_colbert_search_through_an_hnsw_index_covering_the_corpus_writes_the_exact_run(models, tmp_path, capsys):
    root, corpus = models
    for pool in ([], ["--pool-factor", "2"]):
        exact, approximate = tmp_path / "exact.trec", tmp_path / "hnsw.trec"
        common = [str(root / "colbert"), str(corpus), "--top-k", "6", "--overwrite", *pool]
        assert main(["search", *common, "--out", str(exact)]) == 0
        assert main(["search", *common, "--out", str(approximate), "--index", "hnsw", "--candidates-per-token",
                     "1000", "--hnsw-ef-search", "1000"]) == 0
        assert "hnsw candidates" in capsys.readouterr().out
        assert approximate.read_text() == exact.read_text(), pool  # the same documents, order and scores


def test_colbert_search_through_a_small_hnsw_index_misses_documents_but_scores_each_exactly(models, tmp_path):
    from vembed.evaluation.runs import read_run

    root, corpus = models
    whole, approximate = tmp_path / "whole.trec", tmp_path / "hnsw.trec"
    assert main(["search", str(root / "colbert"), str(corpus), "--out", str(whole), "--top-k", "36"]) == 0
    assert main(["search", str(root / "colbert"), str(corpus), "--out", str(approximate), "--top-k", "6",
                 "--index", "hnsw", "--candidates-per-token", "1", "--hnsw-m", "2", "--hnsw-ef-construction", "2",
                 "--hnsw-ef-search", "1"]) == 0
    exact, found = read_run(whole), read_run(approximate)
    kept = sum(len(set(hits) & set(list(exact[query])[:6])) for query, hits in found.items())
    assert kept < 6 * len(found)  # some of the exact top 6 were missed
    for query, hits in found.items():
        assert hits and all(score == pytest.approx(exact[query][doc], abs=1e-6) for doc, score in hits.items())


def test_search_without_voyager_is_one_line_before_any_work(models, tmp_path, capsys, monkeypatch):
    import importlib.util

    root, corpus = models
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "voyager" else real(name, *a))
    out = tmp_path / "run.trec"
    assert main(["search", str(root / "colbert"), str(corpus), "--out", str(out), "--index", "hnsw"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "environment error: --index: an approximate MaxSim index (--index hnsw) needs voyager, which is not "
        "installed: pip install 'vembed[search]'"]
    assert not out.exists()


def test_rerank_writes_the_reranker_scores_and_metrics_equal_pytrec_eval_on_the_file(models, tmp_path, capsys):
    from vembed.data.corpus import load_corpus_split
    from vembed.evaluation.runs import read_run
    from vembed.reranking import load_reranker
    from vembed.reranking.pairs import pair_document

    root, corpus = models
    split = load_corpus_split(corpus, "test")
    first = write_first_stage_run(split, tmp_path / "first.trec")
    out = tmp_path / "reranked.trec"
    assert main(["rerank", str(root / "reranker"), str(corpus), "--run", str(first), "--out", str(out),
                 "--top-k", "10", "--batch-size", "3"]) == 0
    printed = capsys.readouterr().out
    reranked = read_run(out)
    reranker = load_reranker(root / "reranker")
    for query, hits in reranked.items():
        assert len(hits) == 10
        text = split.queries.sides[split.queries.index[query]].text
        documents = [pair_document(split.corpus.sides[split.corpus.index[d]]) for d in hits]
        expected = reranker.score([text] * len(documents), documents).tolist()
        assert list(hits.values()) == pytest.approx(expected, abs=1e-6)
    lines = _trec_lines(out)
    by_query = [float(line[4]) for line in lines if line[0] == lines[0][0]]
    assert by_query == sorted(by_query, reverse=True)  # the rank column follows the scores
    # The printed reranked nDCG@10 is pytrec_eval's on the written file.
    ndcg = next(line for line in printed.splitlines() if line.startswith("ndcg@10")).split()
    assert float(ndcg[2]) == pytest.approx(_pytrec_means(split.qrels, reranked)["ndcg@10"], abs=1e-4)
    metrics_file = tmp_path / "metrics.json"
    assert main(["eval", str(out), str(corpus), "--output", str(metrics_file)]) == 0
    assert json.loads(metrics_file.read_text())["corpus/ndcg@10"] == pytest.approx(
        _pytrec_means(split.qrels, reranked)["ndcg@10"], abs=1e-6)


def test_fuse_equals_ranx_on_the_same_files(models, tmp_path):
    from ranx import Run, fuse

    from vembed.evaluation.runs import read_run

    root, corpus = models
    dense, lexical = tmp_path / "dense.trec", tmp_path / "bm25.trec"
    assert main(["search", str(root / "embedder"), str(corpus), "--out", str(dense), "--top-k", "10"]) == 0
    assert main(["search", "bm25", str(corpus), "--out", str(lexical), "--top-k", "10"]) == 0
    theirs_in = [Run.from_file(str(path), kind="trec").to_dict() for path in (dense, lexical)]
    queries = sorted(set(theirs_in[0]) | set(theirs_in[1]))  # BM25 lists no query that shares no word
    filled = [Run({q: dict(run.get(q, {})) for q in queries}) for run in theirs_in]
    for method, extra, ranx_method, params in (("rrf", [], "rrf", {"k": 60}),
                                              ("weighted", ["--weights", "0.7", "0.3"], "wsum",
                                               {"weights": [0.7, 0.3]})):
        out = tmp_path / f"{method}.trec"
        assert main(["fuse", str(dense), str(lexical), "--out", str(out), "--method", method, *extra,
                     "--corpus", str(corpus)]) == 0
        theirs = fuse(filled, norm="min-max", method=ranx_method, params=params).to_dict()
        ours = read_run(out)
        assert ours.keys() == {q for q in theirs if theirs[q]}, method
        for query in ours:
            assert ours[query] == pytest.approx(theirs[query], abs=1e-9), (method, query)


def test_rrf_of_two_small_runs_by_hand(tmp_path):
    from vembed.evaluation.runs import read_run

    first, second, out = tmp_path / "a.trec", tmp_path / "b.trec", tmp_path / "fused.trec"
    first.write_text("q Q0 d1 1 3.0 a\nq Q0 d2 2 2.0 a\nq Q0 d3 3 1.0 a\nr Q0 d1 1 1.0 a\n")
    second.write_text("q Q0 d3 1 5.0 b\nq Q0 d4 2 4.0 b\n")
    assert main(["fuse", str(first), str(second), "--out", str(out), "--top-k", "3"]) == 0
    fused = read_run(out)
    assert fused["q"] == pytest.approx({"d3": 1 / 63 + 1 / 61, "d1": 1 / 61, "d4": 1 / 62}, abs=1e-12)
    assert fused["r"] == pytest.approx({"d1": 1 / 61}, abs=1e-12)  # a query only one run holds
    assert [line.split()[2] for line in out.read_text().splitlines()[:3]] == ["d3", "d1", "d4"]


def test_the_python_api_searches_and_ranks_as_the_commands_do(models, tmp_path):
    import vembed
    from vembed.api import Embedder, Reranker
    from vembed.data.corpus import load_corpus_split
    from vembed.evaluation.runs import read_run
    from vembed.retrieval.token_index import HnswSettings

    root, corpus = models
    split = load_corpus_split(corpus, "test")
    queries = [q for q in split.queries.ids if any(g > 0 for g in split.qrels[q].values())]
    texts = [split.queries.sides[split.queries.index[q]].text for q in queries]
    documents = [side.text for side in split.corpus.sides]
    for name in ("embedder", "colbert"):
        run_file = tmp_path / f"{name}.trec"
        assert main(["search", str(root / name), str(corpus), "--out", str(run_file), "--top-k", "4"]) == 0
        model = vembed.load(str(root / name), device="cpu")
        assert type(model) is Embedder
        found = model.search(texts, documents, top_k=4)
        run = read_run(run_file)
        for query, hits in zip(queries, found):
            assert [split.corpus.ids[hit["corpus_id"]] for hit in hits] == list(run[query]), name
            assert [hit["score"] for hit in hits] == pytest.approx(list(run[query].values()), abs=1e-5), name
        if name == "colbert":  # an index whose candidates cover the corpus finds what exact search finds
            covering = HnswSettings(candidates_per_token=1000, ef_search=1000)
            assert model.search(texts, documents, top_k=4, index=covering) == found
            assert model.search(texts, documents, top_k=4, index="hnsw") == found  # the defaults cover 36 documents
            small = model.search(texts, documents, top_k=4, index=HnswSettings(candidates_per_token=1, m=2,
                                                                               ef_construction=2, ef_search=1))
            assert small != found  # an approximation: some of the exact top 4 missed
            every = model.search(texts, documents, top_k=36)
            assert all(hit in whole for hits, whole in zip(small, every) for hit in hits)  # each with its exact score
            # A model saved with document_pool_factor searches its pooled documents, as `vembed search` does.
            pooled_file = tmp_path / "pooled.trec"
            assert main(["search", str(root / name), str(corpus), "--out", str(pooled_file), "--top-k", "4",
                         "--pool-factor", "2"]) == 0
            model.adapter.settings.document_pool_factor = 2
            pooled, pooled_run = model.search(texts, documents, top_k=4), read_run(pooled_file)
            assert pooled != found
            for query, hits in zip(queries, pooled):
                assert [split.corpus.ids[hit["corpus_id"]] for hit in hits] == list(pooled_run[query])
                assert [hit["score"] for hit in hits] == pytest.approx(list(pooled_run[query].values()), abs=1e-5)
        else:
            with pytest.raises(ValueError, match="index='hnsw' indexes token vectors; this text model gives one"):
                model.search(texts, documents, index="hnsw")

    first = write_first_stage_run(split, tmp_path / "first.trec")
    out = tmp_path / "reranked.trec"
    assert main(["rerank", str(root / "reranker"), str(corpus), "--run", str(first), "--out", str(out)]) == 0
    reranker = vembed.load(str(root / "reranker"), device="cpu")
    assert isinstance(reranker, Reranker)
    reranked = read_run(out)
    for query, hits in reranked.items():
        candidates = list(read_run(first)[query])
        text = split.queries.sides[split.queries.index[query]].text
        ranked = reranker.rank(text, [split.corpus.sides[split.corpus.index[d]].text for d in candidates],
                               return_documents=True)
        assert [candidates[r["corpus_id"]] for r in ranked] == list(hits)  # the command's order
        assert [r["score"] for r in ranked] == pytest.approx(list(hits.values()), abs=1e-6)
        assert ranked[0]["text"] == split.corpus.sides[split.corpus.index[list(hits)[0]]].text
    assert len(reranker.rank("a red square", documents[:5], top_k=2)) == 2


@pytest.mark.parametrize("case, label", [
    ("not-trec", "row 2: is not a TREC run line"),
    ("unknown-document", "document 'nowhere' (query"),
    ("top-k-zero", "--top-k: must be at least 1"),
    ("embedder-reranks", "is an embedding model (one vector per text)"),
    ("reranker-searches", "reranker: it scores (query, document) pairs"),
    ("out-exists", "exists; pass --overwrite"),
    ("fuse-one-run", "fusion needs at least 2 runs"),
    ("fuse-weights", "one weight per run"),
    ("eval-run-with-model-flag", "--pool-factor: applies to a model"),
    ("fuse-jsonl-without-corpus", "--format: jsonl rows carry the texts"),
    ("index-on-dense", "--index: hnsw indexes a late-interaction model's token vectors; this model gives one"),
    ("index-on-bm25", "--index: indexes a late-interaction model's token vectors, not bm25's words"),
    ("index-knob-without-index", "--hnsw-ef-search: tunes --index hnsw; add --index hnsw or remove it"),
    ("index-knob-zero", "--candidates-per-token: must be at least 1, got 0"),
    ("index-one-link", "--hnsw-m: must be a whole number of at least 2, got 1"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_written(models, tmp_path, capsys, case, label):
    root, corpus = models
    good = tmp_path / "good.trec"
    good.write_text("q2 Q0 d2 1 2.0 x\n")
    bad = tmp_path / "bad.trec"
    bad.write_text("q2 Q0 d2 1 2.0 x\nq2 Q0 d3 2 high x\n")
    unknown = tmp_path / "unknown.trec"
    unknown.write_text("q2 Q0 d2 1 2.0 x\nq2 Q0 nowhere 2 1.0 x\n")
    out = tmp_path / "out.trec"
    if case == "out-exists":
        out.write_text("precious\n")
    reranker, embedder = str(root / "reranker"), str(root / "embedder")
    argv = {
        "not-trec": ["rerank", reranker, str(corpus), "--run", str(bad), "--out", str(out)],
        "unknown-document": ["rerank", reranker, str(corpus), "--run", str(unknown), "--out", str(out)],
        "top-k-zero": ["search", embedder, str(corpus), "--out", str(out), "--top-k", "0"],
        "embedder-reranks": ["rerank", embedder, str(corpus), "--run", str(good), "--out", str(out)],
        "reranker-searches": ["search", reranker, str(corpus), "--out", str(out)],
        "out-exists": ["search", "bm25", str(corpus), "--out", str(out)],
        "fuse-one-run": ["fuse", str(good), "--out", str(out)],
        "fuse-weights": ["fuse", str(good), str(good), "--method", "weighted", "--weights", "1", "--out", str(out)],
        "eval-run-with-model-flag": ["eval", str(good), str(corpus), "--pool-factor", "2"],
        "fuse-jsonl-without-corpus": ["fuse", str(good), str(bad), "--out", str(tmp_path / "fused.jsonl")],
        "index-on-dense": ["search", embedder, str(corpus), "--out", str(out), "--index", "hnsw"],
        "index-on-bm25": ["search", "bm25", str(corpus), "--out", str(out), "--index", "hnsw"],
        "index-knob-without-index": ["search", str(root / "colbert"), str(corpus), "--out", str(out),
                                     "--hnsw_ef_search", "5"],
        "index-knob-zero": ["search", str(root / "colbert"), str(corpus), "--out", str(out), "--index", "hnsw",
                            "--candidates-per-token", "0"],
        "index-one-link": ["search", str(root / "colbert"), str(corpus), "--out", str(out), "--index", "hnsw",
                           "--hnsw-m", "1"],
    }[case]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and label in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    if case == "out-exists":
        assert out.read_text() == "precious\n"


def test_a_reranker_trained_from_a_corpus_folder_with_no_file_written_by_hand(models, tmp_path, tiny_tokenizer_dir):
    """search (BM25) -> mine (the embedder) -> train the reranker -> rerank -> eval the run: every file a command's,
    and the reranked run's figures are pytrec_eval's on the written file."""
    import argparse

    import yaml

    from vembed.data.corpus import load_corpus_split
    from vembed.entrypoints.train import run as train
    from vembed.evaluation.runs import read_run

    root, corpus = models
    dev, negatives = tmp_path / "first_stage_dev.trec", tmp_path / "negatives.jsonl"
    assert main(["search", "bm25", str(corpus), "--split", "dev", "--out", str(dev)]) == 0
    assert main(["mine", str(root / "embedder"), str(corpus), "--split", "train", "--out", str(negatives),
                 "--num-negatives", "3", "--range-min", "0", "--max-score-ratio", "none", "--no-cache"]) == 0
    recipe = {"model_type": "cross_encoder", "loss_type": "rerank_bce", "model_config": TINY_BERT,
              "tokenizer_name": tiny_tokenizer_dir, "max_length": 32,
              "data": {"train": str(corpus), "hard_negatives": str(negatives), "num_hard_negatives": 3,
                       "validation": str(corpus), "qrels_splits": {"validation": "dev"},
                       "first_stage_run": str(dev)},
              "output_dir": str(tmp_path / "reranker"), "batch_size": 4, "learning_rate": 1e-3, "max_steps": 4,
              "logging_steps": 1, "save_steps": 100, "seed": 0, "eval_before_training": False}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert train(argparse.Namespace(recipe=str(tmp_path / "recipe.yaml"), config_override=[], debug=False)) == 0
    test_run, reranked = tmp_path / "first_stage_test.trec", tmp_path / "reranked_test.trec"
    assert main(["search", "bm25", str(corpus), "--split", "test", "--out", str(test_run)]) == 0
    assert main(["rerank", str(tmp_path / "reranker" / "final"), str(corpus), "--run", str(test_run),
                 "--out", str(reranked), "--top-k", "20"]) == 0
    metrics_file = tmp_path / "metrics.json"
    assert main(["eval", str(reranked), str(corpus), "--split", "test", "--output", str(metrics_file)]) == 0
    split = load_corpus_split(corpus, "test")
    metrics = json.loads(metrics_file.read_text())
    for name, value in _pytrec_means(split.qrels, read_run(reranked)).items():
        assert metrics[f"corpus/{name}"] == pytest.approx(value, abs=1e-6), name
    assert set(read_run(reranked)) == {q for q in read_run(test_run) if q in split.qrels}
