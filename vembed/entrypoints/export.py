"""Export a saved model: `vembed export MODEL_DIR --format sentence-transformers --out DIR`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", help="a folder saved by vembed (e.g. runs/demo/final)")
    parser.add_argument("--format", default="sentence-transformers", choices=["sentence-transformers"],
                        help="what to export to (a folder SentenceTransformer(OUT) loads)")
    parser.add_argument("--out", help="output folder (default: MODEL_DIR-st)")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it holds an earlier export")
    parser.add_argument("--trust-remote-code", "--trust_remote_code", action="store_true",
                        help="let the model folder run Python code it ships (only for folders you trust)")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error instead of one line")


def run(args: argparse.Namespace) -> int:
    from vembed.entrypoints import quiet_libraries, run_cli

    def body() -> int:
        from vembed.models.foreign import require_embedder

        if Path(args.model_dir).is_dir():  # export reads vembed folders only: a hub id is never fetched
            require_embedder(args.model_dir, instead="export writes embedding models as sentence-transformers "
                                                     "folders (a cross-encoder vembed trains loads in "
                                                     "sentence-transformers' CrossEncoder as it is saved)")
        quiet_libraries()
        from vembed.export import export_sentence_transformers

        out = args.out or str(args.model_dir).rstrip("/") + "-st"
        path = export_sentence_transformers(args.model_dir, out, trust_remote_code=args.trust_remote_code,
                                            overwrite=args.overwrite)
        print(f"exported to {path}")
        return 0

    return run_cli(body, args.debug)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vembed export", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
