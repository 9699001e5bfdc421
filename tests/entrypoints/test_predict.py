"""`vembed predict` and `vembed.load(...).predict`: a trained tiny ViT's predictions on the validation split count
as the run's confusion matrix counts them; inputs as files, folders or labelled data; bad input is one line, exit 2,
nothing written."""

from __future__ import annotations

import csv
import json
import shutil
from collections import Counter

import pytest
from training_digits import CLASSES, digits_recipe, train_classifier, write_digit_splits

from vembed.cli import main


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = write_digit_splits(tmp_path_factory.mktemp("predict"))
    raw = digits_recipe(root, root / "run", max_steps=8)
    assert train_classifier(raw, root / "recipe.yaml") == 0
    return root


def _read(path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_predictions_on_the_validation_split_count_as_the_runs_confusion_matrix(trained, tmp_path, capsys):
    import vembed
    from vembed.api import Classifier

    metrics = json.loads((trained / "run" / "metrics.json").read_text())["validation"]
    out = tmp_path / "predictions.csv"
    assert main(["predict", str(trained / "run" / "final"), str(trained / "validation" / "labels.csv"),
                 "--out", str(out), "--top-k", "2", "--batch-size", "5"]) == 0
    rows = _read(out)
    names, counts = metrics["confusion_matrix"]["labels"], metrics["confusion_matrix"]["counts"]
    expected = Counter({(names[t], names[p]): n for t, row in enumerate(counts) for p, n in enumerate(row) if n})
    assert Counter((row["true_label"], row["label_1"]) for row in rows) == expected
    assert all(float(row["score_1"]) >= float(row["score_2"]) and row["label_1"] != row["label_2"] for row in rows)
    printed = capsys.readouterr().out
    assert f"accuracy {metrics['accuracy']:.4f} on 18 labelled images" in printed

    model = vembed.load(str(trained / "run" / "final"), device="cpu")
    assert isinstance(model, Classifier) and model.labels == sorted(CLASSES)
    first = model.predict([str(trained / "validation" / rows[0]["image"].split("validation/")[-1])], top_k=3)[0]
    assert [guess["label"] for guess in first[:2]] == [rows[0]["label_1"], rows[0]["label_2"]]
    assert sum(guess["score"] for guess in first) == pytest.approx(1.0, abs=1e-5)  # all 3 classes: probabilities


def test_an_image_folder_a_class_tree_and_files_are_predicted_alike(trained, tmp_path):
    flat = tmp_path / "flat"
    flat.mkdir()
    one = next((trained / "validation" / "two").iterdir())
    shutil.copy(one, flat / "a.png")
    out_tree, out_flat, out_file = tmp_path / "tree.csv", tmp_path / "flat.csv", tmp_path / "file.csv"
    final = str(trained / "run" / "final")
    assert main(["predict", final, str(trained / "validation"), "--out", str(out_tree)]) == 0
    assert main(["predict", final, str(flat), "--out", str(out_flat)]) == 0
    assert main(["predict", final, str(one), "--out", str(out_file)]) == 0
    tree = {row["image"]: row for row in _read(out_tree)}
    assert len(tree) == 18 and tree[str(one)]["true_label"] == "two"
    (flat_row,), (file_row,) = _read(out_flat), _read(out_file)
    assert flat_row["true_label"] == "" and file_row["image"] == str(one)
    assert flat_row["label_1"] == file_row["label_1"] == tree[str(one)]["label_1"]
    assert flat_row["score_1"] == file_row["score_1"]


@pytest.mark.parametrize("case, label", [
    ("corrupt-image", "cannot decode image"),
    ("embedder", "is not an image classifier"),
    ("top-k-zero", "--top-k: must be at least 1"),
    ("top-k-too-many", "--top-k: is 4 but the model has 3 classes"),
    ("nothing", "is not an image"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_written(trained, tmp_path, capsys, tiny_tokenizer_dir, case, label):
    from corpora import text_model_keys

    from vembed.components import recipe_from_dict
    from vembed.models import MODELS

    final = str(trained / "run" / "final")
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png")
    good = next((trained / "validation" / "one").iterdir())
    embedder = tmp_path / "embedder"
    if case == "embedder":
        MODELS.get("text").from_recipe(recipe_from_dict(text_model_keys(tiny_tokenizer_dir))).save(embedder)
    out = tmp_path / "out.csv"
    argv = {
        "corrupt-image": [final, str(good), str(broken)],
        "embedder": [str(embedder), str(good)],
        "top-k-zero": [final, str(good), "--top-k", "0"],
        "top-k-too-many": [final, str(good), "--top-k", "4"],
        "nothing": [final, str(tmp_path / "missing.png")],
    }[case]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["predict", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and label in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == before
