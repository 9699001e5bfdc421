"""Hard negatives for training: `vembed mine MODEL_DIR CORPUS_FOLDER --split train --out negatives.jsonl`.

Encodes the corpus with a saved model (each process its share under `accelerate launch`; block embeddings cached in
--cache-dir so a killed job resumes), takes each query's nearest documents, skips its judged positives, keeps ranks
--range-min..--range-max below --max-score-ratio x the positive's score, and writes one JSONL row per (query,
positive) with ids and texts. The work is `vembed.retrieval.mining`; this module parses, checks and reports.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vembed.retrieval.mining import FILTER_ORDERS, SAMPLING, MiningSettings

DEFAULTS = MiningSettings()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from vembed.entrypoints.search import add_sparse_arguments

    parser.add_argument("model_dir", help="a model folder saved by vembed (e.g. runs/x/final), by "
                                          "sentence-transformers or by transformers, or a hub id")
    parser.add_argument("corpus", help="a corpus folder (corpus.jsonl, queries.jsonl, qrels/<split>.tsv)")
    parser.add_argument("--split", default="train", help="the qrels split whose queries are mined (default: train)")
    parser.add_argument("--out", required=True, help="the JSONL training file to write")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    parser.add_argument("--range-min", "--range_min", type=int, default=DEFAULTS.range_min,
                        help="skip this many closest non-relevant documents (likely unjudged positives; "
                             f"default {DEFAULTS.range_min})")
    parser.add_argument("--range-max", "--range_max", type=int, default=DEFAULTS.range_max,
                        help=f"look no further than this rank among non-relevant documents (default "
                             f"{DEFAULTS.range_max})")
    parser.add_argument("--max-score-ratio", "--max_score_ratio", type=_ratio, default=DEFAULTS.max_score_ratio,
                        help="drop candidates scoring above this fraction of the query's lowest positive score "
                             f"(NV-Retriever's TopK-PercPos; default {DEFAULTS.max_score_ratio}); none: no threshold "
                             "(only for corpora whose judgements are complete)")
    parser.add_argument("--num-negatives", "--num_negatives", type=int, default=DEFAULTS.num_negatives,
                        help=f"negatives per row; queries with fewer left are left out (default "
                             f"{DEFAULTS.num_negatives})")
    parser.add_argument("--filter-order", "--filter_order", choices=FILTER_ORDERS, default=DEFAULTS.filter_order,
                        help="window-first: the rank window over all non-relevant candidates, then the threshold "
                             "inside it; threshold-first: the threshold first, ranks counted among the candidates it "
                             "keeps (sentence-transformers' mine_hard_negatives with relative_margin; default "
                             f"{DEFAULTS.filter_order})")
    parser.add_argument("--sampling", choices=SAMPLING, default=DEFAULTS.sampling,
                        help="top: the closest kept candidates; random: a seeded sample of them")
    parser.add_argument("--seed", type=int, default=DEFAULTS.seed, help="--sampling random: the sample's seed")
    parser.add_argument("--batch-size", "--batch_size", type=int, default=64, help="texts encoded at once (default 64)")
    parser.add_argument("--cache-dir", "--cache_dir",
                        help="where block embeddings are kept for resuming and reuse (default: OUT.cache/; emptied "
                             "when the model or corpus changes)")
    parser.add_argument("--no-cache", "--no_cache", action="store_true", help="keep no embeddings on disk")
    parser.add_argument("--documents-per-block", "--documents_per_block", type=int, default=None,
                        help="documents each process encodes per block (one cache file each)")
    parser.add_argument("--faiss", choices=["auto", "yes", "no"], default="auto",
                        help="score blocks with faiss's flat index (exact; pip install faiss-cpu) or torch; "
                             "auto: faiss when installed")
    parser.add_argument("--pool-factor", "--pool_factor", type=int, default=None,
                        help="multi_vector models: pool each document's token vectors about this many to one "
                             "(hierarchical clustering; default: the model's document_pool_factor, 1 = none)")
    add_sparse_arguments(parser)
    parser.add_argument("--image-root", "--image_root", help="directory relative image paths are resolved against")
    parser.add_argument("--trust-remote-code", "--trust_remote_code", action="store_true",
                        help="let the model folder run Python code it ships (only for folders you trust)")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error instead of one line")


def _ratio(text: str) -> float | None:
    """A number, or none/off: no threshold. Range checks are MiningSettings.check's (one line, exit 2)."""
    if text.strip().lower() in ("none", "off"):
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a number nor none") from None


def settings_of(args: argparse.Namespace) -> MiningSettings:
    return MiningSettings(range_min=args.range_min, range_max=args.range_max, max_score_ratio=args.max_score_ratio,
                          num_negatives=args.num_negatives, sampling=args.sampling, seed=args.seed,
                          filter_order=args.filter_order)


def run(args: argparse.Namespace) -> int:
    from vembed.entrypoints import quiet_libraries, require_at_least_one, run_cli

    def body() -> int:
        import os

        import torch
        from accelerate import Accelerator

        from vembed.data.corpus import CORPUS_FILE, load_corpus_split
        from vembed.entrypoints.search import sparse_pruning
        from vembed.errors import RecipeError
        from vembed.files import check_replaceable
        from vembed.models.foreign import load_embedding_model, require_embedder
        from vembed.retrieval.cache import EmbeddingCache, cache_key, check_cache_folder
        from vembed.retrieval.maxsim_search import pool_factor_key, pool_factor_of, set_pool_factor
        from vembed.retrieval.mining import faiss_available, mine_hard_negatives, write_jsonl_atomic
        from vembed.retrieval.search import scoring_of
        from vembed.retrieval.sparse_index import sparse_index_key

        settings = settings_of(args)
        settings.check()
        require_at_least_one(batch_size=args.batch_size, documents_per_block=args.documents_per_block,
                             sparse_query_top_k=args.sparse_query_top_k,
                             sparse_document_top_k=args.sparse_document_top_k)
        out = Path(args.out)
        if out.is_dir():
            raise RecipeError("--out", f"{out} is a folder; name the JSONL file to write")
        check_replaceable(out, args.overwrite)
        model_dir = require_embedder(args.model_dir, instead="mine with the embedder, then train the reranker on "
                                                            "what mine writes (data.hard_negatives)")
        if args.faiss == "yes" and not faiss_available():
            raise RecipeError("--faiss", "faiss is not installed: pip install faiss-cpu (or pass --faiss no)")
        if not args.no_cache:
            check_cache_folder(args.cache_dir or f"{out}.cache")
        split = load_corpus_split(args.corpus, args.split, image_root=args.image_root, key="--split")
        quiet_libraries()
        on_cpu = not torch.cuda.is_available() or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true")
        accelerator = Accelerator(cpu=on_cpu)
        _check_world_size(accelerator.num_processes)
        adapter = load_embedding_model(model_dir, trust_remote_code=args.trust_remote_code).to(accelerator.device)
        scoring = scoring_of(adapter)
        if args.faiss == "yes" and not scoring.faiss:  # before the cache folder is made: nothing written
            raise RecipeError("--faiss", f"{model_dir} gives {scoring.vectors}, scored exactly by {scoring.name}; "
                                         "faiss's flat index scores one vector per document: pass --faiss no")
        use_faiss = args.faiss == "yes" or (args.faiss == "auto" and faiss_available() and scoring.faiss)
        set_pool_factor(adapter, args.pool_factor)
        sparse_pruning(adapter, args)
        cache = None
        if not args.no_cache:
            folder = args.cache_dir or f"{out}.cache"
            key = cache_key(model_dir, Path(args.corpus) / CORPUS_FILE, image_root=args.image_root,
                            **pool_factor_key(adapter), **sparse_index_key(adapter))
            cache = EmbeddingCache(folder, key).open(accelerator)
        rows, stats = mine_hard_negatives(
            adapter, split, settings, batch_size=args.batch_size, accelerator=accelerator, cache=cache,
            use_faiss=use_faiss, documents_per_block=args.documents_per_block,
            show_progress=True)
        if accelerator.is_main_process:
            write_jsonl_atomic(out, rows)
            dropped = (f"{stats.dropped_by_threshold} of {stats.candidates} candidates in ranks "
                       f"{settings.range_min}-{settings.range_max}" if settings.filter_order == "window-first" else
                       f"{stats.dropped_by_threshold} of {stats.candidates} candidates before ranks "
                       f"{settings.range_min}-{settings.range_max} were counted (threshold-first)")
            where = (f"; cache {cache.folder}: {stats.blocks_encoded} block(s) encoded, {stats.blocks_reused} reused"
                     f"{' (emptied: model or corpus changed)' if cache.invalidated else ''}" if cache else "")
            rule = (f"the threshold ({settings.max_score_ratio} x the lowest positive's score) dropped {dropped}"
                    if settings.max_score_ratio is not None else f"no score threshold ({stats.candidates} candidates)")
            print(f"{out}: {len(rows)} rows from {stats.mined} of {stats.queries} queries, {settings.num_negatives} "
                  f"negatives each; {rule}; {stats.too_few} queries had fewer than {settings.num_negatives} "
                  f"negatives left and were left out; search: "
                  f"{'faiss' if use_faiss else _exact_search(scoring)}{where}; "
                  f"{accelerator.num_processes} process(es)")
            if "index" in stats.extra:  # token vectors: the size --pool-factor promises to shrink
                print(stats.extra["index"].describe(pool_factor_of(adapter)))
        accelerator.wait_for_everyone()
        accelerator.end_training()  # tears the process group down together (gloo can abort otherwise)
        return 0

    return run_cli(body, args.debug)


def _exact_search(scoring) -> str:
    """How blocks were scored without faiss: torch's cosine or MaxSim, or scipy's sparse product over the index."""
    from vembed.retrieval.sparse_index import SparseVectors

    if scoring.stored is SparseVectors:
        return f"exact (scipy, {scoring.name})"
    return "exact (torch)" if scoring.faiss else f"exact (torch, {scoring.name})"


def _check_world_size(started: int) -> None:
    """The launcher's promised process count is the one running (`accelerate launch --cpu --num_processes 2`
    starts one process without a word: mining would run, slower, and the user would believe it used two)."""
    from vembed.errors import LaunchError
    from vembed.training.launch_promise import read_promise

    promise = read_promise()
    if promise.num_processes is not None and promise.num_processes != started:
        raise LaunchError(f"{promise.command} promised {promise.num_processes} processes ({promise.source}) but "
                          f"{started} started; on CPU drop --cpu and launch with a multi-process config "
                          "(accelerate_configs/ddp_cpu.yaml)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vembed mine", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
