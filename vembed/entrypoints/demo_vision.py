"""The offline image demos: scikit-learn's handwritten digits as an ImageFolder tree, a tiny ViT built from a config
shipped in the package, trained on CPU in a minute or two through the launcher users run.

`--task classification` (`configs/demo_vision.yaml`): validation accuracy and macro F1 before and after, test
accuracy, and where the confusion matrix PNG is. `--task i2i` (`configs/demo_vision_i2i.yaml`, SupCon): image-to-image
retrieval within the held-out splits, recall@1 and MAP@R before and after."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vembed.resources import package_root

DIGIT_NAMES = [str(digit) for digit in range(10)]  # folder names; sorted as strings they stay in digit order


# --task -> the shipped recipe, the report's title, its rows ((metric key, label) for validation and test), its PNGs.
DEMOS = {
    "classification": ("demo_vision.yaml", "digits classification demo",
                       (("accuracy", "accuracy"), ("macro_f1", "macro F1")),
                       "confusion_matrix.png, reliability.png, loss_curve.png"),
    "i2i": ("demo_vision_i2i.yaml", "digits image-to-image retrieval demo (leave-one-out within each split)",
            (("recall_at_1", "recall@1"), ("mean_average_precision_at_r", "MAP@R")), "loss_curve.png"),
}


def demo_vision_recipe(task: str = "classification") -> Path:
    return package_root() / "configs" / DEMOS[task][0]


def write_digit_folders(out_dir: str | Path) -> dict[str, int]:
    """scikit-learn's 1797 digits as 32 px PNGs in `out_dir/{train,validation,test}/<digit name>/`: of each class,
    the first 60% train, the next 20% validation, the rest test. Returns the images per split."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    counts = {"train": 0, "validation": 0, "test": 0}
    for label, name in enumerate(DIGIT_NAMES):
        picks = np.flatnonzero(digits.target == label)
        cut = [int(len(picks) * 0.6), int(len(picks) * 0.8)]
        for split, part in zip(counts, np.split(picks, cut)):
            folder = Path(out_dir, split, name)
            folder.mkdir(parents=True, exist_ok=True)
            for i in part:
                pixels = (digits.images[i] * 255 / 16).astype(np.uint8)
                Image.fromarray(pixels).resize((32, 32), Image.NEAREST).save(folder / f"{i}.png")
            counts[split] += len(part)
    return counts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", choices=sorted(DEMOS), default="classification",
                        help="classification (demo_vision.yaml) or image-to-image retrieval by metric learning "
                             "(demo_vision_i2i.yaml)")
    parser.add_argument("--recipe", help="recipe to train (default: the task's shipped recipe)")
    parser.add_argument("--config-override", "--config_override", nargs="+", action="extend", default=[],
                        metavar="KEY=VALUE", help="override recipe keys, e.g. epochs=2")
    parser.add_argument("--data-dir", "--data_dir", default="runs/demo_vision/data",
                        help="where the digit images are written")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error instead of one line")


def run(args: argparse.Namespace) -> int:
    from vembed.entrypoints import quiet_libraries, run_cli

    def body() -> int:
        quiet_libraries()
        from vembed.components import load_recipe
        from vembed.entrypoints import launch
        from vembed.recipe_checks import check_recipe

        data_dir = Path(args.data_dir)
        if not (data_dir / "test").is_dir():
            print(f"writing the digit images to {data_dir} ...", file=sys.stderr)
            write_digit_folders(data_dir)
        overrides = [f"data.{split}={data_dir}/{split}" for split in ("train", "validation", "test")]
        overrides += ["overwrite_output_dir=true", "eval_before_training=true", *args.config_override]
        recipe_path = args.recipe or str(demo_vision_recipe(args.task))
        recipe = load_recipe(recipe_path, overrides)
        check_recipe(recipe)
        code = launch.main([recipe_path, "--config_override", *overrides, *(["--debug"] if args.debug else [])])
        if code != 0:
            return code
        metrics = json.loads((Path(recipe.output_dir) / "metrics.json").read_text())
        _print_table(metrics, recipe.output_dir, args.task)
        return 0

    return run_cli(body, args.debug)


def _print_table(metrics: dict, output_dir: str, task: str = "classification") -> None:
    _, title, rows, plots = DEMOS[task]
    before, after, test = metrics["before"], metrics["validation"], metrics.get("test", {})
    lines = ["", title, f"{'metric':<28}{'before':>10}{'after':>10}"]
    for key, label in rows:
        lines.append(f"{'validation ' + label:<28}{before[key]:>10.3f}{after[key]:>10.3f}")
    first_key, first_label = rows[0]
    if test:
        lines.append(f"{'test ' + first_label:<28}{'':>10}{test[first_key]:>10.3f}")
    if test.get("most_confused") is not None:
        pairs = ", ".join(f"{p['true']}→{p['predicted']} ({p['count']})" for p in test["most_confused"][:3])
        lines.append(f"most confused (test): {pairs or 'none'}")
    lines.append(f"outputs: {output_dir}/ (final/, metrics.json, {plots})")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vembed demo-vision", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
