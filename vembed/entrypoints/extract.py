"""Teacher embeddings, extracted once, in shards (`vembed.data.embedding_shards`):

- for blip3o_dit: `vembed extract --teacher-a EVA --teacher-b CLIP --images DIR --out DIR` runs both vision encoders
  over every image and writes their patch tokens. Any transformers vision model (or the vision tower of a CLIP-like
  model) can be a teacher; images that cannot be read are skipped and counted.
- for embedding distillation (loss_type embedding_mse): `vembed extract --teacher MODEL --recipe RECIPE --out DIR`
  embeds the query text of every training row of the recipe with a text model (any folder vembed can load).

Under `accelerate launch` each process takes shards round-robin (shard i → rank i mod world), so no two processes
ever write one file; shards already complete are skipped, so an interrupted extraction resumes where it stopped.
The work is `vembed.extraction`; this module parses and reports.
"""

from __future__ import annotations

import argparse
import sys

try:
    from vembed.errors import RecipeError

    # the extraction itself: vembed/extraction.py
    from vembed.extraction import DTYPES, extract, extract_teacher_embeddings
except ModuleNotFoundError as missing:  # this file run from a clone whose vembed was never installed
    if missing.name != "vembed":
        raise
    sys.exit(f"vembed is not installed for {sys.executable}: run `pip install -e .` in the repository root first")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--teacher-a", "--teacher_a", help="blip3o_dit: condition encoder (e.g. EVA-CLIP): hub id "
                                                           "or folder")
    parser.add_argument("--teacher-b", "--teacher_b", help="blip3o_dit: target encoder (e.g. CLIP ViT): hub id or "
                                                           "folder")
    parser.add_argument("--images", nargs="+", help="blip3o_dit: image directories and/or .tar archives")
    parser.add_argument("--teacher", help="embedding_mse: the text teacher, a model folder vembed can load (vembed, "
                                          "sentence-transformers or transformers) or a cached hub id")
    parser.add_argument("--recipe", help="embedding_mse: the recipe whose data.train rows the teacher embeds (their "
                                         "query text)")
    parser.add_argument("--out", required=True, help="shard directory to write (resumes when it has shards)")
    parser.add_argument("--shard-size", "--shard_size", type=int, default=None,
                        help="images (default 1000) or rows (default 10000) per shard")
    parser.add_argument("--batch-size", "--batch_size", type=int, default=32, help="items encoded at once (default 32)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="stored precision (default: float16 for images, float32 for text teachers)")
    parser.add_argument("--tokens", choices=["patch", "all"], default="patch",
                        help="patch: drop CLS/register tokens before the patch grid; all: keep every token")
    parser.add_argument("--trust-remote-code", "--trust_remote_code", action="store_true",
                        help="let the teacher's folder run Python code it ships (only for folders you trust)")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error instead of one line")


def run(args: argparse.Namespace) -> int:
    from vembed.entrypoints import quiet_libraries, run_cli

    def body() -> int:
        text = _mode(args) == "text"
        shard_size = args.shard_size if args.shard_size is not None else 10000 if text else 1000
        if shard_size < 1 or args.batch_size < 1:
            raise RecipeError("--shard-size" if shard_size < 1 else "--batch-size", "must be at least 1")
        quiet_libraries()
        if text:
            result = extract_teacher_embeddings(teacher=args.teacher, recipe=args.recipe, out=args.out,
                                                shard_size=shard_size, batch_size=args.batch_size,
                                                dtype=args.dtype or "float32",
                                                trust_remote_code=args.trust_remote_code)
            index = result.get("index")
            if index is not None:
                print(f"{args.out}: {index['num_rows']} rows of {len(index['files'])} file(s) embedded by "
                      f"{args.teacher} ({index['dim']} dims) in {len(index['shards'])} shard(s); this process "
                      f"skipped {len(result['skipped_finished'])} finished shard(s)")
            return 0
        result = extract(teacher_a=args.teacher_a, teacher_b=args.teacher_b, images=args.images, out=args.out,
                         shard_size=shard_size, batch_size=args.batch_size, dtype=args.dtype or "float16",
                         tokens=args.tokens, trust_remote_code=args.trust_remote_code)
        index = result.get("index")
        if index is not None:
            print(f"{args.out}: {index['num_samples']} pairs in {len(index['shards'])} shard(s), eva "
                  f"{index['eva_shape']}, clip {index['clip_shape']}; {index['num_skipped_images']} unreadable "
                  f"image(s) skipped; this process skipped {len(result['skipped_finished'])} finished shard(s)")
        return 0

    return run_cli(body, args.debug)


def _mode(args: argparse.Namespace) -> str:
    """"text" (--teacher, --recipe) or "images" (--teacher-a, --teacher-b, --images); a mix or a half is refused."""
    text = {"--teacher": args.teacher, "--recipe": args.recipe}
    images = {"--teacher-a": args.teacher_a, "--teacher-b": args.teacher_b, "--images": args.images}
    given = [flag for flag, value in {**text, **images}.items() if value]
    if any(text.values()) and any(images.values()):
        raise RecipeError(given[0], f"give either --teacher and --recipe (a text teacher) or --teacher-a, --teacher-b "
                                    f"and --images (blip3o_dit), not both ({', '.join(given)})")
    wanted = text if any(text.values()) else images
    missing = [flag for flag, value in wanted.items() if not value]
    if missing:
        raise RecipeError(missing[0], "is required" + (" with --teacher/--recipe" if wanted is text else
                                                       " (or give --teacher and --recipe for a text teacher)"))
    return "text" if wanted is text else "images"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vembed extract", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
