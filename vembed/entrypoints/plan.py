"""Estimate per-device memory of a recipe under each strategy and recommend one:
`vembed plan RECIPE --gpus N --gpu-memory GB [--config_override k=v ...]`. Reads configs only, never weights."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="YAML recipe (see configs/)")
    parser.add_argument("--gpus", type=int, default=1, help="devices the run will use (all machines together)")
    parser.add_argument("--gpu-memory", "--gpu_memory", type=float, required=True, metavar="GB",
                        help="memory of one device in GiB, e.g. 80 for an 80 GB A100/H100")
    parser.add_argument(
        "--config-override", "--config_override", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
        help="override recipe keys, as for training: batch_size=256 use_lora=true",
    )
    parser.add_argument("--debug", action="store_true", help="show Python tracebacks for recipe errors")


def run(args: argparse.Namespace) -> int:
    from vembed.entrypoints import quiet_libraries, run_cli

    def body() -> int:
        from vembed.components import load_recipe
        from vembed.planning import format_plan, make_plan

        recipe = load_recipe(args.recipe, args.config_override)
        quiet_libraries()
        print(format_plan(make_plan(recipe, args.gpus, args.gpu_memory, recipe_path=args.recipe)))
        return 0

    return run_cli(body, args.debug)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vembed plan", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
