"""Search a corpus folder and write the ranking as a run file: `vembed search MODEL_DIR|bm25 CORPUS_FOLDER --out
run.trec [--top-k 100] [--split test]`.

MODEL_DIR is an embedding model (one vector per text: exact cosine search; a sparse SPLADE one: exact dot product)
or a late-interaction one (ColBERT, ColQwen: exact MaxSim), saved by vembed, sentence-transformers or transformers; `bm25` searches the corpus's words
with bm25s. Every query the split judges is searched against the whole corpus; the run is a TREC run file (what
trec_eval, pyserini, BEIR and ranx read; `--format jsonl` writes one JSON row per hit with the texts). It is what a
reranker recipe's `data.first_stage_run` names, what `vembed rerank` reorders, `vembed fuse` combines and
`vembed eval RUN_FILE CORPUS_FOLDER` measures. Under `accelerate launch` each process encodes its share.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vembed.retrieval.bm25 import BM25

DEFAULT_TOP_K = 100


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", metavar="MODEL_DIR|bm25",
                        help="an embedding or late-interaction model folder (saved by vembed, sentence-transformers "
                             "or transformers), or bm25 for a lexical first stage")
    parser.add_argument("corpus", help="a corpus folder (corpus.jsonl, queries.jsonl, qrels/<split>.tsv)")
    add_run_output_arguments(parser, default_split="test")
    parser.add_argument("--top-k", "--top_k", type=int, default=DEFAULT_TOP_K,
                        help=f"documents kept per query (default {DEFAULT_TOP_K})")
    parser.add_argument("--max-queries", "--max_queries", type=int,
                        help="search only the split's first N judged queries (default: all)")
    parser.add_argument("--batch-size", "--batch_size", type=int, default=64, help="texts encoded at once")
    parser.add_argument("--pool-factor", "--pool_factor", type=int, default=None,
                        help="late-interaction models: pool each document's token vectors about this many to one "
                             "(default: the model's document_pool_factor, 1 = none)")
    parser.add_argument("--image-root", "--image_root", help="folder relative image paths are resolved against")
    parser.add_argument("--trust-remote-code", "--trust_remote_code", action="store_true",
                        help="let the model folder run Python code it ships (only for folders you trust)")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error instead of one line")


def add_run_output_arguments(parser: argparse.ArgumentParser, default_split: str) -> None:
    """--out, --format, --tag, --split and --overwrite: what every command that writes a run takes."""
    from vembed.evaluation.runs import FORMATS

    parser.add_argument("--out", required=True, help="the run file to write (TREC; .jsonl: JSON rows)")
    parser.add_argument("--format", choices=FORMATS, default=None,
                        help="trec: query-id Q0 doc-id rank score tag; jsonl: one row per hit with the query's and "
                             "the document's text (default: jsonl for a .jsonl --out, else trec)")
    parser.add_argument("--tag", default=None, help="the run's name in its last column (default: the model's name)")
    parser.add_argument("--split", default=default_split,
                        help=f"the qrels split whose queries are searched (qrels/<split>.tsv; default {default_split})")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")


def check_run_output(args: argparse.Namespace) -> None:
    """--out can be written (a file, replaced only with --overwrite) and --tag is one word: before any work."""
    from vembed.errors import ArgumentError
    from vembed.files import check_output_file

    check_output_file(args.out, args.overwrite, key="--out", kind="the run file to write (e.g. run.trec)")
    if args.tag is not None and (not args.tag or any(char.isspace() for char in args.tag)):
        raise ArgumentError("--tag", f"{args.tag!r} is not one word; a run's tag is its last column")


def output_format(args: argparse.Namespace) -> str:
    return args.format or ("jsonl" if Path(args.out).suffix == ".jsonl" else "trec")


def default_tag(model: str) -> str:
    """A run's tag from what made it: the model folder's name (`final` is named by its run folder)."""
    path = Path(model)
    name = path.parent.name if path.name == "final" and path.parent.name else path.name
    return "".join(char if not char.isspace() else "_" for char in name) or "vembed"


def run(args: argparse.Namespace) -> int:
    from vembed.entrypoints import require_at_least_one, run_cli

    def body() -> int:
        from vembed.data.corpus import CorpusSource
        from vembed.errors import ArgumentError, require_package

        require_at_least_one(top_k=args.top_k, batch_size=args.batch_size, max_queries=args.max_queries,
                             pool_factor=args.pool_factor)
        check_run_output(args)
        source = CorpusSource(None, args.corpus, args.split, args.image_root, "--split")
        if not Path(args.corpus).is_dir():
            raise ArgumentError("corpus", f"{args.corpus} is not a folder; give a corpus folder (corpus.jsonl, "
                                        "queries.jsonl, qrels/<split>.tsv)")
        source.check()
        if args.model_dir == BM25 and not Path(BM25).exists():
            require_package("bm25s", "model_dir", "bm25", "search")
            if args.pool_factor is not None:
                raise ArgumentError("--pool-factor", "applies to a late-interaction model, not to bm25")
            return _search_bm25(args, source)
        return _search_model(args, source)

    return run_cli(body, args.debug)


def _search_bm25(args: argparse.Namespace, source) -> int:
    from vembed.evaluation.corpus import judged_queries
    from vembed.retrieval.bm25 import bm25_run

    split = source.load()
    query_ids = judged_queries(split, args.max_queries)
    found = bm25_run(split, query_ids, args.top_k, show_progress=True)
    _write(args, found, split, args.tag or BM25, "bm25", 1)
    return 0


def _search_model(args: argparse.Namespace, source) -> int:
    from vembed.entrypoints import quiet_libraries
    from vembed.models.foreign import load_embedding_model, require_embedder
    from vembed.reranking.evaluation import embedder_run
    from vembed.retrieval.maxsim_search import set_pool_factor
    from vembed.retrieval.search import scoring_of
    from vembed.training.launch_promise import command_accelerator
    from vembed.training.threads import use_threads

    model_dir = require_embedder(args.model_dir, instead="search with the embedder (or bm25), then reorder its run "
                                                        "with the reranker: vembed rerank RERANKER CORPUS --run "
                                                        "run.trec")
    split = source.load()
    use_threads()
    quiet_libraries()
    accelerator = command_accelerator()
    adapter = load_embedding_model(model_dir, trust_remote_code=args.trust_remote_code)
    set_pool_factor(adapter, args.pool_factor)
    scoring = scoring_of(adapter).name
    found = embedder_run(adapter.to(accelerator.device), split, args.top_k, batch_size=args.batch_size,
                         accelerator=accelerator, max_queries=args.max_queries, show_progress=True)
    if accelerator.is_main_process:
        _write(args, found, split, args.tag or default_tag(args.model_dir), f"exact {scoring}",
               accelerator.num_processes)
    accelerator.wait_for_everyone()
    accelerator.end_training()  # tears the process group down together (gloo can abort otherwise)
    return 0


def _write(args: argparse.Namespace, found, split, tag: str, how: str, processes: int) -> None:
    from vembed.evaluation.runs import write_run

    fmt = output_format(args)
    write_run(args.out, found, tag=tag, format=fmt, split=split)
    hits = sum(len(docs) for docs in found.values())
    print(f"wrote {args.out} ({fmt}): {len(found)} queries of qrels/{args.split}.tsv, {hits} documents "
          f"(top {args.top_k} of {len(split.corpus)}; {how}; {processes} process(es))")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vembed search", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
