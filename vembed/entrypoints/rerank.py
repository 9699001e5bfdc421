"""Reorder a first stage's candidates and write the result as a run: `vembed rerank RERANKER_DIR CORPUS_FOLDER
--run run.trec --out reranked.trec [--top-k 100] [--split test]`.

RERANKER_DIR is a reranker saved by vembed (a cross-encoder, the Qwen-VL reranker), which scores each (query,
candidate) pair, or a late-interaction model (ColBERT, ColQwen), which scores them by MaxSim (PyLate's
`rank.rerank`). The run is any TREC run file: `vembed search`'s, BM25's, `vembed fuse`'s or another tool's. Each
judged query of the split keeps its top k candidates, reordered; the command prints the split's metrics before and
after (nDCG@10, MRR@10, recall@1/10/k, MAP@k, as `vembed eval --first-stage` reports them).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vembed.entrypoints.search import (
    DEFAULT_TOP_K,
    add_run_output_arguments,
    check_run_output,
    default_tag,
    output_format,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", metavar="RERANKER_DIR",
                        help="a reranker saved by vembed (e.g. runs/reranker/final) or a late-interaction model "
                             "(ColBERT, ColQwen) that scores the candidates by MaxSim")
    parser.add_argument("corpus", help="the corpus folder the run was made on (corpus.jsonl, queries.jsonl, "
                                       "qrels/<split>.tsv)")
    parser.add_argument("--run", required=True, help="the first stage's TREC run file (e.g. from vembed search)")
    add_run_output_arguments(parser, default_split="test")
    parser.add_argument("--top-k", "--top_k", type=int, default=DEFAULT_TOP_K,
                        help=f"candidates per query reordered; the rest are not kept (default {DEFAULT_TOP_K})")
    parser.add_argument("--batch-size", "--batch_size", type=int, default=64, help="pairs (or texts) scored at once")
    parser.add_argument("--image-root", "--image_root", help="folder relative image paths are resolved against")
    parser.add_argument("--trust-remote-code", "--trust_remote_code", action="store_true",
                        help="let the model folder run Python code it ships (only for folders you trust)")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error instead of one line")


def run(args: argparse.Namespace) -> int:
    from vembed.entrypoints import require_at_least_one, run_cli

    def body() -> int:
        from vembed.data.corpus import CorpusSource
        from vembed.errors import ArgumentError
        from vembed.evaluation.runs import check_documents_in_corpus, read_run
        from vembed.models.foreign import model_folder, require_embedder
        from vembed.reranking import saved_reranker_type

        require_at_least_one(top_k=args.top_k, batch_size=args.batch_size)
        check_run_output(args)
        if not Path(args.run).is_file():
            raise ArgumentError("--run", f"{args.run} is not a file; give the first stage's TREC run file (vembed "
                                       "search MODEL CORPUS --out run.trec writes one)")
        if Path(args.run).resolve() == Path(args.out).resolve():
            raise ArgumentError("--out", f"{args.out} is the --run being reordered; write the reranked run elsewhere")
        source = CorpusSource(None, args.corpus, args.split, args.image_root, "--split")
        source.check()
        model_dir = model_folder(args.model_dir)
        if not saved_reranker_type(model_dir):  # then it reorders by MaxSim, as an embedder: a foreign reranker is not
            require_embedder(model_dir, instead="vembed rerank reorders with a reranker vembed saved or a "
                                                "late-interaction model; to rerank with this one, fine-tune it with a "
                                                "cross_encoder recipe (model_name: this folder)")
        first_stage = read_run(args.run)
        split = source.load()
        check_documents_in_corpus(first_stage, split, args.run)
        score = _scorer(model_dir, args)
        return _rerank(args, score, split, first_stage)

    return run_cli(body, args.debug)


def _scorer(model_dir: Path, args: argparse.Namespace):
    """The model's pair scorer: a reranker's logits, or a late-interaction model's MaxSim. A one-vector embedder
    is refused: it ranks by the same cosine search already did."""
    from vembed.entrypoints import quiet_libraries
    from vembed.errors import ArgumentError
    from vembed.models.foreign import load_embedding_model
    from vembed.reranking import load_reranker, saved_reranker_type
    from vembed.retrieval.maxsim_search import MULTI_VECTOR, maxsim_pair_scorer

    quiet_libraries()
    if saved_reranker_type(model_dir):
        reranker = load_reranker(model_dir, trust_remote_code=args.trust_remote_code)
        return lambda queries, documents: reranker.score(queries, documents, batch_size=args.batch_size)
    adapter = load_embedding_model(model_dir, trust_remote_code=args.trust_remote_code)
    if adapter.embedding_kind != MULTI_VECTOR:  # one vector per text (dense or sparse): no token vectors
        raise ArgumentError("model_dir", f"{model_dir} is an embedding model (one vector per text): it cannot reorder "
                                       "candidates beyond what its own search found; search with it (vembed search "
                                       f"{args.model_dir} CORPUS --out run.trec), and rerank with a reranker or a "
                                       "late-interaction model")
    return maxsim_pair_scorer(adapter, batch_size=args.batch_size)


def _rerank(args: argparse.Namespace, score, split, first_stage) -> int:
    from vembed.errors import DataError
    from vembed.evaluation.corpus import corpus_metrics
    from vembed.evaluation.runs import write_run
    from vembed.reranking.evaluation import cutoffs_for, metrics_table, rerank

    judged = [query for query in first_stage if query in split.qrels]
    if not judged:
        raise DataError(f"none of its {len(first_stage)} queries is judged in qrels/{args.split}.tsv of {args.corpus};"
                        " was it made on another split (--split)?", args.run)
    before, after = rerank(score, split, first_stage, depth=args.top_k)
    fmt = output_format(args)
    write_run(args.out, after, tag=args.tag or default_tag(args.model_dir), format=fmt, split=split)
    cutoffs = cutoffs_for(args.top_k)
    metrics = {**{f"first_stage/{k}": v for k, v in corpus_metrics(before, split.qrels, cutoffs).items()},
               **{f"reranked/{k}": v for k, v in corpus_metrics(after, split.qrels, cutoffs).items()}}
    print(metrics_table(metrics))
    left_out = len(first_stage) - len(judged)
    unjudged = f"; {left_out} of the run's queries are not judged in this split and were left out" if left_out else ""
    print(f"wrote {args.out} ({fmt}): {len(after)} queries, top {args.top_k} candidates each reordered{unjudged}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vembed rerank", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
