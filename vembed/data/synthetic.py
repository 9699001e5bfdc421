"""Offline datasets for the demo and the tests: real handwritten digits, or coloured shapes, with captions.

Each generator writes, under `out_dir`: train/validation/test.jsonl, images/*.png, classes.json (label -> zero-shot
prompt), a tokenizer/ folder trained on every caption, and dataset.json (what was generated, with which settings).
It builds everything in a hidden sibling folder and renames it into place at the end, so an interrupted run never
leaves a half-written `out_dir`. Calling again with the same settings reuses the existing folder.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from vembed.errors import DataError

SPLITS = ("train", "validation", "test")
SUMMARY_FILE = "dataset.json"

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
DIGIT_CLASS_PROMPT = "a handwritten digit {word}"
DIGIT_TEMPLATES = (
    "a handwritten digit {word}",
    "the number {digit} written by hand",
    "a scanned image of a {digit}",
    "digit {word}",
    "a handwritten {digit}",
    "the digit {word}, written with a pen",
    "a small blurry picture of the number {digit}",
    "someone wrote the number {word}",
)

SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (235, 200, 30)}
POSITIONS = {  # caption phrase, centre as a fraction of the image size
    "left": ("on the left", (0.3, 0.5)),
    "right": ("on the right", (0.7, 0.5)),
    "top": ("at the top", (0.5, 0.3)),
    "bottom": ("at the bottom", (0.5, 0.7)),
    "center": ("in the middle", (0.5, 0.5)),
}
SHAPE_CLASS_PROMPT = "a {colour} {shape}"
SHAPE_TEMPLATES = (
    "a {colour} {shape} {where}",
    "a picture of a {colour} {shape}",
    "a {shape} coloured {colour}",
    "one {colour} {shape} {where} on a grey background",
    "a drawing of a {colour} {shape}",
    "{colour} {shape}",
)


# --- shared plumbing -----------------------------------------------------------------------------------------------


def _reusable(out_dir: Path, spec: dict[str, Any]) -> dict[str, Any] | None:
    """The summary of an existing folder built with the same spec; refuses to replace a folder that is not ours."""
    if not out_dir.exists():
        return None
    summary_file = out_dir / SUMMARY_FILE
    if summary_file.is_file():
        stored = json.loads(summary_file.read_text())
        if stored.get("spec") == spec:
            return _summary(out_dir, stored)
        foreign = _not_written_by_us(out_dir, stored)
        if foreign:
            raise DataError(f"holds {', '.join(foreign[:3])}, not written by vembed; rebuilding it with other settings "
                            "would delete them: choose another folder, or move them away", file=str(out_dir))
        return None  # ours, other settings: rebuilt and replaced
    if out_dir.is_dir() and not any(out_dir.iterdir()):
        return None
    raise DataError(
        f"exists and is not a vembed synthetic dataset (no {SUMMARY_FILE}); choose another folder or empty it",
        file=str(out_dir),
    )


def _not_written_by_us(out_dir: Path, stored: dict[str, Any]) -> list[str]:
    """What a folder of ours holds beside what `_finish` and the image loop wrote (a rebuild replaces the folder)."""
    written = {f"{split}.jsonl" for split in SPLITS} | {"images", "classes.json", "tokenizer", SUMMARY_FILE}
    foreign = sorted(path.name for path in out_dir.iterdir() if path.name not in written)
    images = out_dir / "images"
    if images.is_dir() and sum(1 for _ in images.iterdir()) != stored.get("num_images"):
        foreign.append("images/ (other than the generated ones)")
    return foreign


@contextmanager
def _building(out_dir: Path) -> Iterator[Path]:
    """A temporary sibling of `out_dir` to write into; renamed to `out_dir` only when the body finished."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        yield tmp
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            out_dir.rename(old / "data")
            tmp.rename(out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    with path.open("w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


def _finish(
    tmp: Path, spec: dict[str, Any], records: dict[str, list[dict]], classes: dict[str, str], num_images: int
) -> dict[str, Any]:
    """Write the splits, classes.json, the tokenizer and dataset.json into the temporary folder."""
    from vembed.data.tokenizer import train_tokenizer

    for split, rows in records.items():
        _write_jsonl(tmp / f"{split}.jsonl", rows)
    (tmp / "classes.json").write_text(json.dumps(classes, indent=2))
    texts = [row["query"] for rows in records.values() for row in rows]
    texts += [neg for rows in records.values() for row in rows for neg in row.get("negatives", [])]
    texts += list(classes.values())
    train_tokenizer(texts, tmp / "tokenizer")
    stored = {
        "spec": spec,
        "counts": {split: len(rows) for split, rows in records.items()},
        "num_images": num_images,
        "num_classes": len(classes),
    }
    (tmp / SUMMARY_FILE).write_text(json.dumps(stored, indent=2))
    return stored


def _summary(out_dir: Path, stored: dict[str, Any]) -> dict[str, Any]:
    return {
        **stored["spec"],
        **stored["counts"],
        "num_images": stored["num_images"],
        "num_classes": stored["num_classes"],
        "out_dir": str(out_dir),
        "files": {split: str(out_dir / f"{split}.jsonl") for split in SPLITS},
        "image_root": str(out_dir),
        "classes": str(out_dir / "classes.json"),
        "tokenizer": str(out_dir / "tokenizer"),
    }


# --- handwritten digits --------------------------------------------------------------------------------------------


def make_digits_dataset(out_dir: str | os.PathLike, image_size: int = 32, seed: int = 0) -> dict[str, Any]:
    """scikit-learn's 1797 real 8x8 handwritten digits, upscaled (bicubic) to `image_size` RGB PNGs, with captions.

    Split by image ~70/15/15, stratified by digit, fixed by `seed`. Records:
    `{"query": "the number 7 written by hand", "positive_image": "images/0007.png", "label": "7"}`.
    classes.json maps "0".."9" to "a handwritten digit zero".."nine". Returns a summary dict (counts, paths).
    """
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    out_dir = Path(out_dir)
    spec = {"name": "digits", "image_size": image_size, "seed": seed}
    existing = _reusable(out_dir, spec)
    if existing is not None:
        return existing

    digits = load_digits()
    indices = np.arange(len(digits.target))
    train, rest = train_test_split(indices, test_size=0.3, stratify=digits.target, random_state=seed)
    validation, test = train_test_split(rest, test_size=0.5, stratify=digits.target[rest], random_state=seed)
    rng = np.random.default_rng(seed)
    template_of = rng.integers(len(DIGIT_TEMPLATES), size=len(indices))

    with _building(out_dir) as tmp:
        (tmp / "images").mkdir()
        for i in indices:
            pixels = np.clip(digits.images[i] * (255.0 / 16.0), 0, 255).round().astype(np.uint8)
            image = Image.fromarray(pixels).resize((image_size, image_size), Image.Resampling.BICUBIC).convert("RGB")
            image.save(tmp / "images" / f"{i:04d}.png")
        records = {}
        for split, members in zip(SPLITS, (train, validation, test)):
            rows = []
            for i in sorted(members.tolist()):
                digit = int(digits.target[i])
                caption = DIGIT_TEMPLATES[template_of[i]].format(word=DIGIT_WORDS[digit], digit=digit)
                rows.append({"query": caption, "positive_image": f"images/{i:04d}.png", "label": str(digit)})
            records[split] = rows
        classes = {str(d): DIGIT_CLASS_PROMPT.format(word=word) for d, word in enumerate(DIGIT_WORDS)}
        stored = _finish(tmp, spec, records, classes, num_images=len(indices))
    return _summary(out_dir, stored)


# --- coloured shapes -----------------------------------------------------------------------------------------------


def _draw_shape(shape: str, colour: tuple[int, int, int], centre: tuple[float, float], radius: float, size: int, rng):
    import numpy as np
    from PIL import Image, ImageDraw

    background = rng.integers(170, 226)
    noise = rng.normal(0, 6, size=(size, size, 1))
    pixels = np.clip(background + noise, 0, 255).astype(np.uint8).repeat(3, axis=2)
    image = Image.fromarray(pixels)
    draw = ImageDraw.Draw(image)
    x, y = centre
    if shape == "circle":
        draw.ellipse((x - radius, y - radius, x + radius, y + radius), fill=colour)
    elif shape == "square":
        draw.rectangle((x - radius, y - radius, x + radius, y + radius), fill=colour)
    else:
        draw.polygon(((x, y - radius), (x - radius, y + radius * 0.8), (x + radius, y + radius * 0.8)), fill=colour)
    return image


def make_dummy_dataset(
    out_dir: str | os.PathLike, num_samples: int, seed: int = 0, image_size: int = 32
) -> dict[str, Any]:
    """`num_samples` synthetic images of a coloured shape (3 shapes x 4 colours, 5 positions) with matching captions.

    Split ~70/15/15 by image, fixed by `seed`. Records: `{"query": "a red circle on the left", "positive_image":
    "images/00000.png", "label": "circle-red", "negatives": [caption of the same shape in another colour, caption of
    another shape in the same colour]}`. classes.json maps each label to "a red circle". Returns a summary dict.
    """
    import numpy as np

    if num_samples < 3:
        raise ValueError(f"num_samples must be at least 3 (one per split), got {num_samples}")
    out_dir = Path(out_dir)
    spec = {"name": "dummy", "num_samples": num_samples, "image_size": image_size, "seed": seed}
    existing = _reusable(out_dir, spec)
    if existing is not None:
        return existing

    rng = np.random.default_rng(seed)
    colours, positions = list(COLOURS), list(POSITIONS)
    order = rng.permutation(num_samples)
    n_val = n_test = max(1, round(0.15 * num_samples))
    n_train = num_samples - n_val - n_test
    split_of = {}
    for rank, i in enumerate(order.tolist()):
        split_of[i] = "train" if rank < n_train else "validation" if rank < n_train + n_val else "test"

    with _building(out_dir) as tmp:
        (tmp / "images").mkdir()
        records: dict[str, list[dict]] = {split: [] for split in SPLITS}
        for i in range(num_samples):
            shape, colour, position = SHAPES[rng.integers(3)], colours[rng.integers(4)], positions[rng.integers(5)]
            where, (fx, fy) = POSITIONS[position]
            jitter = rng.uniform(-0.05, 0.05, size=2) * image_size
            centre = (fx * image_size + jitter[0], fy * image_size + jitter[1])
            radius = rng.uniform(0.14, 0.22) * image_size
            image = _draw_shape(shape, COLOURS[colour], centre, radius, image_size, rng)
            name = f"images/{i:05d}.png"
            image.save(tmp / name)
            template = SHAPE_TEMPLATES[rng.integers(len(SHAPE_TEMPLATES))]
            other_colour = colours[(colours.index(colour) + 1 + rng.integers(3)) % 4]
            other_shape = SHAPES[(SHAPES.index(shape) + 1 + rng.integers(2)) % 3]
            records[split_of[i]].append(
                {
                    "query": template.format(colour=colour, shape=shape, where=where),
                    "positive_image": name,
                    "label": f"{shape}-{colour}",
                    "negatives": [
                        template.format(colour=other_colour, shape=shape, where=where),
                        template.format(colour=colour, shape=other_shape, where=where),
                    ],
                }
            )
        classes = {f"{s}-{c}": SHAPE_CLASS_PROMPT.format(colour=c, shape=s) for s in SHAPES for c in colours}
        stored = _finish(tmp, spec, records, classes, num_images=num_samples)
    return _summary(out_dir, stored)
