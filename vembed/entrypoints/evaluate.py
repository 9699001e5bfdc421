"""Evaluate a saved model on a data file: `vembed eval MODEL_DIR DATA [--image-root DIR] [--output metrics.json]`;
or on a corpus folder (corpus.jsonl, queries.jsonl, qrels/): `vembed eval MODEL_DIR FOLDER --split test` searches every
judged query against the whole corpus and reports nDCG@10, recall@1/10/100, MAP@100 and MRR@10 (`corpus/...`).

A reranker is judged by what it adds to a first stage: `vembed eval RERANKER_DIR FOLDER --first-stage EMBEDDER_DIR
--top-k 100` (or `--first-stage run.trec`, a TREC run file) reranks each judged query's top k and prints the
before/after table of nDCG@10, MRR@10, recall@1/10/k and MAP@k (`first_stage/...`, `reranked/...`).

`--accelerate_config NAME|FILE` (and `--num_processes N`) launch the evaluation on several processes as `vembed train`
does (vembed/entrypoints/launch.py); under any launcher each process encodes its share of the corpus and rank 0
prints and writes the metrics, once."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from accelerate import Accelerator

    from vembed.data.corpus import CorpusSource
    from vembed.models.base import EmbeddingAdapter
    from vembed.recipe import DataConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from vembed.entrypoints.search import add_sparse_arguments

    parser.add_argument("model_dir", metavar="MODEL_DIR|RUN_FILE",
                        help="a model folder saved by vembed (e.g. runs/demo/final), by sentence-transformers or by "
                             "transformers, or a hub id; or a TREC run file, measured on a corpus folder")
    parser.add_argument("data", nargs="+", help="JSONL/CSV/Parquet file(s) or a directory of them, or a corpus "
                                                "folder; NAME=PATH names a source (pair files or a corpus folder): "
                                                "each is evaluated apart (metrics under NAME/, and their mean over "
                                                "sources unprefixed; counts summed)")
    parser.add_argument("--image-root", "--image_root", help="directory relative image paths are resolved against")
    parser.add_argument("--format", default="auto", choices=["auto", "jsonl", "json", "csv", "parquet", "hf"],
                        help="the data files' format (default auto: from each file's extension)")
    parser.add_argument("--column", action="append", default=[], metavar="FIELD=COLUMN",
                        help="column mapping, e.g. --column query=caption --column positive_image=file")
    parser.add_argument("--batch-size", "--batch_size", type=int, default=64, help="items encoded at once (default 64)")
    parser.add_argument("--mrl-dims", "--mrl_dims", type=int, nargs="+",
                        help="also report metrics at these truncated sizes")
    parser.add_argument("--max-samples", "--max_samples", type=int,
                        help="evaluate on at most this many records (corpus folder: queries; the corpus stays whole)")
    parser.add_argument("--split", help="a corpus folder's qrels split (qrels/<split>.tsv; default: test)")
    parser.add_argument("--pool-factor", "--pool_factor", type=int, default=None,
                        help="corpus folder, multi_vector model: pool each document's token vectors about this many "
                             "to one (hierarchical clustering; default: the model's document_pool_factor, 1 = none); "
                             "the index's token vectors and bytes, pooled and not, are printed and in the metrics "
                             "(index/...)")
    add_sparse_arguments(parser)
    parser.add_argument("--first-stage", "--first_stage", metavar="EMBEDDER_DIR|RUN_FILE",
                        help="with a reranker as MODEL_DIR: the first stage whose candidates it reorders, an "
                             "embedding model folder (searched over the corpus) or a TREC run file")
    parser.add_argument("--top-k", "--top_k", type=int, help="candidates per query the reranker reorders (default "
                                                             "100); recall is also reported at this k")
    parser.add_argument("--output", help="write the metrics as JSON here")
    parser.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    parser.add_argument("--trust-remote-code", "--trust_remote_code", action="store_true",
                        help="let the model folder run Python code it ships (only for folders you trust)")
    parser.add_argument("--accelerate-config", "--accelerate_config",
                        help="launch with this accelerate config, as `vembed train` does: one of ours by name (e.g. "
                             "ddp_cpu) or a file; each process encodes its share of the corpus")
    parser.add_argument("--num-processes", "--num_processes", type=int, help="override the config's process count")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error instead of one line")


def run(args: argparse.Namespace) -> int:
    from vembed.entrypoints import require_at_least_one, run_cli

    def body() -> int:
        from vembed.errors import RecipeError
        from vembed.files import check_output_file

        require_at_least_one(batch_size=args.batch_size, max_samples=args.max_samples, top_k=args.top_k,
                             sparse_query_top_k=args.sparse_query_top_k,
                             sparse_document_top_k=args.sparse_document_top_k)
        if args.output:
            check_output_file(args.output, args.overwrite, key="--output", kind="a JSON file")
        if Path(args.model_dir).is_file():
            return _evaluate_run_file(args)
        corpus = _is_corpus(args)
        _check_reranking(args, corpus)
        if not _corpus_folders(args) and args.split is not None:
            raise RecipeError("--split", f"names a qrels split of a corpus folder; {' '.join(args.data)} is not "
                                         "one (a corpus folder holds corpus.jsonl, queries.jsonl and qrels/)")
        if _asks_for_a_launch(args):
            return _launch(args)
        return _evaluate(args)

    return run_cli(body, args.debug)


def _asks_for_a_launch(args: argparse.Namespace) -> bool:
    """--accelerate_config / --num_processes launch processes, except in a process a launch started (they see the
    same arguments)."""
    from vembed.training.launch_promise import LAUNCHER_PID_ENV, started_by_accelerate_or_torchrun

    asked = args.accelerate_config is not None or args.num_processes is not None
    return asked and not (os.environ.get(LAUNCHER_PID_ENV) or started_by_accelerate_or_torchrun(os.environ))


def _launch(args: argparse.Namespace) -> int:
    """`accelerate launch -m vembed.entrypoints.evaluate ARGS` with the config and process count `vembed train` would
    use (the same machinery); one plain process evaluates here."""
    from vembed.entrypoints.launch import accelerate_arguments, plan_launch, scratch_folder, start
    from vembed.errors import LaunchError

    argv = getattr(args, "argv", None)  # the command line as typed, which each process parses again
    if argv is None:
        raise LaunchError("--accelerate_config: launching needs the command line; run `vembed eval` or "
                          "vembed.entrypoints.evaluate.main(argv)")
    with scratch_folder() as scratch:  # derived configs go when the launch ends
        config, num_processes = plan_launch(args.accelerate_config, args.num_processes, scratch)
        launch_args = accelerate_arguments(config, num_processes, ["-m", "vembed.entrypoints.evaluate", *argv])
        return start(launch_args, num_processes, config, "vembed eval", lambda: _evaluate(args))


def _is_corpus(args: argparse.Namespace) -> bool:
    """DATA is one corpus folder (corpus.jsonl, queries.jsonl, qrels/), not pair files."""
    from vembed.data.corpus import is_corpus_folder

    return len(args.data) == 1 and is_corpus_folder(args.data[0])


def _corpus_folders(args: argparse.Namespace) -> dict[str | None, str]:
    """The corpus folders among DATA: {None: FOLDER} for one unnamed folder, else the named sources that are one."""
    from vembed.data.corpus import is_corpus_folder

    if _is_corpus(args):
        return {None: args.data[0]}
    return {name: path for name, path in (_named_sources(args.data) or {}).items() if is_corpus_folder(path)}


def _evaluate(args: argparse.Namespace) -> int:
    """Evaluate in this process, one of the processes a launch started or the only one; rank 0 reports."""
    from vembed.training.launch_promise import command_accelerator, stop_with_launcher
    from vembed.training.threads import use_threads

    stop_with_launcher()  # a process `vembed eval` launched never outlives it
    use_threads()
    accelerator = command_accelerator()
    if args.first_stage is not None:
        metrics = _evaluate_reranker(args, accelerator)
    else:
        metrics = _evaluate_embedder(args, accelerator)
    if accelerator.is_main_process:
        if args.first_stage is not None:
            from vembed.reranking.evaluation import metrics_table

            print(metrics_table(metrics))
        else:
            print(json.dumps(metrics, indent=2))
        if args.output:
            from vembed.files import write_json_atomic

            Path(args.output).parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(args.output, metrics)
    accelerator.wait_for_everyone()
    accelerator.end_training()  # tears the process group down together (gloo can abort otherwise)
    return 0


def _evaluate_run_file(args: argparse.Namespace) -> int:
    """`vembed eval RUN_FILE CORPUS_FOLDER`: a TREC run (vembed's or any tool's) measured on the split's qrels with
    the corpus metrics (trec_eval's definitions); nothing is encoded."""
    from vembed.data.corpus import CorpusSource
    from vembed.errors import ArgumentError
    from vembed.evaluation.corpus import corpus_metrics
    from vembed.evaluation.runs import check_documents_in_corpus, read_run
    from vembed.files import write_json_atomic

    given = {"--first-stage": args.first_stage, "--pool-factor": args.pool_factor,
             "--sparse-query-top-k": args.sparse_query_top_k, "--sparse-document-top-k": args.sparse_document_top_k,
             "--mrl-dims": args.mrl_dims,
             "--column": args.column, "--top-k": args.top_k, "--max-samples": args.max_samples,
             "--accelerate-config": args.accelerate_config, "--num-processes": args.num_processes}
    flag = next((flag for flag, value in given.items() if value), None)
    if flag is not None:
        raise ArgumentError(flag, f"applies to a model; {args.model_dir} is a run file, measured as it is")
    if not _is_corpus(args):
        raise ArgumentError("data", f"{' '.join(args.data)} is not a corpus folder; a run file is measured on the "
                                  "corpus folder it was made on (corpus.jsonl, queries.jsonl, qrels/)")
    source = CorpusSource(None, args.data[0], args.split or "test", args.image_root, "--split")
    source.check()
    ranking = read_run(args.model_dir)
    split = source.load()
    check_documents_in_corpus(ranking, split, args.model_dir)
    metrics = {f"corpus/{name}": value for name, value in corpus_metrics(ranking, split.qrels).items()}
    print(json.dumps(metrics, indent=2))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(args.output, metrics)
    return 0


def _evaluate_embedder(args: argparse.Namespace, accelerator: "Accelerator") -> dict[str, float]:
    """An embedding model on DATA: one corpus folder, pair files, or named sources of either kind, each evaluated
    apart (its metrics under NAME/, their mean over sources unprefixed, as in-run evaluation reports them)."""
    from vembed.entrypoints import quiet_libraries
    from vembed.evaluation.pairs import merge_source_metrics
    from vembed.models.foreign import load_embedding_model

    folders = _corpus_folders(args)
    named = _named_sources(args.data)
    pairs = None if None in folders else ({name: path for name, path in named.items() if name not in folders}
                                          if named else args.data)
    _check_flags(args, corpus=bool(folders), pairs=bool(pairs))
    sources = {name: _corpus_source(args, name, folder) for name, folder in folders.items()}
    data = _pair_data(args, pairs) if pairs else None
    for source in sources.values():
        source.check()
    quiet_libraries()
    adapter = load_embedding_model(args.model_dir, trust_remote_code=args.trust_remote_code)
    if pairs:
        _check_pair_model(args, adapter)
    if sources:
        _prepare_corpus_model(args, adapter)
    if None in sources:
        return _corpus_metrics(args, adapter, sources[None], accelerator)
    if not named:
        return _pair_metrics(args, adapter, data, accelerator)
    found = {name: _corpus_metrics(args, adapter, source, accelerator) for name, source in sources.items()}
    if data is not None:
        found.update(_pair_metrics(args, adapter, data, accelerator, named=True))
    return merge_source_metrics({name: found[name] for name in named})  # in the order given


def _check_flags(args: argparse.Namespace, *, corpus: bool, pairs: bool) -> None:
    """Flags that apply to one kind of data are refused, in one line, when none of the data is of that kind."""
    from vembed.errors import ArgumentError, RecipeError

    if not pairs:
        for flag, value in (("--mrl-dims", args.mrl_dims), ("--column", args.column)):
            if value:
                raise RecipeError(flag, "applies to pair files, not to a corpus folder")
    if corpus:
        return
    if args.pool_factor is not None:
        raise RecipeError("--pool-factor", "applies to a corpus folder (documents indexed as token vectors), not to "
                                           "pair files")
    for side in ("query", "document"):
        if getattr(args, f"sparse_{side}_top_k") is not None:
            raise ArgumentError(f"--sparse-{side}-top-k", "applies to a corpus folder (searched through a sparse "
                                                           "model's inverted index), not to pair files")


def _corpus_source(args: argparse.Namespace, name: str | None, folder: str) -> "CorpusSource":
    from vembed.data.corpus import CorpusSource

    return CorpusSource(name, folder, args.split or "test", args.image_root, "--split")


def _prepare_corpus_model(args: argparse.Namespace, adapter: "EmbeddingAdapter") -> None:
    """How the corpus is indexed: token vectors pooled by --pool-factor, sparse vectors pruned by --sparse-*-top-k."""
    from vembed.entrypoints.search import sparse_pruning
    from vembed.retrieval.maxsim_search import set_pool_factor

    set_pool_factor(adapter, args.pool_factor)
    sparse_pruning(adapter, args)


def _corpus_metrics(args: argparse.Namespace, adapter: "EmbeddingAdapter", source: "CorpusSource",
                    accelerator: "Accelerator") -> dict[str, float]:
    """Every judged query of the folder's split searched against its whole corpus; a multi_vector model's index size
    and a sparse model's active dimensions beside the metrics."""
    from vembed.evaluation.corpus import evaluate_corpus
    from vembed.models.splade import SPARSE
    from vembed.retrieval.maxsim_search import MULTI_VECTOR, IndexSize, pool_factor_of
    from vembed.retrieval.sparse_stats import SparseActivity

    split = source.load()
    index = IndexSize() if adapter.embedding_kind == MULTI_VECTOR else None
    activity = SparseActivity() if adapter.embedding_kind == SPARSE else None
    on_block = index.add if index is not None else activity.add_documents if activity is not None else None
    metrics = evaluate_corpus(adapter.to(accelerator.device), split, batch_size=args.batch_size,
                              max_queries=args.max_samples, show_progress=True, accelerator=accelerator,
                              on_block=on_block, on_queries=activity.add_queries if activity is not None else None)
    label = "" if source.name is None else f"{source.name}: "
    if index is not None:  # what --pool-factor promises, measured on the index this search built
        index = index.across(accelerator)
        metrics.update(index.metrics())
        if accelerator.is_main_process:
            print(label + index.describe(pool_factor_of(adapter)), file=sys.stderr)
    if activity is not None:  # what a sparse model's vectors cost: active dimensions, the inverted index's size
        activity = activity.across(accelerator)
        metrics.update(activity.metrics())
        if accelerator.is_main_process:
            print(label + activity.describe(adapter.embedding_dim), file=sys.stderr)
    return metrics


def _check_reranking(args: argparse.Namespace, corpus: bool) -> None:
    """A reranker needs a first stage and a corpus folder, and only a reranker takes one; each mix-up is one line
    naming the flag, before any model or data is read."""
    from vembed.errors import RecipeError
    from vembed.models.foreign import require_embedder
    from vembed.reranking import saved_reranker_type

    reranker = saved_reranker_type(args.model_dir)
    if args.first_stage is None:
        if reranker:
            raise RecipeError("--first-stage", f"{args.model_dir} is a {reranker!r} reranker: it reorders a first "
                                               "stage's candidates; name the embedder (--first-stage EMBEDDER_DIR) or "
                                               "a TREC run file (--first-stage run.trec)")
        # A reranker vembed did not save is no embedder either; vembed eval reranks with one vembed trained.
        require_embedder(args.model_dir, instead="to rerank with it, fine-tune it with a cross_encoder recipe "
                                                 "(model_name: this folder) and evaluate what that saves with "
                                                 "--first-stage")
        if args.top_k is not None:
            raise RecipeError("--top-k", "is the depth a reranker reorders; it applies with --first-stage")
        return
    if not reranker:
        raise RecipeError("model_dir", f"{args.model_dir} is not a reranker saved by vembed, and --first-stage "
                                       "names the candidates a reranker reorders; give the reranker first "
                                       "(vembed eval RERANKER_DIR CORPUS --first-stage EMBEDDER_DIR), or drop "
                                       "--first-stage to evaluate an embedder alone")
    if not corpus:
        raise RecipeError("data", f"{' '.join(args.data)} is not a corpus folder; a reranker is evaluated on one "
                                  "(corpus.jsonl, queries.jsonl, qrels/), where its first stage retrieves")
    for flag, value in (("--mrl-dims", args.mrl_dims), ("--column", args.column)):
        if value:
            raise RecipeError(flag, "applies to an embedder on pair files, not to a reranker")
    first_stage = Path(args.first_stage)
    if first_stage.is_dir():
        require_embedder(first_stage, "--first-stage", instead="name the embedder that finds the candidates (or a "
                                                               "TREC run file of them)")
    elif not first_stage.is_file():
        raise RecipeError("--first-stage", f"{args.first_stage} is neither an embedding model folder nor a TREC "
                                           "run file")


def _evaluate_reranker(args: argparse.Namespace, accelerator: "Accelerator") -> dict[str, float]:
    """The first stage's top k on the corpus split (the embedder's search, or a run file), then reranked; both
    judged with the corpus metrics."""
    from vembed.data.corpus import CorpusSource
    from vembed.entrypoints import quiet_libraries
    from vembed.entrypoints.search import sparse_pruning
    from vembed.errors import ArgumentError
    from vembed.evaluation.runs import read_run
    from vembed.reranking import load_reranker
    from vembed.reranking.evaluation import cutoffs_for, embedder_run, judged_split, rerank_run

    top_k = args.top_k or 100
    source = CorpusSource(None, args.data[0], args.split or "test", args.image_root, "--split")
    source.check()
    run = read_run(args.first_stage) if Path(args.first_stage).is_file() else None
    pruned = next((flag for flag in ("sparse_query_top_k", "sparse_document_top_k") if getattr(args, flag)), None)
    if run is not None and pruned:
        raise ArgumentError(f"--{pruned.replace('_', '-')}", "prunes a sparse embedder's search; the first stage "
                                                            "is a run file, searched already")
    quiet_libraries()
    reranker = load_reranker(args.model_dir, trust_remote_code=args.trust_remote_code)
    split = judged_split(source.load(), args.max_samples)
    if run is None:
        from vembed.models.foreign import load_embedding_model

        embedder = load_embedding_model(args.first_stage, trust_remote_code=args.trust_remote_code,
                                        key="--first-stage")
        sparse_pruning(embedder, args)  # the first stage's own search
        run = embedder_run(embedder.to(accelerator.device), split, top_k, batch_size=args.batch_size,
                           accelerator=accelerator, show_progress=True)
    score = reranker.to(accelerator.device).score
    return rerank_run(lambda queries, documents: score(queries, documents, batch_size=args.batch_size), split, run,
                      depth=top_k, cutoffs=cutoffs_for(top_k))


def _pair_data(args: argparse.Namespace, pairs: "dict[str, str] | list[str]") -> "DataConfig":
    """The pair files as a recipe's test split (named sources: a dict), checked as a recipe's data is."""
    from vembed.data.paths import check_data_paths
    from vembed.errors import RecipeError
    from vembed.recipe import ColumnMap, DataConfig

    columns = {}
    for item in args.column:
        if "=" not in item:
            raise RecipeError("--column", f"{item!r} is not FIELD=COLUMN (e.g. query=caption)")
        field, column = item.split("=", 1)
        columns[field] = column
    try:
        data = DataConfig(test=pairs, image_root=args.image_root, format=args.format,
                          columns=ColumnMap(**columns), max_bad_fraction=1.0)
    except Exception as err:  # pydantic's message names the field
        raise RecipeError("--column", str(err).splitlines()[-1]) from None
    check_data_paths(data, ("test",))  # the checks a recipe's data gets
    return data


def _check_pair_model(args: argparse.Namespace, adapter: "EmbeddingAdapter") -> None:
    from vembed.errors import RecipeError
    from vembed.models.token_vectors import require_single_vector

    require_single_vector(adapter, "vembed eval of pair files", "evaluate it on a corpus folder (corpus.jsonl, "
                                                                "queries.jsonl, qrels/): vembed eval MODEL_DIR FOLDER")
    too_big = [d for d in args.mrl_dims or () if not 0 < d <= adapter.embedding_dim]
    if too_big:
        raise RecipeError("--mrl-dims", f"{too_big} are not in 1..{adapter.embedding_dim}, the model's "
                                        "embedding size")


def _pair_metrics(args: argparse.Namespace, adapter: "EmbeddingAdapter", data: "DataConfig",
                  accelerator: "Accelerator", named: bool = False) -> dict[str, float]:
    """Retrieval among the pairs' own documents, plus similarity and triplet metrics where the rows have scores or
    negatives; with `named`, a dict name -> that source's metrics."""
    from vembed.data.sources import load_examples
    from vembed.evaluation.pairs import evaluate_retrieval
    from vembed.evaluation.scored import evaluate_scored
    from vembed.tasks.contrastive import check_images_per_side

    # Negatives kept (as many as every record has) for triplet accuracy; retrieval reads only queries and positives.
    examples, report = load_examples(data, "test", num_hard_negatives=None)
    check_images_per_side(adapter.model_type, examples)

    def evaluate(chosen: list) -> dict[str, float]:
        chosen = chosen[: args.max_samples] if args.max_samples else chosen  # per source, as in-run evaluation
        metrics = evaluate_retrieval(adapter.to(accelerator.device), chosen, batch_size=args.batch_size,
                                     mrl_dims=args.mrl_dims, show_progress=True, accelerator=accelerator)
        return {**metrics, **evaluate_scored(adapter, chosen, batch_size=args.batch_size, accelerator=accelerator)}

    if not named:
        return evaluate(examples)
    # Each source's own queries against its own documents.
    return {name: evaluate([e for e in examples if e.source_name == name]) for name in data.test}


def _named_sources(data: list[str]) -> dict[str, str] | None:
    """`NAME=PATH` arguments as named sources (all of them or none), or None for plain paths. A path that exists is a
    path even with `=` in it."""
    from vembed.errors import RecipeError

    def named(item: str) -> bool:
        name = item.split("=", 1)[0]
        return "=" in item and not Path(item).exists() and bool(name) and "/" not in name

    if not any(named(item) for item in data):
        return None
    plain = [item for item in data if not named(item)]
    if plain:
        raise RecipeError("data", f"{plain[0]!r} has no NAME= while other data arguments do; name every source "
                                  "(NAME=PATH) or none")
    sources = dict(item.split("=", 1) for item in data)
    if len(sources) != len(data):
        raise RecipeError("data", "a source name is given twice; give each NAME=PATH once")
    return sources


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vembed eval", description=__doc__)
    add_arguments(parser)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv = argv  # for --accelerate_config: the processes it launches parse the same command line
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
