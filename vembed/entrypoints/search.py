"""Search a corpus folder and write the ranking as a run file: `vembed search MODEL_DIR|bm25 CORPUS_FOLDER --out
run.trec [--top-k 100] [--split test]`.

MODEL_DIR is an embedding model (one vector per text: exact cosine search; a sparse SPLADE one: exact dot product
through an inverted index of its non-zero weights, optionally pruned with --sparse-query-top-k/--sparse-document-top-k)
or a late-interaction one (ColBERT, ColQwen: exact MaxSim, or approximate with --index hnsw), saved by vembed,
sentence-transformers or transformers; `bm25` searches the corpus's words with bm25s. Every query the split judges
is searched against the whole corpus; the run is a TREC run file (what trec_eval, pyserini, BEIR and ranx read;
`--format jsonl` writes one JSON row per hit with the texts). It is what a reranker recipe's `data.first_stage_run`
names, what `vembed rerank` reorders, `vembed fuse` combines and `vembed eval RUN_FILE CORPUS_FOLDER` measures.
Under `accelerate launch` each process encodes its share.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from vembed.retrieval.bm25 import BM25

if TYPE_CHECKING:
    from vembed.retrieval.token_index import HnswSettings

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
    add_index_arguments(parser)
    add_sparse_arguments(parser)
    parser.add_argument("--image-root", "--image_root", help="folder relative image paths are resolved against")
    parser.add_argument("--trust-remote-code", "--trust_remote_code", action="store_true",
                        help="let the model folder run Python code it ships (only for folders you trust)")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error instead of one line")


def add_index_arguments(parser: argparse.ArgumentParser) -> None:
    """--index and the approximate index's knobs (defaults: `token_index.HnswSettings`)."""
    from vembed.retrieval.token_index import EXACT, HNSW, INDEXES, HnswSettings

    defaults = HnswSettings()
    parser.add_argument("--index", choices=INDEXES, default=EXACT,
                        help=f"late-interaction models: {EXACT} scores every document by MaxSim; {HNSW} scores only "
                             "the documents owning the nearest neighbours of each query token in an HNSW graph of "
                             "every document token (voyager; approximate: a document may be missed, never misscored)")
    parser.add_argument("--candidates-per-token", "--candidates_per_token", type=int, default=None,
                        help=f"--index {HNSW}: document tokens taken per query token (default "
                             f"{defaults.candidates_per_token}; more: better recall, slower)")
    parser.add_argument("--hnsw-m", "--hnsw_m", type=int, default=None,
                        help=f"--index {HNSW}: links per token vector in the graph (at least 2; default {defaults.m})")
    parser.add_argument("--hnsw-ef-construction", "--hnsw_ef_construction", type=int, default=None,
                        help=f"--index {HNSW}: candidates kept while the graph is built (default "
                             f"{defaults.ef_construction})")
    parser.add_argument("--hnsw-ef-search", "--hnsw_ef_search", type=int, default=None,
                        help=f"--index {HNSW}: candidates kept while a query token is searched (default "
                             f"{defaults.ef_search}; raised to --candidates-per-token when below it)")


def add_sparse_arguments(parser: argparse.ArgumentParser) -> None:
    """--sparse-query-top-k and --sparse-document-top-k: a sparse model's pruning in its inverted index."""
    for side, plural in (("query", "queries"), ("document", "documents")):
        parser.add_argument(f"--sparse-{side}-top-k", f"--sparse_{side}_top_k", type=int, default=None,
                            help=f"sparse (SPLADE) models: keep only each {side}'s this many largest weights in the "
                                 f"inverted index (default: the model's sparse_{side}_top_k; unset: all of them; "
                                 f"fewer: a smaller index and faster search, the {plural} scored on fewer terms)")


def sparse_pruning(adapter, args: argparse.Namespace) -> None:
    """The model's pruning from --sparse-query-top-k / --sparse-document-top-k, each refused for a dense model; scipy
    required for a sparse one (its index), before any work."""
    from vembed.models.splade import SPARSE
    from vembed.retrieval.sparse_index import require_scipy, set_sparse_pruning

    if adapter.embedding_kind == SPARSE:
        require_scipy("model_dir")
    set_sparse_pruning(adapter, args.sparse_query_top_k, args.sparse_document_top_k)


def index_settings(args: argparse.Namespace) -> "HnswSettings | None":
    """The approximate index --index asks for (None: exact search); its knobs refused without it, and voyager
    required with it, before any work."""
    from vembed.entrypoints import require_at_least_one
    from vembed.errors import ArgumentError
    from vembed.retrieval.token_index import HNSW, HnswSettings, require_voyager

    knobs = {"candidates_per_token": args.candidates_per_token, "m": args.hnsw_m,
             "ef_construction": args.hnsw_ef_construction, "ef_search": args.hnsw_ef_search}
    flags = dict(zip(("candidates_per_token", "hnsw_m", "hnsw_ef_construction", "hnsw_ef_search"), knobs.values()))
    require_at_least_one(**flags)
    if args.index != HNSW:
        given = next((name for name, value in flags.items() if value is not None), None)
        if given is not None:
            raise ArgumentError(f"--{given.replace('_', '-')}",
                                f"tunes --index {HNSW}; add --index {HNSW} or remove it")
        return None
    require_voyager()
    try:
        return HnswSettings(**{name: value for name, value in knobs.items() if value is not None})
    except ValueError as error:  # "<knob> must be ...": named by its flag
        knob, problem = str(error).split(" ", 1)
        flag = dict(zip(knobs, flags))[knob]
        raise ArgumentError(f"--{flag.replace('_', '-')}", problem) from None


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
                             pool_factor=args.pool_factor, sparse_query_top_k=args.sparse_query_top_k,
                             sparse_document_top_k=args.sparse_document_top_k)
        settings = index_settings(args)
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
            if settings is not None:
                raise ArgumentError("--index", "indexes a late-interaction model's token vectors, not bm25's words")
            for side in ("query", "document"):
                if getattr(args, f"sparse_{side}_top_k") is not None:
                    raise ArgumentError(f"--sparse-{side}-top-k", "prunes a sparse model's vectors, not bm25's words")
            return _search_bm25(args, source)
        return _search_model(args, source, settings)

    return run_cli(body, args.debug)


def _search_bm25(args: argparse.Namespace, source) -> int:
    from vembed.evaluation.corpus import judged_queries
    from vembed.retrieval.bm25 import bm25_run

    split = source.load()
    query_ids = judged_queries(split, args.max_queries)
    found = bm25_run(split, query_ids, args.top_k, show_progress=True)
    _write(args, found, split, args.tag or BM25, "bm25", 1)
    return 0


def _search_model(args: argparse.Namespace, source, settings: "HnswSettings | None") -> int:
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
    sparse_pruning(adapter, args)
    check_index(adapter, settings, accelerator.num_processes)
    scoring = scoring_of(adapter).name
    found = embedder_run(adapter.to(accelerator.device), split, args.top_k, batch_size=args.batch_size,
                         accelerator=accelerator, max_queries=args.max_queries, show_progress=True, index=settings)
    if accelerator.is_main_process:
        from vembed.retrieval.token_index import HNSW

        how = f"exact {scoring}" if settings is None else f"{scoring} of {HNSW} candidates ({settings})"
        _write(args, found, split, args.tag or default_tag(args.model_dir), how, accelerator.num_processes)
    accelerator.wait_for_everyone()
    accelerator.end_training()  # tears the process group down together (gloo can abort otherwise)
    return 0


def check_index(adapter, settings: "HnswSettings | None", processes: int) -> None:
    """An approximate index needs token vectors, and every one of them in one process."""
    from vembed.errors import ArgumentError
    from vembed.retrieval.maxsim_search import MULTI_VECTOR
    from vembed.retrieval.search import scoring_of
    from vembed.retrieval.token_index import HNSW

    if settings is None:
        return
    if adapter.embedding_kind != MULTI_VECTOR:
        scoring = scoring_of(adapter)
        raise ArgumentError("--index", f"{HNSW} indexes a late-interaction model's token vectors; this model gives "
                                       f"{scoring.vectors}: remove the flag (its search is exact {scoring.name})")
    if processes > 1:
        raise ArgumentError("--index", f"{HNSW} builds one index in one process; run without accelerate launch "
                                       f"({processes} processes)")


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
