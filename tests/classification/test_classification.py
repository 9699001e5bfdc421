"""The classification task end to end: a tiny ViT trained on labelled images (an ImageFolder tree and a CSV) through
the train entrypoint; what it saves classifies as the run measured; bad labelled data stops with one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from training_digits import CLASSES, write_digit_splits
from training_digits import digits_recipe as recipe
from training_digits import train_classifier as train


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    return write_digit_splits(tmp_path_factory.mktemp("digits"))


def test_trains_saves_and_the_saved_model_classifies_as_the_run_measured(digits, tmp_path):
    from vembed.models import load_adapter

    # Evaluated mid-run too, logged to TensorBoard: trackers and the history get the numbers, not the reports.
    raw = recipe(digits, tmp_path / "run", eval_steps=3, save_steps=3, report_to=["tensorboard"])
    assert train(raw, tmp_path / "recipe.yaml") == 0
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert [entry["step"] for entry in metrics["eval_history"]] == [3, 6]
    assert all(isinstance(v, (int, float)) for entry in metrics["eval_history"] for v in entry.values())
    assert metrics["best"]["value"] == max(entry["accuracy"] for entry in metrics["eval_history"])
    validation = metrics["validation"]
    assert set(validation["per_class"]) == set(CLASSES) and validation["num_samples"] == 18
    assert sum(map(sum, validation["confusion_matrix"]["counts"])) == 18
    assert metrics["train"]["loss"] == {"name": "CrossEntropyLoss", "label_smoothing": 0.1}
    assert (tmp_path / "run" / "confusion_matrix.png").is_file() and (tmp_path / "run" / "reliability.png").is_file()
    assert 0 <= validation["ece"] <= 1 and validation["nll"] > 0 and len(validation["calibration"]) == 15

    model = load_adapter(tmp_path / "run" / "final").eval()
    assert model.settings.label_names == sorted(CLASSES) and model.settings.num_labels == 3
    again = saved_model_metrics(tmp_path / "run", digits)
    assert again["confusion_matrix"] == validation["confusion_matrix"]
    for key in ("accuracy", "top5_accuracy", "macro_f1", "micro_f1"):
        assert again[key] == pytest.approx(validation[key], abs=1e-9)


def saved_model_metrics(run: Path, digits: Path) -> dict:
    """The run's final/ classifying the validation split on one process, as `vembed eval` does."""
    from vembed.classification.evaluation import classification_metrics
    from vembed.classification.labelled import read_labelled_images
    from vembed.classification.task import ClassificationCollator, LabelledImageDataset
    from vembed.models import load_adapter

    model = load_adapter(run / "final").eval()
    data = read_labelled_images(str(digits / "validation" / "labels.csv"), "data.validation",
                                names=model.settings.label_names)
    batch = ClassificationCollator(model)([LabelledImageDataset(data)[i] for i in range(len(data))])
    with torch.no_grad():
        scores = model.classify(batch["inputs"]).numpy()
    return classification_metrics(scores, np.array(data.labels), model.settings.label_names)


@pytest.mark.parametrize("case,message", [
    ("num_labels", "num_labels: is 5 but .* has 3 classes; set num_labels: 3"),
    ("empty_class", "class folder 'three' has no images"),
    ("label_range", "row 2: label 7 is outside the classes 0..2"),
    ("unknown_label", "label 'seven' is not one of the training classes"),
    ("missing_images", "2 of 3 rows have no image file .*max_bad_fraction=0.05"),
])
def test_bad_labelled_data_stops_with_one_line_and_writes_nothing(digits, tmp_path, capsys, case, message):
    import re
    import shutil

    raw = recipe(digits, tmp_path / "run")
    if case == "num_labels":
        raw["num_labels"] = 5
    elif case == "empty_class":
        shutil.copytree(digits / "train", tmp_path / "train")
        (tmp_path / "train" / "three").mkdir()
        raw["data"]["train"] = str(tmp_path / "train")
    else:  # CSV data: integer labels must fit the head; held-out labels must be training classes
        raw["data"] = {"train": str(tmp_path / "train.csv"), "image_root": str(digits / "train")}
        if case == "missing_images":
            (tmp_path / "train.csv").write_text("image,label\nzero/0.png,zero\ngone.png,one\nnone.png,two\n")
        elif case == "label_range":
            raw["num_labels"] = 3
            (tmp_path / "train.csv").write_text("image,label\nzero/0.png,0\none/1.png,7\ntwo/2.png,2\n")
        else:
            raw["data"]["validation"] = str(tmp_path / "validation.csv")
            (tmp_path / "train.csv").write_text("image,label\nzero/0.png,zero\none/1.png,one\n")
            (tmp_path / "validation.csv").write_text("image,label\nzero/0.png,zero\none/1.png,seven\n")
    assert train(raw, tmp_path / "recipe.yaml") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err), err
    assert not (tmp_path / "run").exists()


SPREAD = [0, 13, 25, 1, 14, 26, 2, 15]  # rows of the ImageFolder dataset from all three classes; 4 per rank


def _classification_worker(raw_path: str, out_dir: str) -> None:
    import torch.distributed as dist

    from tests.training.test_ddp_step import _gradients

    raw = json.loads(Path(raw_path).read_text())
    rank = dist.get_rank()
    grads = _gradients(raw, SPREAD[rank * 4:(rank + 1) * 4])
    if rank == 0:
        torch.save(grads, Path(out_dir, "ddp.pt"))


@pytest.mark.slow
def test_two_gloo_ranks_take_the_step_one_process_takes_on_both_halves(digits, tmp_path):
    from ranks import run_on_ranks

    from tests.training.test_ddp_step import _gradients

    raw = recipe(digits, tmp_path / "run", batch_size=4, projection_dim=16)
    raw_path = tmp_path / "raw.json"
    raw_path.write_text(json.dumps(raw))
    run_on_ranks(_classification_worker, str(raw_path), str(tmp_path), world=2)
    ddp = torch.load(tmp_path / "ddp.pt", weights_only=True)
    single = _gradients(dict(raw, batch_size=8), SPREAD)
    assert ddp.keys() == single.keys() and any(name.startswith("adapter.classifier") for name in single)
    reference = torch.cat([g.flatten() for g in single.values()])
    actual = torch.cat([ddp[name].flatten() for name in single])
    relative = ((actual - reference).norm() / reference.norm()).item()
    assert relative <= 1e-5, f"relative gradient difference {relative:.2e}"


def test_gradient_checkpointing_on_a_big_backbone_does_not_turn_gradient_cache_on(digits, tmp_path):
    """The automatic GradCache rule (checkpointing, >1B parameters) is for contrastive losses only."""
    from vembed.components import recipe_from_dict
    from vembed.planning import choose_gradient_cache

    raw = recipe(digits, tmp_path / "run", gradient_checkpointing=True)
    assert not choose_gradient_cache(recipe_from_dict(raw), "ddp", num_parameters=2_000_000_000).enabled


def _adapter(raw: dict):
    from vembed.components import model_class, recipe_from_dict

    parsed = recipe_from_dict(dict(raw, num_labels=3))
    return model_class(parsed).from_recipe(parsed), parsed


def test_the_training_collator_augments_each_sample_by_its_epoch_and_index(digits, tmp_path):
    from vembed.classification.labelled import read_labelled_images
    from vembed.classification.task import ClassificationCollator, LabelledImageDataset

    raw = recipe(digits, tmp_path / "run", augmentation={"crop_scale": [0.3, 0.6], "horizontal_flip": 0.5})
    adapter, parsed = _adapter(raw)
    dataset = LabelledImageDataset(read_labelled_images(str(digits / "train"), "data.train"))
    augmented = ClassificationCollator(adapter, parsed.augmentation, seed=0)
    plain = ClassificationCollator(adapter)

    def pixels(collate, keys):
        return collate([dataset[key] for key in keys])["inputs"]["pixel_values"]

    keys = [(0, 1), (0, 20)]
    assert torch.equal(pixels(augmented, keys), pixels(augmented, keys))  # in a worker or not, resumed or not
    assert not torch.equal(pixels(augmented, keys), pixels(augmented, [(1, 1), (1, 20)]))  # a new crop each epoch
    assert not torch.equal(pixels(augmented, keys), pixels(plain, keys))
    assert torch.equal(pixels(plain, [1, 20]), pixels(plain, keys))  # evaluation: the image as it is
    mixed = ClassificationCollator(adapter, parsed.augmentation.model_copy(update={"mixup_alpha": 0.4}), seed=0)
    batch = mixed([dataset[key] for key in keys])
    assert batch["labels"].shape == (2, 3) and torch.allclose(batch["labels"].sum(1), torch.ones(2))


def test_layer_lr_decay_gives_each_vit_block_its_rate(digits, tmp_path):
    from vembed.classification.task import ClassificationObjective
    from vembed.training.loop import build_optimizer
    from vembed.training.objective import parameter_groups

    adapter, _ = _adapter(recipe(digits, tmp_path / "run"))
    objective = ClassificationObjective(adapter, torch.nn.Identity())
    names = {id(p): n for n, p in objective.named_parameters()}
    optimizer = build_optimizer(parameter_groups(objective, 0.05, layer_lr_decay=0.5), lr=1e-3)
    rate = {names[id(p)]: group["lr"] for group in optimizer.param_groups for p in group["params"]}
    # 2 blocks: embeddings at depth 0, block i at i + 1, the head and final norm at 3 (the learning rate)
    assert rate["adapter.classifier.weight"] == rate["adapter.model.layernorm.weight"] == pytest.approx(1e-3)
    assert rate["adapter.model.layers.1.attention.q_proj.weight"] == pytest.approx(5e-4)
    assert rate["adapter.model.layers.0.mlp.fc2.bias"] == pytest.approx(2.5e-4)
    assert rate["adapter.model.embeddings.cls_token"] == pytest.approx(1.25e-4)
    assert rate["adapter.model.embeddings.patch_embeddings.projection.weight"] == pytest.approx(1.25e-4)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)  # what the run logs as its learning rate
    decay = {names[id(p)]: group["weight_decay"] for group in optimizer.param_groups for p in group["params"]}
    assert decay["adapter.model.layers.0.mlp.fc2.weight"] == 0.05
    assert decay["adapter.model.layers.0.mlp.fc2.bias"] == 0.0
    # without decay: the two groups as before (weights with decay first), at the learning rate
    plain = parameter_groups(objective, 0.05)
    assert [g["weight_decay"] for g in plain] == [0.05, 0.0] and all("lr_scale" not in g for g in plain)


def test_layer_lr_decay_on_a_model_without_named_layers_is_refused():
    from vembed.errors import RecipeError
    from vembed.training.objective import parameter_groups

    with pytest.raises(RecipeError, match="layer_lr_decay: .*remove layer_lr_decay"):
        parameter_groups(torch.nn.Sequential(torch.nn.Linear(2, 2)), 0.0, layer_lr_decay=0.5)


def test_augmented_run_with_layer_decay_resumes_to_the_same_weights(digits, tmp_path):
    from launching import final_weights

    augmentation = {"crop_scale": [0.5, 1.0], "horizontal_flip": 0.5, "mixup_alpha": 0.4, "cutmix_alpha": 1.0,
                    "trivial_augment": True, "random_erasing": 0.5}
    common = dict(augmentation=augmentation, layer_lr_decay=0.7, max_steps=4, save_steps=2, save_total_limit=2,
                  eval_before_training=False, logging_steps=1)
    assert train(recipe(digits, tmp_path / "whole", **common), tmp_path / "whole.yaml") == 0
    resumed = recipe(digits, tmp_path / "resumed", resume_from=str(tmp_path / "whole" / "checkpoint-2"), **common)
    assert train(resumed, tmp_path / "resumed.yaml") == 0
    whole, again = final_weights(tmp_path / "whole"), final_weights(tmp_path / "resumed")
    assert whole.keys() == again.keys()
    assert all(torch.equal(whole[name], again[name]) for name in whole)
    history = json.loads((tmp_path / "whole" / "metrics.json").read_text())
    assert history["train"]["loss"]["name"] == "CrossEntropyLoss"


def test_augmentation_is_refused_where_no_task_reads_it(tmp_path):
    from vembed.components import recipe_from_dict
    from vembed.errors import RecipeError
    from vembed.recipe_checks import check_recipe

    data = tmp_path / "pairs.jsonl"
    data.write_text('{"query": "a", "positive": "b"}\n')
    parsed = recipe_from_dict({"model_type": "clip", "data": {"train": str(data)},
                               "augmentation": {"horizontal_flip": 0.5}})
    with pytest.raises(RecipeError, match="augmentation: is read by the classification and metric_learning tasks only"):
        check_recipe(parsed)


def test_a_frozen_backbone_is_a_linear_probe_whose_backbone_stays_as_loaded(digits, tmp_path):
    """freeze_backbone: the head trains, the backbone's weights end as they were built (and final/ holds them);
    without it, the same steps move the backbone (so the test sees the switch)."""
    from vembed.components import recipe_from_dict
    from vembed.training.loop import Trainer

    moved = {}
    for frozen in (True, False):
        trainer = Trainer(recipe_from_dict(recipe(digits, tmp_path / f"run-{frozen}", freeze_backbone=frozen,
                                                  max_steps=3)))
        trainer.build()
        adapter = trainer.objective.adapter
        before = {name: p.detach().clone() for name, p in adapter.named_parameters()}
        trainer.run()
        after = dict(trainer.objective.adapter.named_parameters())
        moved[frozen] = {name for name, value in before.items() if not torch.equal(after[name], value)}
    assert moved[True] == {"classifier.weight", "classifier.bias"}
    assert {"classifier.weight", "classifier.bias"} < moved[False] and any(n.startswith("model.") for n in moved[False])


@pytest.mark.parametrize("changes, key", [
    ({"use_lora": True}, "use_lora"),
    ({"gradient_checkpointing": True}, "gradient_checkpointing"),
])
def test_a_frozen_backbone_refuses_what_would_train_or_recompute_it(digits, tmp_path, changes, key):
    from vembed.components import recipe_from_dict
    from vembed.errors import RecipeError
    from vembed.recipe_checks import check_recipe

    with pytest.raises(RecipeError) as refused:
        check_recipe(recipe_from_dict(recipe(digits, tmp_path / "run", freeze_backbone=True, **changes)))
    assert refused.value.key == key and "freeze_backbone keeps as loaded" in str(refused.value)


def test_class_balanced_batches_are_refused_where_records_have_no_class_and_checked_against_the_classes(digits,
                                                                                                      tmp_path):
    from vembed.components import recipe_from_dict
    from vembed.errors import DataError, RecipeError
    from vembed.recipe_checks import check_recipe

    data = tmp_path / "pairs.jsonl"
    data.write_text('{"query": "a", "positive": "b"}\n')
    parsed = recipe_from_dict({"model_type": "clip", "data": {"train": str(data), "m_per_class": 2}})
    with pytest.raises(RecipeError, match="data.m_per_class: balances batches of labelled images \\(classification "
                                          "and metric_learning\\), but this recipe trains contrastive"):
        check_recipe(parsed)
    raw = recipe(digits, tmp_path / "run")
    check_recipe(recipe_from_dict(dict(raw, batch_size=12, data=dict(raw["data"], m_per_class=4))))
    with pytest.raises(DataError, match="data.m_per_class is 13 but class"):  # the classifier's classes too
        check_recipe(recipe_from_dict(dict(raw, batch_size=13, data=dict(raw["data"], m_per_class=13))))


@pytest.mark.slow
def test_zero3_on_two_ranks_trains_and_evaluates_as_one_process(digits, tmp_path):
    """`accelerate launch` with the shipped ZeRO-3 config (2 gloo ranks, 6 images each) against one process on the
    12 images of each global batch: the same weights after 3 steps, the same validation report before and after
    (evaluated through the sharded model), and the saved final/ classifies as the run measured."""
    from launching import final_weights, max_relative_difference, one_process_and_launched

    raw = recipe(digits, tmp_path / "unused", batch_size=12)
    single, zero3 = one_process_and_launched(raw, tmp_path, "deepspeed_zero3.yaml")
    difference = max_relative_difference(final_weights(zero3), final_weights(single))
    assert difference <= 1e-4, f"max relative parameter difference {difference:.2e}"
    launched, reference = (json.loads((out / "metrics.json").read_text()) for out in (zero3, single))
    for when in ("before", "validation"):
        assert launched[when]["confusion_matrix"] == reference[when]["confusion_matrix"], when
        assert launched[when]["accuracy"] == pytest.approx(reference[when]["accuracy"], abs=1e-9), when
    saved = saved_model_metrics(zero3, digits)
    assert saved["confusion_matrix"] == launched["validation"]["confusion_matrix"]
    assert saved["macro_f1"] == pytest.approx(launched["validation"]["macro_f1"], abs=1e-9)


def digits_dataset(tree: Path, out: Path, truncate: int | None = None) -> Path:
    """The ImageFolder tree `tree` as a `datasets` save_to_disk folder: each file's bytes in an Image column, its
    class in a ClassLabel of CLASSES (in that order, not sorted); with `truncate`, that row's PNG cut in half."""
    from tests.classification.test_labelled import write_dataset

    files = sorted((f, name) for name in CLASSES for f in (tree / name).iterdir())
    images = [f.read_bytes() for f, _ in files]
    if truncate is not None:
        images[truncate] = images[truncate][: len(images[truncate]) // 2]
    return write_dataset(out, images, [CLASSES.index(name) for _, name in files])


def test_a_datasets_folder_trains_and_a_second_launch_reads_the_image_cache(digits, tmp_path, capsys):
    import re

    from vembed.models import load_adapter

    saved = digits_dataset(digits / "train", tmp_path)
    data = {"train": str(saved), "validation": str(digits / "validation" / "labels.csv"),
            "image_cache_dir": str(tmp_path / "cache")}
    for run, how in (("first", "built in"), ("second", "mapped")):
        assert train(recipe(digits, tmp_path / run, data=data, max_steps=2), tmp_path / "recipe.yaml") == 0
        out = capsys.readouterr().out
        assert re.search(f"image cache +36 images resized once, {how}", out), out
    metrics = json.loads((tmp_path / "second" / "metrics.json").read_text())
    assert metrics["validation"]["num_samples"] == 18 and metrics["train"]["data"]["num_images"] == 36
    assert load_adapter(tmp_path / "second" / "final").settings.label_names == CLASSES  # the ClassLabel's order


@pytest.mark.parametrize("case,message", [
    ("num_labels", r"num_labels: is 5 but .*saved has 3 classes; set num_labels: 3"),
    ("not_images", r"saved: 2 of 36 rows have no image file or no readable image .*first: row 1: column 'image': "
                   r"embedded bytes are not an image"),
    ("broken_image", r"saved: 1 of 36 rows .*\(found decoding every image for the image cache\).*first: row 4: "
                     r"cannot decode"),
    ("no_label_column", r"saved: has no 'label' column \(columns: image, kind\)"),
])
def test_bad_datasets_data_stops_with_one_line_and_writes_nothing(digits, tmp_path, capsys, case, message):
    import re

    import datasets

    raw = recipe(digits, tmp_path / "run", num_labels=5 if case == "num_labels" else 3)
    raw["data"] = {"train": str(tmp_path / "saved"), "image_cache_dir": str(tmp_path / "cache"),
                   "max_bad_fraction": 0.02}
    saved = digits_dataset(digits / "train", tmp_path / "made", truncate=3 if case == "broken_image" else None)
    table = datasets.load_from_disk(str(saved))
    if case == "not_images":
        table = table.cast_column("image", datasets.Image(decode=False)).map(
            lambda row, i: {"image": {"bytes": b"not a png", "path": None}} if i in (0, 7) else row,
            with_indices=True).cast_column("image", datasets.Image())
    elif case == "no_label_column":
        table = table.rename_column("label", "kind")
    table.save_to_disk(str(tmp_path / "saved"))
    capsys.readouterr()  # datasets' progress bars while making the data
    assert train(raw, tmp_path / "recipe.yaml") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err), err
    assert not (tmp_path / "run").exists()
