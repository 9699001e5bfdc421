"""Tiny labelled-image data (scikit-learn's digits 0-2 as PNGs) and a tiny ViT classification recipe, shared by the
classification training tests and the predict tests (a plain module: `conftest` is ambiguous across folders)."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import yaml

VIT = {"model_type": "vit", "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2,
       "num_attention_heads": 4, "image_size": 32, "patch_size": 8}
CLASSES = ["zero", "one", "two"]


def write_digits(root: Path, per_class: int = 12, offset: int = 0) -> list[tuple[str, str]]:
    """scikit-learn's digits 0-2 as PNGs in `root/<class>/`; the (relative path, class) of each."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    rows = []
    for label, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True, exist_ok=True)
        picks = np.flatnonzero(digits.target == label)[offset:offset + per_class]
        for i in picks:
            pixels = (digits.images[i] * 255 / 16).astype(np.uint8)
            Image.fromarray(pixels).resize((32, 32)).save(root / name / f"{i}.png")
            rows.append((f"{name}/{i}.png", name))
    return rows


def write_digit_splits(root: Path) -> Path:
    """root/train as an ImageFolder tree (12 per class) and root/validation's 18 other digits with labels.csv."""
    write_digits(root / "train")
    rows = write_digits(root / "validation", per_class=6, offset=40)
    lines = ["image,label"] + [f"{path},{label}" for path, label in rows]
    (root / "validation" / "labels.csv").write_text("\n".join(lines) + "\n")
    return root


def digits_recipe(digits: Path, output_dir: Path, **changes) -> dict:
    """A tiny ViT classification recipe on `digits` (train/ as an ImageFolder tree, validation/labels.csv)."""
    raw = {"model_type": "vision", "model_config": {**VIT, "hidden_dropout_prob": 0.0,
                                                    "attention_probs_dropout_prob": 0.0},
           "loss_type": "cross_entropy", "label_smoothing": 0.1,
           "data": {"train": str(digits / "train"), "validation": str(digits / "validation" / "labels.csv")},
           "metric_for_best_model": "accuracy", "output_dir": str(output_dir), "batch_size": 6,
           "learning_rate": 2e-3, "max_steps": 6, "logging_steps": 2, "seed": 0, "save_total_limit": 1}
    raw.update(changes)
    return raw


def train_classifier(raw: dict, path: Path) -> int:
    """`raw` written to `path` and trained through the train entrypoint, in this process."""
    from vembed.entrypoints.train import run

    path.write_text(yaml.safe_dump(raw))
    return run(argparse.Namespace(recipe=str(path), config_override=[], debug=False))
