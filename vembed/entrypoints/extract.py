"""Paired teacher embeddings for blip3o_dit: `vembed extract --teacher-a EVA --teacher-b CLIP --images DIR --out DIR`.

Runs both vision encoders over every image and writes their patch tokens in shards (`vembed.data.embedding_shards`).
Under `accelerate launch` each process takes shards round-robin (shard i → rank i mod world), so no two processes
ever write one file; shards already complete are skipped, so an interrupted extraction resumes where it stopped.
Images that cannot be read are skipped and counted. Any transformers vision model (or the vision tower of a
CLIP-like model) can be a teacher. The work is `vembed.extraction.extract`; this module parses and reports.
"""

from __future__ import annotations

import argparse
import sys

try:
    from vembed.errors import RecipeError
    from vembed.extraction import DTYPES, extract  # the extraction itself: vembed/extraction.py
except ModuleNotFoundError as missing:  # this file run from a clone whose vembed was never installed
    if missing.name != "vembed":
        raise
    sys.exit(f"vembed is not installed for {sys.executable}: run `pip install -e .` in the repository root first")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--teacher-a", "--teacher_a", required=True,
                        help="condition encoder (e.g. EVA-CLIP): hub id or folder")
    parser.add_argument("--teacher-b", "--teacher_b", required=True,
                        help="target encoder (e.g. CLIP ViT): hub id or folder")
    parser.add_argument("--images", required=True, nargs="+", help="image directories and/or .tar archives")
    parser.add_argument("--out", required=True, help="shard directory to write (resumes when it has shards)")
    parser.add_argument("--shard-size", "--shard_size", type=int, default=1000, help="images per shard")
    parser.add_argument("--batch-size", "--batch_size", type=int, default=32)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float16", help="stored precision")
    parser.add_argument("--tokens", choices=["patch", "all"], default="patch",
                        help="patch: drop CLS/register tokens before the patch grid; all: keep every token")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--debug", action="store_true")


def run(args: argparse.Namespace) -> int:
    from vembed.entrypoints import quiet_libraries, run_cli

    def body() -> int:
        if args.shard_size < 1 or args.batch_size < 1:
            raise RecipeError("--shard-size" if args.shard_size < 1 else "--batch-size", "must be at least 1")
        quiet_libraries()
        result = extract(teacher_a=args.teacher_a, teacher_b=args.teacher_b, images=args.images, out=args.out,
                         shard_size=args.shard_size, batch_size=args.batch_size, dtype=args.dtype,
                         tokens=args.tokens, trust_remote_code=args.trust_remote_code)
        index = result.get("index")
        if index is not None:
            print(f"{args.out}: {index['num_samples']} pairs in {len(index['shards'])} shard(s), eva "
                  f"{index['eva_shape']}, clip {index['clip_shape']}; {index['num_skipped_images']} unreadable "
                  f"image(s) skipped; this process skipped {len(result['skipped_finished'])} finished shard(s)")
        return 0

    return run_cli(body, args.debug)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vembed extract", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
