"""Train from a recipe: `accelerate launch -m vembed.entrypoints.train RECIPE.yaml [--config_override k=v ...]`.

From a clone, `accelerate launch vembed/entrypoints/train.py RECIPE.yaml` runs the same, once vembed is installed
(`pip install -e .`): the file imports vembed like any other user of it, it does not put the clone on sys.path.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

try:
    from vembed.entrypoints import quiet_libraries, run_cli
except ModuleNotFoundError as missing:  # this file run from a clone whose vembed was never installed
    if missing.name != "vembed":
        raise
    sys.exit(f"vembed is not installed for {sys.executable}: run `pip install -e .` in the repository root first")

if TYPE_CHECKING:
    from vembed.recipe import Recipe


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="YAML recipe (see configs/)")
    parser.add_argument(
        "--config-override", "--config_override", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
        help="override recipe keys, dotted for nested ones: learning_rate=1e-4 data.train=my.jsonl",
    )
    parser.add_argument("--debug", action="store_true", help="show Python tracebacks for recipe/data errors")


def run(args: argparse.Namespace) -> int:
    def body() -> int:
        from vembed.components import load_recipe
        from vembed.recipe_checks import check_recipe
        from vembed.training.launch_promise import stop_with_launcher

        stop_with_launcher()  # a rank never outlives the launcher that started it

        recipe = load_recipe(args.recipe, args.config_override)
        check_recipe(recipe)  # everything is validated before a model is built or output_dir is created
        return train(recipe)

    return run_cli(body, args.debug)


def train(recipe: "Recipe") -> int:
    """Train a recipe that has been checked (`check_recipe`), in this process; also what run.py / `vembed train` run
    when the launch is one plain process."""
    quiet_libraries()
    from vembed.training.loop import Trainer
    from vembed.training.threads import use_threads

    # Every door trains through here: threads follow the cores, not the 1 a launcher put in OMP_NUM_THREADS.
    trainer = Trainer(recipe, threads=use_threads())
    try:
        trainer.run()  # returns on every rank together (a barrier after rank 0's last write)
    finally:
        trainer.accelerator.end_training()  # tears down the process group; gloo runs can abort without it
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vembed train", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
