"""Classify images with a saved classifier: `vembed predict MODEL_DIR IMAGES... --out predictions.csv [--top-k 5]`.

IMAGES are image files, folders of images, or labelled data as the recipe's `data.test` takes it (an ImageFolder
tree `<class>/<image>`, a CSV/JSONL/Parquet file with image and label columns, a `datasets` folder): then each row
also carries its true label, and the accuracy is printed. The CSV has one row per image: `image`, `true_label`
(empty when unknown), then `label_1, score_1, ... label_k, score_k` (class and probability, most probable first).
The predictions are the evaluation's (`vembed.load(MODEL_DIR).predict`): on a run's test split they count as its
confusion matrix does.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

TABLE_SUFFIXES = (".csv", ".tsv", ".jsonl", ".json", ".parquet")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="an image classifier saved by vembed (runs/x/final)")
    parser.add_argument("images", nargs="+", metavar="IMAGES",
                        help="image files, folders of images, or labelled data (an ImageFolder tree, a CSV/JSONL/"
                             "Parquet file of image and label columns, a datasets folder)")
    parser.add_argument("--out", required=True, help="the CSV to write")
    parser.add_argument("--top-k", "--top_k", type=int, default=1, help="classes written per image (default 1)")
    parser.add_argument("--batch-size", "--batch_size", type=int, default=32, help="images classified at once")
    parser.add_argument("--label-column", "--label_column", default="label",
                        help="labelled tables: the column holding the class (default label)")
    parser.add_argument("--image-root", "--image_root", help="labelled tables: folder relative image paths are "
                                                             "resolved against")
    parser.add_argument("--device", help="where to run (default: cuda when available, else cpu)")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    parser.add_argument("--trust-remote-code", "--trust_remote_code", action="store_true",
                        help="let the model folder run Python code it ships (only for folders you trust)")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error instead of one line")


def run(args: argparse.Namespace) -> int:
    from vembed.entrypoints import require_at_least_one, run_cli

    def body() -> int:
        from vembed.api import Classifier, load_model
        from vembed.entrypoints import quiet_libraries
        from vembed.errors import ArgumentError
        from vembed.files import check_output_file, replace_atomically
        from vembed.models.foreign import model_folder

        require_at_least_one(top_k=args.top_k, batch_size=args.batch_size)
        out = Path(args.out)
        check_output_file(out, args.overwrite, key="--out", kind="the CSV file to write")
        model_dir = model_folder(args.model_dir)
        quiet_libraries()
        model = load_model(model_dir, device=args.device, trust_remote_code=args.trust_remote_code)
        if not isinstance(model, Classifier):
            raise ArgumentError("model_dir", f"{args.model_dir} is not an image classifier (a backbone with a class "
                                           f"head; this is a {type(model).__name__.lower()}): predict takes what a "
                                           "classification recipe saved; search with an embedder (vembed search)")
        if args.top_k > len(model.labels):
            raise ArgumentError("--top-k", f"is {args.top_k} but the model has {len(model.labels)} classes")
        images, truth = _inputs(args, model.labels)
        _check_images_open(images)
        predictions = model.predict(images, top_k=args.top_k, batch_size=args.batch_size, show_progress=True)
        rows = _rows(images, truth, predictions, args.top_k)
        out.parent.mkdir(parents=True, exist_ok=True)
        replace_atomically(out, lambda tmp: _write_csv(tmp, rows))
        summary = f"wrote {out}: {len(images)} images, top {args.top_k} of {len(model.labels)} classes each"
        if any(label is not None for label in truth):
            known = [(t, p[0]["label"]) for t, p in zip(truth, predictions) if t is not None]
            summary += f"; accuracy {sum(t == p for t, p in known) / len(known):.4f} on {len(known)} labelled images"
        print(summary)
        return 0

    return run_cli(body, args.debug)


def _inputs(args: argparse.Namespace, labels: list[str]) -> tuple[list[str], list[str | None]]:
    """Every image to classify, in the order given, and its true class where the input says it."""
    from vembed.classification.labelled import read_labelled_images
    from vembed.data.images import IMAGE_EXTENSIONS
    from vembed.errors import ArgumentError

    images: list[str] = []
    truth: list[str | None] = []
    for item in args.images:
        path = Path(item)
        if path.is_file() and path.suffix.lower() in IMAGE_EXTENSIONS:
            images.append(str(path))
            truth.append(None)
        elif path.is_file() and path.suffix.lower() in TABLE_SUFFIXES or path.is_dir() and _is_labelled_folder(path):
            data = read_labelled_images(str(path), "images", label_column=args.label_column,
                                        image_root=args.image_root, names=labels, max_bad_fraction=0.0)
            images += [data.image(i) if data.embedded is not None else data.paths[i] for i in range(len(data))]
            truth += [labels[label] for label in data.labels]
        elif path.is_dir():
            found = sorted(str(f) for f in path.iterdir() if f.is_file() and f.suffix.lower() in IMAGE_EXTENSIONS)
            if not found:
                raise ArgumentError("images", f"{item} holds no images ({', '.join(IMAGE_EXTENSIONS)}) and no class "
                                            "folders")
            images += found
            truth += [None] * len(found)
        else:
            raise ArgumentError("images", f"{item} is not an image ({', '.join(IMAGE_EXTENSIONS)}), a folder or a "
                                        f"labelled table ({', '.join(TABLE_SUFFIXES)})")
    return images, truth


def _check_images_open(images: list) -> None:
    """Every image file is one PIL reads (its header and checksums: `Image.verify`), before any is classified: a bad
    file is one line naming it, not an error halfway through the predictions."""
    from PIL import Image

    from vembed.errors import DataError

    for image in images:
        if not isinstance(image, str):
            continue  # an image embedded in a table: decoded when classified
        try:
            with Image.open(image) as opened:
                opened.verify()
        except Exception as err:  # noqa: BLE001 - PIL raises many types for bad data
            raise DataError(f"cannot decode image: {type(err).__name__}: {err}", file=image) from None


def _is_labelled_folder(path: Path) -> bool:
    """An ImageFolder tree (class subfolders) or a saved `datasets` folder, not a flat folder of images."""
    from vembed.data.tables import HF_SAVED_MARKERS

    return any(child.is_dir() for child in path.iterdir()) or any((path / m).is_file() for m in HF_SAVED_MARKERS)


def _rows(images: list, truth: list[str | None], predictions: list[list[dict]], top_k: int) -> list[list[str]]:
    header = ["image", "true_label"] + [f"{name}_{k}" for k in range(1, top_k + 1) for name in ("label", "score")]
    rows = [header]
    for image, true, predicted in zip(images, truth, predictions):
        name = image if isinstance(image, str) else getattr(image, "filename", "") or ""
        cells = [name, "" if true is None else true]
        for guess in predicted:
            cells += [guess["label"], repr(guess["score"])]
        rows.append(cells)
    return rows


def _write_csv(path: Path, rows: list[list[str]]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vembed predict", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
