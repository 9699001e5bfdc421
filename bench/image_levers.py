"""Held-out figures of the classification levers (issue 38): EMA of weights, the augmentation policy and a frozen
backbone, each against the shipped digits demo, over several seeds, through the door users run (`vembed
demo-vision`, which launches `vembed train`).

    python bench/image_levers.py [--seeds 0 1 2] [--epochs 25] [--out runs/image_levers]

The demo is a tiny ViT from random init on scikit-learn's 1,797 digits (60/20/20 split per class), so the figures say
what each lever does to a small model trained from scratch, not to a pretrained backbone: EMA smooths the last epochs'
weights (decay 0.98: an average over about the last 50 steps, for runs of a few hundred);
TrivialAugment with random erasing regularises (digits are not flipped: a mirrored 2 is not a 2); the frozen
backbone is a linear probe of random features, the floor that fine-tuning the whole model lifts off.

Writes OUT/image_levers.json (every run's validation and test accuracy, macro F1 and calibration error) and prints a
Markdown table of means and standard deviations over seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

# name -> recipe overrides on top of the shipped demo (vembed/configs/demo_vision.yaml)
VARIANTS: dict[str, list[str]] = {
    "demo (baseline)": [],
    "ema_decay: 0.98": ["ema_decay=0.98"],  # an average over ~50 of the 160 steps of 10 epochs
    "trivial_augment + random_erasing 0.25": ["augmentation.trivial_augment=true",
                                              "augmentation.random_erasing=0.25"],
    "trivial_augment": ["augmentation.trivial_augment=true"],
    "random_erasing 0.25": ["augmentation.random_erasing=0.25"],
    "freeze_backbone (linear probe)": ["freeze_backbone=true"],
}
REPORTED = ("accuracy", "macro_f1", "ece")  # from metrics.json's test split


def run_variant(name: str, overrides: list[str], seed: int, epochs: int, out: Path, data_dir: Path) -> dict:
    """One `vembed demo-vision` training; its test metrics and wall time."""
    slug = "".join(c if c.isalnum() else "_" for c in name).strip("_")
    output_dir = out / f"{slug}_seed{seed}"
    command = [sys.executable, "-m", "vembed", "demo-vision", "--data-dir", str(data_dir), "--config-override",
               f"seed={seed}", f"epochs={epochs}", f"output_dir={output_dir}", *overrides]
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - started
    metrics = json.loads((output_dir / "metrics.json").read_text())
    test, validation = metrics["test"], metrics["validation"]
    return {"variant": name, "seed": seed, "epochs": epochs, "seconds": round(seconds, 1),
            **{f"test_{key}": test.get(key) for key in REPORTED},
            "validation_accuracy": validation.get("accuracy")}


def table(runs: list[dict]) -> str:
    lines = ["| variant | test accuracy | test macro F1 | test ECE | seeds | s per run |",
             "|---|---|---|---|---|---|"]
    for name in VARIANTS:
        mine = [r for r in runs if r["variant"] == name]
        if not mine:
            continue

        def cell(key: str) -> str:
            values = [r[key] for r in mine if r[key] is not None]
            if not values:
                return "n/a"
            spread = statistics.stdev(values) if len(values) > 1 else 0.0
            return f"{statistics.mean(values):.3f} ± {spread:.3f}"

        seconds = statistics.mean(r["seconds"] for r in mine)
        lines.append(f"| {name} | {cell('test_accuracy')} | {cell('test_macro_f1')} | {cell('test_ece')} | "
                     f"{len(mine)} | {seconds:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=25, help="the shipped demo's 25 by default")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--out", default="runs/image_levers")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "image_levers.json"
    runs = json.loads(results.read_text()) if results.is_file() else []
    done = {(r["variant"], r["seed"], r["epochs"]) for r in runs}
    for seed in args.seeds:
        for name in args.variants:
            if (name, seed, args.epochs) in done:
                continue  # resumable: a finished run is kept, not repeated
            runs.append(run_variant(name, VARIANTS[name], seed, args.epochs, out, out / "data"))
            results.write_text(json.dumps(runs, indent=2))
            print(f"{name} seed {seed}: test accuracy {runs[-1]['test_accuracy']:.3f} ({runs[-1]['seconds']:.0f} s)",
                  flush=True)
    print(table([r for r in runs if r["epochs"] == args.epochs]))


if __name__ == "__main__":
    main()
