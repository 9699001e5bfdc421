"""The offline demo: real handwritten digits, a tiny CLIP built from a config, trained on CPU in a few minutes.

`vembed demo` makes the data (scikit-learn's digits, captions from templates, a tokenizer trained on them), trains
with `configs/demo_clip.yaml` (shipped in the package, so an installed vembed runs it from any directory) through the
same launcher users run, then prints before/after retrieval metrics and zero-shot digit accuracy on the held-out test
split, and exports the model for sentence-transformers (final-st/, when sentence-transformers is installed: the
`demo` extra installs it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vembed.resources import demo_recipe


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", default=str(demo_recipe()),
                        help="recipe to train (default: the shipped demo_clip.yaml, as configs/demo_clip.yaml)")
    parser.add_argument("--config-override", "--config_override", nargs="+", action="extend", default=[],
                        metavar="KEY=VALUE", help="override recipe keys, e.g. epochs=2")
    parser.add_argument("--data-dir", "--data_dir", default="runs/demo/data",
                        help="where the digits data set is written")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error instead of one line")


def _test_figures(adapter, examples, prompts: dict, batch_size: int) -> tuple[float, float]:
    """Zero-shot digit accuracy and text→image accuracy@1 on the test split."""
    from vembed.evaluation.pairs import evaluate_retrieval, zero_shot_accuracy

    hit_rate = evaluate_retrieval(adapter, examples, batch_size=batch_size)["q2d/accuracy@1"]
    return zero_shot_accuracy(adapter, examples, prompts, batch_size=batch_size), hit_rate


def run(args: argparse.Namespace) -> int:
    from vembed.entrypoints import quiet_libraries, run_cli

    def body() -> int:
        quiet_libraries()
        from vembed.components import load_recipe
        from vembed.entrypoints import launch
        from vembed.recipe_checks import check_recipe

        data_dir = Path(args.data_dir)
        if not (data_dir / "classes.json").is_file():
            from vembed.data.synthetic import make_digits_dataset

            print(f"making the digits data set in {data_dir} ...", file=sys.stderr)
            make_digits_dataset(data_dir)
        overrides = [f"data.train={data_dir}/train.jsonl", f"data.validation={data_dir}/validation.jsonl",
                     f"data.test={data_dir}/test.jsonl", f"tokenizer_name={data_dir}/tokenizer"]
        if not any(o.startswith("resume_from=") for o in args.config_override):
            overrides.append("overwrite_output_dir=true")  # the demo trains from scratch each time it is run
        overrides += args.config_override
        recipe = load_recipe(args.recipe, overrides)
        check_recipe(recipe)

        # The untrained model: same seed, same init as the first training step sees.
        from accelerate.utils import set_seed

        from vembed.components import model_class
        from vembed.data.sources import load_examples

        set_seed(recipe.seed)
        untrained = model_class(recipe).from_recipe(recipe)
        test_examples, _ = load_examples(recipe.data, "test", num_hard_negatives=0)
        prompts = json.loads((data_dir / "classes.json").read_text())
        batch_size = recipe.resolved_eval_batch_size
        before, hits_before = _test_figures(untrained, test_examples, prompts, batch_size)
        del untrained

        code = launch.main([args.recipe, "--config_override", *overrides, *(["--debug"] if args.debug else [])])
        if code != 0:
            return code

        from vembed.models.base import load_adapter

        final_dir = Path(recipe.output_dir) / "final"
        after, hits_after = _test_figures(load_adapter(final_dir), test_examples, prompts, batch_size)
        metrics = json.loads((Path(recipe.output_dir) / "metrics.json").read_text())
        summary = {
            "zero_shot_accuracy": {"before": before, "after": after},
            "test_text_to_image_accuracy@1": {"before": hits_before, "after": hits_after},
            "test": metrics["test"],
        }
        exported = _export(final_dir)
        if exported:
            summary["sentence_transformers_export"] = str(exported)
        from vembed.files import write_json_atomic

        write_json_atomic(Path(recipe.output_dir) / "demo_summary.json", summary)
        _print_table(summary, recipe.output_dir)
        return 0

    return run_cli(body, args.debug)


def _export(final_dir: Path) -> Path | None:
    try:
        import sentence_transformers  # noqa: F401
    except ImportError:
        return None
    from vembed.export import export_sentence_transformers

    # The demo trains from scratch each run (overwrite_output_dir), so its export is replaced too.
    return export_sentence_transformers(final_dir, str(final_dir) + "-st", overwrite=True)


def _print_table(summary: dict, output_dir: str) -> None:
    zs, r1 = summary["zero_shot_accuracy"], summary["test_text_to_image_accuracy@1"]
    if "sentence_transformers_export" in summary:
        outputs = "final/, final-st/, metrics.json, loss_curve.png, demo_summary.json"
    else:
        outputs = ("final/, metrics.json, loss_curve.png, demo_summary.json; no final-st/: sentence-transformers is "
                   "not installed (pip install -e .[demo])")
    lines = [
        "",
        "digits demo — held-out test split",
        f"{'metric':<34}{'before':>10}{'after':>10}",
        f"{'zero-shot digit accuracy':<34}{zs['before']:>10.3f}{zs['after']:>10.3f}",
        f"{'text→image accuracy@1 (same digit)':<34}{r1['before']:>10.3f}{r1['after']:>10.3f}",
        f"outputs: {output_dir}/ ({outputs})",
    ]
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vembed demo", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
