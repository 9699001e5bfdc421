"""Evaluate a saved model on a data file: `vembed eval MODEL_DIR DATA [--image-root DIR] [--output metrics.json]`;
or on a corpus folder (corpus.jsonl, queries.jsonl, qrels/): `vembed eval MODEL_DIR FOLDER --split test` searches every
judged query against the whole corpus and reports nDCG@10, recall@1/10/100, MAP@100 and MRR@10 (`corpus/...`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", help="a folder saved by vembed (e.g. runs/demo/final)")
    parser.add_argument("data", nargs="+", help="JSONL/CSV/Parquet file(s) or a directory of them")
    parser.add_argument("--image-root", help="directory relative image paths are resolved against")
    parser.add_argument("--format", default="auto", choices=["auto", "jsonl", "json", "csv", "parquet", "hf"])
    parser.add_argument("--column", action="append", default=[], metavar="FIELD=COLUMN",
                        help="column mapping, e.g. --column query=caption --column positive_image=file")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--mrl-dims", type=int, nargs="+", help="also report metrics at these truncated sizes")
    parser.add_argument("--max-samples", type=int, help="evaluate on at most this many records (corpus folder: "
                                                        "queries; the corpus stays whole)")
    parser.add_argument("--split", help="a corpus folder's qrels split (qrels/<split>.tsv; default: test)")
    parser.add_argument("--output", help="write the metrics as JSON here")
    parser.add_argument("--trust-remote-code", "--trust_remote_code", action="store_true",
                        help="let the model folder run Python code it ships (only for folders you trust)")
    parser.add_argument("--debug", action="store_true")


def run(args: argparse.Namespace) -> int:
    from vembed.entrypoints import run_cli

    def body() -> int:
        from vembed.errors import RecipeError

        for flag, value in (("--batch-size", args.batch_size), ("--max-samples", args.max_samples)):
            if value is not None and value < 1:
                raise RecipeError(flag, f"must be at least 1, got {value}")
        if args.output:
            _check_output_file(Path(args.output))
        from vembed.data.corpus import is_corpus_folder

        if len(args.data) == 1 and is_corpus_folder(args.data[0]):
            metrics = _evaluate_corpus(args)
        else:
            if args.split is not None:
                raise RecipeError("--split", f"names a qrels split of a corpus folder; {' '.join(args.data)} is not "
                                             "one (a corpus folder holds corpus.jsonl, queries.jsonl and qrels/)")
            metrics = _evaluate_pairs(args)
        text = json.dumps(metrics, indent=2)
        print(text)
        if args.output:
            from vembed.training.checkpoint import write_json_atomic

            Path(args.output).parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(args.output, metrics)
        return 0

    return run_cli(body, args.debug)


def _evaluate_corpus(args: argparse.Namespace) -> dict[str, float]:
    from vembed.data.corpus import CorpusSource
    from vembed.entrypoints import quiet_libraries
    from vembed.errors import RecipeError
    from vembed.evaluation.corpus import evaluate_corpus
    from vembed.models.base import load_adapter

    for flag, value in (("--mrl-dims", args.mrl_dims), ("--column", args.column)):
        if value:
            raise RecipeError(flag, "applies to pair files, not to a corpus folder")
    source = CorpusSource(None, args.data[0], args.split or "test", args.image_root, "--split")
    source.check()
    quiet_libraries()
    adapter = load_adapter(args.model_dir, trust_remote_code=args.trust_remote_code)
    split = source.load()
    return evaluate_corpus(adapter, split, batch_size=args.batch_size, max_queries=args.max_samples,
                           show_progress=True)


def _evaluate_pairs(args: argparse.Namespace) -> dict[str, float]:
    from vembed.data.sources import check_data_paths, load_examples
    from vembed.entrypoints import quiet_libraries
    from vembed.errors import RecipeError
    from vembed.models.base import load_adapter
    from vembed.recipe import ColumnMap, DataConfig
    from vembed.tasks.contrastive import check_images_per_side

    columns = {}
    for item in args.column:
        if "=" not in item:
            raise RecipeError("--column", f"{item!r} is not FIELD=COLUMN (e.g. query=caption)")
        field, column = item.split("=", 1)
        columns[field] = column
    try:
        data = DataConfig(test=args.data, image_root=args.image_root, format=args.format,
                          columns=ColumnMap(**columns), max_bad_fraction=1.0)
    except Exception as err:  # pydantic's message names the field
        raise RecipeError("--column", str(err).splitlines()[-1]) from None
    check_data_paths(data, ("test",))  # the checks a recipe's data gets
    quiet_libraries()
    adapter = load_adapter(args.model_dir, trust_remote_code=args.trust_remote_code)
    too_big = [d for d in args.mrl_dims or () if not 0 < d <= adapter.embedding_dim]
    if too_big:
        raise RecipeError("--mrl-dims", f"{too_big} are not in 1..{adapter.embedding_dim}, the model's "
                                        "embedding size")
    # Negatives kept (as many as every record has) for triplet accuracy; retrieval reads only queries and positives.
    examples, report = load_examples(data, "test", num_hard_negatives=None)
    check_images_per_side(adapter.model_type, examples)
    if args.max_samples:
        examples = examples[: args.max_samples]
    from vembed.evaluation.retrieval import evaluate_retrieval
    from vembed.evaluation.scored import evaluate_scored

    metrics = evaluate_retrieval(adapter, examples, batch_size=args.batch_size, mrl_dims=args.mrl_dims,
                                 show_progress=True)
    return {**metrics, **evaluate_scored(adapter, examples, batch_size=args.batch_size)}


def _check_output_file(path: Path) -> None:
    """--output can be written: its folder exists (or can be made) and it is not itself a folder."""
    from vembed.errors import RecipeError

    if path.is_dir():
        raise RecipeError("--output", f"{path} is a folder; name a JSON file")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise RecipeError("--output", f"{path} cannot be written: {parent} is a file")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vembed eval", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
