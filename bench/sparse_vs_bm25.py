"""Learned sparse retrieval beside BM25 on the standard library's docstrings: nDCG@10 of BM25 (bm25s), of a tiny
random-init SPLADE and of the same SPLADE briefly trained by `vembed train`, and what the inverted index (CSR) costs
against the dense vocabulary-sized blocks sparse search used before it: search latency and index bytes.

    python bench/sparse_vs_bm25.py [--test-queries 250] [--train-queries 900] [--steps 150] [--smoke] [--out DIR]

The corpus is bench/rerank_pipeline_docstrings.py's (query: a docstring's summary; its one relevant document: the
rest of that docstring, titled with the qualified name). The SPLADE is a 2-layer BERT (hidden 64, MAX_LENGTH tokens)
with its masked-LM head over a word-level vocabulary of the corpus's VOCABULARY most frequent lower-cased words (the
units BM25 matches; no pretrained weights are downloaded here, so it starts random). Untrained, nearly every
vocabulary weight of a vector is positive (log1p(relu) of near-zero logits, max-pooled over its tokens): it is not
sparse, so it is searched pruned to its PRUNED_DOCUMENT / PRUNED_QUERY largest weights (`--sparse-document-top-k`,
`--sparse-query-top-k`), and its unpruned active dimensions are reported. The trained model (InfoNCE with FLOPS
regularisation on the train split's pairs, `--steps` steps) is searched unpruned and pruned the same way.

Latency is the search alone (vectors encoded once, one thread, the test queries against the whole corpus, best of
REPEATS): `sparse_index.sparse_top_k` over the CSR blocks against `scoring.top_k` (dot product) over dense float32
blocks of the same 1024 documents, which must give the same ranking (checked). Bytes: the CSR blocks' `nbytes` (what
`vembed eval` reports as index/bytes_csr) against documents x vocabulary x 4.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from outputs import output_dir  # noqa: E402
from rerank_pipeline_docstrings import SMOKE_MODULES, build_corpus, stdlib_modules  # noqa: E402

VOCABULARY = 2048  # words kept (most frequent first), besides BERT's five special tokens
MAX_LENGTH = 48  # tokens per side: a docstring's rest is ~80 words at the median; its start is kept
PRUNED_DOCUMENT, PRUNED_QUERY = 128, 32
REPEATS = 3
TINY_SPLADE = {"model_type": "bert", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 2, "max_position_embeddings": MAX_LENGTH}
# InfoNCE as sentence-transformers' SparseMultipleNegativesRankingLoss (dot products, scale 1) with FLOPS terms.
TRAINING = {"loss_type": "infonce", "temperature": 1.0, "symmetric_loss": False, "flops_query_weight": 1e-5,
            "flops_document_weight": 1e-5, "batch_size": 16, "learning_rate": 2e-3, "warmup_ratio": 0.05,
            "save_steps": None, "logging_steps": 50, "eval_before_training": False, "seed": 0}


def word_tokenizer(corpus: Path, folder: Path, size: int) -> str:
    """A BERT word-level tokenizer of the corpus's `size` most frequent lower-cased words (others: [UNK])."""
    from transformers import BertTokenizerFast

    counts: Counter[str] = Counter()
    for name in ("corpus.jsonl", "queries.jsonl"):
        for line in (corpus / name).read_text().splitlines():
            row = json.loads(line)
            counts.update(re.findall(r"\w+", f"{row.get('title', '')} {row['text']}".lower()))
    words = [word for word, _ in counts.most_common(size)]
    vocabulary = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
    BertTokenizerFast(vocab={w: i for i, w in enumerate(vocabulary)}).save_pretrained(folder)
    return str(folder)


def untrained_model(work: Path, tokenizer: str, vocabulary: int) -> str:
    import torch

    from vembed.components import recipe_from_dict
    from vembed.models import MODELS

    recipe = recipe_from_dict({"model_type": "text", "tokenizer_name": tokenizer, "embedding": "sparse",
                               "max_length": MAX_LENGTH, "model_config": {**TINY_SPLADE, "vocab_size": vocabulary}})
    torch.manual_seed(0)
    MODELS.get("text").from_recipe(recipe).save(work / "untrained")
    return str(work / "untrained")


def train(work: Path, corpus: Path, tokenizer: str, vocabulary: int, steps: int, batch_size: int
          ) -> tuple[str, float]:
    """`vembed train` on the corpus's train split (a subprocess, as a user runs it); (final/, wall seconds)."""
    import yaml

    recipe = {"model_type": "text", "tokenizer_name": tokenizer, "embedding": "sparse", "max_length": MAX_LENGTH,
              "model_config": {**TINY_SPLADE, "vocab_size": vocabulary}, **TRAINING, "max_steps": steps,
              "batch_size": batch_size,
              "data": {"train": str(corpus)}, "output_dir": str(work / "run")}
    (work / "splade.yaml").write_text(yaml.safe_dump(recipe))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
           "TOKENIZERS_PARALLELISM": "false"}
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "vembed", "train", str(work / "splade.yaml")], env=env,
                          capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"vembed train failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return str(work / "run" / "final"), time.perf_counter() - began


def encoded(model: str, split) -> dict[str, Any]:
    """The test queries and the corpus encoded once: dense queries, CSR document blocks (as search keeps them)."""
    import vembed
    from vembed.evaluation.corpus import judged_queries
    from vembed.models.encoding import encode_sides
    from vembed.retrieval.search import document_blocks

    adapter = vembed.load(model, device="cpu").adapter
    query_ids = judged_queries(split, None)
    queries = encode_sides(adapter, [split.queries.sides[split.queries.index[q]] for q in query_ids], batch_size=32)
    blocks = list(document_blocks(adapter, split.corpus.sides, batch_size=32))
    return {"query_ids": query_ids, "queries": queries, "blocks": blocks, "vocabulary": queries.shape[1]}


def pruned(vectors: dict[str, Any], query_k: int | None, document_k: int | None) -> dict[str, Any]:
    """The same vectors with each query's / document's largest weights only (what --sparse-*-top-k keep)."""
    import torch

    from vembed.models.splade import keep_top_k
    from vembed.retrieval.sparse_index import SparseVectors

    def prune(dense: torch.Tensor, k: int | None) -> torch.Tensor:
        return dense if k is None else keep_top_k(dense, k)

    blocks = [(offset, SparseVectors.from_dense(prune(torch.from_numpy(block.matrix.toarray()), document_k)))
              for offset, block in vectors["blocks"]]
    return {**vectors, "queries": prune(vectors["queries"], query_k), "blocks": blocks}


def measure(vectors: dict[str, Any], split, k: int = 100) -> dict[str, Any]:
    """nDCG@10 of the index's ranking, its latency against dense blocks' (same ranking, checked), and bytes."""
    import torch

    from vembed.evaluation.corpus import corpus_metrics
    from vembed.retrieval.scoring import top_k
    from vembed.retrieval.search import search
    from vembed.retrieval.sparse_index import SparseVectors, sparse_top_k

    dense_blocks = [(offset, torch.from_numpy(block.matrix.toarray())) for offset, block in vectors["blocks"]]
    queries = vectors["queries"]

    def by_index():
        return search(SparseVectors.from_dense(queries), vectors["blocks"], k, score_block=sparse_top_k)

    def by_dense_blocks():
        return search(queries, dense_blocks, k, score_block=top_k, normalize=False)

    (found, index_seconds), (dense, dense_seconds) = _timed(by_index), _timed(by_dense_blocks)
    if not torch.equal(found.indices, dense.indices):
        raise AssertionError("the inverted index ranked otherwise than dense blocks")
    documents = sum(len(block) for _, block in vectors["blocks"])
    nonzeros = sum(block.nonzeros for _, block in vectors["blocks"])
    metrics = corpus_metrics(found, {q: split.qrels[q] for q in vectors["query_ids"]},
                             query_ids=vectors["query_ids"], doc_ids=split.corpus.ids)
    return {"ndcg@10": metrics["ndcg@10"], "recall@100": metrics["recall@100"],
            "query_active_dims": int((queries != 0).sum()) / len(queries), "corpus_active_dims": nonzeros / documents,
            "index_bytes_csr": sum(block.nbytes for _, block in vectors["blocks"]),
            "index_bytes_dense": documents * vectors["vocabulary"] * 4,
            "search_seconds_csr": index_seconds, "search_seconds_dense_blocks": dense_seconds,
            "max_score_difference": float((found.scores - dense.scores)[found.indices >= 0].abs().max())}


def _timed(search_once) -> tuple[Any, float]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread for both: the machine is shared, and scipy's product uses one
    try:
        best, found = float("inf"), None
        for _ in range(REPEATS):
            began = time.perf_counter()
            found = search_once()
            best = min(best, time.perf_counter() - began)
    finally:
        torch.set_num_threads(threads)
    return found, best


def bm25(split) -> dict[str, Any]:
    from vembed.evaluation.corpus import corpus_metrics, judged_queries
    from vembed.retrieval.bm25 import bm25_run

    query_ids = judged_queries(split, None)
    began = time.perf_counter()
    run = bm25_run(split, query_ids, 100)
    seconds = time.perf_counter() - began
    metrics = corpus_metrics(run, {q: split.qrels[q] for q in query_ids})
    return {"ndcg@10": metrics["ndcg@10"], "recall@100": metrics["recall@100"], "index_and_search_seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--test-queries", type=int, default=250)
    parser.add_argument("--train-queries", type=int, default=900)
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps of `vembed train` (batch 16)")
    parser.add_argument("--smoke", action="store_true", help="a few modules, 3 training steps")
    parser.add_argument("--out", help="output folder (default: bench/results, or a temporary one with --smoke)")
    args = parser.parse_args(argv)
    try:
        import bm25s  # noqa: F401
    except ImportError:
        print("bm25s is not installed: pip install -e .[search]", file=sys.stderr)
        return 2
    from vembed.data.corpus import load_corpus_split

    out = output_dir(args.out, args.smoke)
    modules, test, train_queries, steps, vocabulary = ((SMOKE_MODULES, 8, 16, 3, 512) if args.smoke else
                                                       (stdlib_modules(), args.test_queries, args.train_queries,
                                                        args.steps, VOCABULARY))
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sparse-vs-bm25-") as work:
        work = Path(work)
        corpus = work / "corpus"
        counts = build_corpus(corpus, modules, test, train_queries)
        print(f"corpus: {counts}", flush=True)
        split = load_corpus_split(corpus, "test")
        tokenizer = word_tokenizer(corpus, work / "tokenizer", vocabulary)
        size = vocabulary + 5
        results: dict[str, Any] = {"corpus": counts, "vocabulary": size, "model": TINY_SPLADE,
                                   "training": {**TRAINING, "max_steps": steps}, "bm25": bm25(split)}
        print(f"BM25: {results['bm25']}", flush=True)
        untrained = encoded(untrained_model(work, tokenizer, size), split)
        results["untrained_unpruned_active_dims"] = {
            "query": int((untrained["queries"] != 0).sum()) / len(untrained["queries"]),
            "corpus": sum(b.nonzeros for _, b in untrained["blocks"]) / counts["documents"]}
        results["untrained_pruned"] = measure(pruned(untrained, PRUNED_QUERY, PRUNED_DOCUMENT), split)
        del untrained
        print(f"untrained SPLADE (pruned): {results['untrained_pruned']}", flush=True)
        batch = 8 if args.smoke else TRAINING["batch_size"]
        final, results["train_seconds"] = train(work, corpus, tokenizer, size, steps, batch)
        trained = encoded(final, split)
        results["trained"] = measure(trained, split)
        print(f"trained SPLADE: {results['trained']}", flush=True)
        results["trained_pruned"] = measure(pruned(trained, PRUNED_QUERY, PRUNED_DOCUMENT), split)
        print(f"trained SPLADE (pruned): {results['trained_pruned']}", flush=True)
    results["pruned_to"] = {"query": PRUNED_QUERY, "document": PRUNED_DOCUMENT}
    results["wall_seconds"] = time.perf_counter() - began
    results["python"] = sys.version.split()[0]
    (out / "sparse_vs_bm25.json").write_text(json.dumps(results, indent=2))
    print(f"wrote {out / 'sparse_vs_bm25.json'} in {results['wall_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
