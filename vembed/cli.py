"""The `vembed` command: train | eval | search | rerank | fuse | predict | export | plan | bench | extract | mine |
data | demo | demo-vision."""

from __future__ import annotations

import argparse
import json
import os
import sys

MIN_DUMMY_SAMPLES = 3  # one per split
MIN_IMAGE_SIZE = 8  # the smallest image the dummy shapes and the digits are drawn into legibly


def _data_command(args: argparse.Namespace) -> int:
    from vembed.entrypoints import run_cli

    def body() -> int:
        from vembed.data import synthetic
        from vembed.errors import RecipeError

        if args.kind == "index":
            return _index_command(args.paths)
        if args.out is None:
            raise RecipeError("--out", f"`vembed data {args.kind}` needs --out DIR, the folder to write")
        _check_data_arguments(args)
        if args.kind == "webdataset":
            from vembed.data.shard_writer import write_webdataset

            summary = write_webdataset(args.out, args.source, num_samples=args.num_samples,
                                       image_size=args.image_size, seed=args.seed, shard_size=args.shard_size)
        elif args.kind == "digits":
            summary = synthetic.make_digits_dataset(args.out, image_size=args.image_size, seed=args.seed)
        else:
            summary = synthetic.make_dummy_dataset(args.out, args.num_samples, seed=args.seed,
                                                   image_size=args.image_size)
        print(f"wrote {args.kind} data to {args.out}: {summary}")
        return 0

    return run_cli(body, args.debug)


def _check_data_arguments(args: argparse.Namespace) -> None:
    """Out-of-range numbers are one line here, not a ValueError from deep inside the generators."""
    from vembed.errors import RecipeError

    makes_dummy = args.kind == "dummy" or (args.kind == "webdataset" and args.source == "dummy")
    if makes_dummy and args.num_samples < MIN_DUMMY_SAMPLES:
        raise RecipeError("--num-samples", f"must be at least {MIN_DUMMY_SAMPLES} (one record per split: train, "
                                           f"validation, test), got {args.num_samples}")
    if args.image_size < MIN_IMAGE_SIZE:
        raise RecipeError("--image-size", f"must be at least {MIN_IMAGE_SIZE} pixels, got {args.image_size}")
    if args.kind == "webdataset" and args.shard_size < 1:
        raise RecipeError("--shard-size", f"must be at least 1, got {args.shard_size}")
    existing = os.path.abspath(args.out)  # the folder, or the nearest one above it that exists, must be a folder
    while not os.path.exists(existing) and existing != os.path.dirname(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise RecipeError("--out", f"{args.out} cannot be a folder: {existing} is a file; name a folder")


def _index_command(paths: list[str]) -> int:
    """sizes.json beside tar shards (or data files) that lack one: each is read once and its samples counted (an
    img2dataset shard's `_stats.json` gives its count without reading it)."""
    from vembed.data.streaming import TAR_EXTENSION, expand_sources, index_shards, require_backend, write_sizes
    from vembed.errors import RecipeError

    key = "vembed data index"
    if not paths:
        raise RecipeError(key, "give the shards: a directory, glob or files (e.g. shards/)")
    files = []
    for path in paths:  # each argument must name something: a typo is named, not dropped
        found = expand_sources(path)
        absent = next((name for name in found if not os.path.isfile(name)), None)
        if absent is not None:
            raise RecipeError(key, f"{absent} {'is a folder of folders' if os.path.isdir(absent) else 'not found'}; "
                                   "give the shards: a directory, glob or files (e.g. shards/)")
        if not found:
            why = f"holds no {TAR_EXTENSION} shards" if os.path.isdir(path) else "matches no files"
            raise RecipeError(key, f"{path} {why}; give the shards: a directory, glob or files (e.g. shards/)")
        files += found
    if all(name.endswith(TAR_EXTENSION) for name in files):
        require_backend("webdataset", key)
    counts = index_shards(files)
    for written in write_sizes(counts):
        total = sum(json.loads(open(written).read()).values())
        print(f"wrote {written}: {total} samples")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from vembed.entrypoints import (
        bench_strategies,
        demo,
        demo_vision,
        evaluate,
        export,
        extract,
        fuse,
        launch,
        mine,
        plan,
        predict,
        rerank,
        search,
    )

    parser = argparse.ArgumentParser(prog="vembed", description="Fine-tune embedding models from a YAML recipe.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train from a recipe (launches accelerate for you, like run.py)")
    launch.add_arguments(train)
    train.set_defaults(func=launch.run, command_name="vembed train")

    ev = sub.add_parser("eval", help="retrieval metrics of a saved model (or a run file) on a data file or corpus")
    evaluate.add_arguments(ev)
    ev.set_defaults(func=evaluate.run)

    for name, module, help_text in (
            ("search", search, "search a corpus folder with a saved model (or bm25) and write the run file"),
            ("rerank", rerank, "reorder a run's candidates with a reranker (or a ColBERT) and write the run file"),
            ("fuse", fuse, "fuse run files into one (reciprocal rank fusion, weighted sums, ...; ranx)"),
            ("predict", predict, "classify images with a saved image classifier and write the top classes as CSV")):
        command = sub.add_parser(name, help=help_text, description=module.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(command)
        command.set_defaults(func=module.run)

    ex = sub.add_parser("export", help="export a saved model (sentence-transformers)")
    export.add_arguments(ex)
    ex.set_defaults(func=export.run)

    pl = sub.add_parser("plan", help="estimate per-device memory of each strategy and recommend one (no weights read)")
    plan.add_arguments(pl)
    pl.set_defaults(func=plan.run)

    bench = sub.add_parser("bench", help="measure: `vembed bench strategies RECIPE` compares every launch")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    strategies = bench_sub.add_parser("strategies", help="the recipe for N steps under every launch available here")
    bench_strategies.add_arguments(strategies)
    strategies.set_defaults(func=bench_strategies.run)

    xt = sub.add_parser("extract", help="teacher embeddings in shards: EVA → CLIP pairs for blip3o_dit, or a text "
                                        "teacher's embeddings of a recipe's rows for embedding_mse")
    extract.add_arguments(xt)
    xt.set_defaults(func=extract.run)

    mn = sub.add_parser("mine", help="hard negatives for training: a saved model's nearest non-relevant documents of "
                                     "each query of a corpus folder")
    mine.add_arguments(mn)
    mn.set_defaults(func=mine.run)

    data = sub.add_parser("data", help="generate offline data sets")
    data.add_argument("kind", choices=["dummy", "digits", "webdataset", "index"],
                      help="dummy: coloured shapes; digits: scikit-learn digits; webdataset: one of those (--source) "
                           "with its training split as tar shards; index: write sizes.json for existing shards")
    data.add_argument("paths", nargs="*", help="index: the shards (a directory, glob or files)")
    data.add_argument("--out", help="output folder")
    data.add_argument("--source", choices=["digits", "dummy"], default="digits", help="webdataset: which data set")
    data.add_argument("--shard-size", "--shard_size", type=int, default=128, help="webdataset: samples per shard")
    data.add_argument("--num-samples", "--num_samples", type=int, default=512, help="dummy: number of records")
    data.add_argument("--image-size", "--image_size", type=int, default=32, help="image side in pixels (default 32)")
    data.add_argument("--seed", type=int, default=0, help="the generator's seed (same seed, same files)")
    data.add_argument("--debug", action="store_true", help="show the traceback of an error instead of one line")
    data.set_defaults(func=_data_command)

    dm = sub.add_parser("demo", help="the offline demo: digits data, a tiny CLIP, train, evaluate, export")
    demo.add_arguments(dm)
    dm.set_defaults(func=demo.run)
    dv = sub.add_parser("demo-vision", help="the offline image demos: digit images, a tiny ViT, classification or "
                                            "image-to-image retrieval (--task i2i)")
    demo_vision.add_arguments(dv)
    dv.set_defaults(func=demo_vision.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv[1:]  # the command's own arguments: what `vembed eval --accelerate_config` hands its processes
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
