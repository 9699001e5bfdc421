"""The metric_learning task end to end: a tiny ViT's embeddings trained on labelled images through the train
entrypoint; the saved model retrieves as the run measured; ArcFace's centres are trained, checkpointed and resumed;
2 ranks take one process's step; bad labelled data stops with one line."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("pytorch_metric_learning")

from vembed.errors import DataError  # noqa: E402

VIT = {"model_type": "vit", "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2,
       "num_attention_heads": 4, "image_size": 32, "patch_size": 8, "hidden_dropout_prob": 0.0,
       "attention_probs_dropout_prob": 0.0}


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    from training_digits import write_digits

    root = tmp_path_factory.mktemp("digits")
    write_digits(root / "train")
    rows = write_digits(root / "validation", per_class=6, offset=40)
    lines = ["image,label"] + [f"{path},{label}" for path, label in rows]
    (root / "validation" / "labels.csv").write_text("\n".join(lines) + "\n")
    return root


def recipe(digits: Path, output_dir: Path, **changes) -> dict:
    raw = {"model_type": "vision", "model_config": VIT, "pooling": "mean", "projection_dim": 16,
           "loss_type": "supcon",
           "data": {"train": str(digits / "train"), "validation": str(digits / "validation" / "labels.csv")},
           "output_dir": str(output_dir), "batch_size": 6, "learning_rate": 2e-3, "max_steps": 6,
           "logging_steps": 2, "seed": 0, "save_total_limit": 1}
    raw.update(changes)
    return raw


def train(raw: dict, path: Path) -> int:
    from vembed.entrypoints.train import run

    path.write_text(yaml.safe_dump(raw))
    return run(argparse.Namespace(recipe=str(path), config_override=[], debug=False))


def test_trains_saves_and_the_saved_model_retrieves_as_the_run_measured(digits, tmp_path):
    from vembed.models import load_adapter

    raw = recipe(digits, tmp_path / "run", eval_steps=3, save_steps=3, eval_before_training=True)
    assert train(raw, tmp_path / "recipe.yaml") == 0
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert [entry["step"] for entry in metrics["eval_history"]] == [3, 6]
    # metric_for_best_model defaults to MAP@R under a metric-learning loss
    assert metrics["best"]["metric"] == "mean_average_precision_at_r"
    assert metrics["best"]["value"] == max(e["mean_average_precision_at_r"] for e in metrics["eval_history"])
    validation = metrics["validation"]
    assert validation["num_samples"] == validation["num_queries"] == 18 and validation["num_classes"] == 3
    assert metrics["train"]["loss"] == {"name": "SupConLoss", "temperature": 0.1}
    assert metrics["before"]["mean_average_precision_at_r"] != validation["mean_average_precision_at_r"]

    model = load_adapter(tmp_path / "run" / "final").eval()
    assert model.classifier is None and model.embedding_dim == 16
    again = saved_model_metrics(tmp_path / "run", digits)
    for key in ("precision_at_1", "recall_at_4", "r_precision", "mean_average_precision_at_r"):
        assert again[key] == pytest.approx(validation[key], abs=1e-9), key


def saved_model_metrics(run: Path, digits: Path) -> dict:
    """The run's final/ retrieving within the validation split on one process, as `vembed eval` does."""
    from vembed.classification.labelled import read_labelled_images
    from vembed.classification.metric_evaluation import retrieval_metrics
    from vembed.classification.task import ClassificationCollator, LabelledImageDataset
    from vembed.models import load_adapter

    model = load_adapter(run / "final").eval()
    data = read_labelled_images(str(digits / "validation" / "labels.csv"), "data.validation")
    batch = ClassificationCollator(model)([LabelledImageDataset(data)[i] for i in range(len(data))])
    with torch.no_grad():
        embeddings = model.encode(batch["inputs"]).numpy()
    return retrieval_metrics(embeddings, data.labels)


def test_a_query_set_and_a_gallery_are_evaluated_as_the_saved_model_searches_the_gallery(digits, tmp_path):
    """data.validation: {query, gallery}: each validation image searched among the gallery's (the training images
    here, with their own class ids until matched by name), as pytorch-metric-learning's ref_includes_query=False."""
    import vembed
    from vembed.classification.labelled import read_labelled_images
    from vembed.classification.metric_evaluation import retrieval_metrics

    query, gallery = str(digits / "validation" / "labels.csv"), str(digits / "train")
    raw = recipe(digits, tmp_path / "run", eval_steps=3, data={"train": str(digits / "train"), "validation": {
        "query": query, "gallery": gallery}})
    assert train(raw, tmp_path / "recipe.yaml") == 0
    validation = json.loads((tmp_path / "run" / "metrics.json").read_text())["validation"]
    assert (validation["num_queries"], validation["num_gallery"], validation["num_gallery_classes"]) == (18, 36, 3)

    model = vembed.load(str(tmp_path / "run" / "final"), device="cpu")
    queries, references = (read_labelled_images(path, "x") for path in (query, gallery))
    assert queries.names == references.names  # one name per id here, so the saved ids can be compared directly
    again = retrieval_metrics(model.encode(images=[queries.image(i) for i in range(len(queries))]).numpy(),
                              queries.labels, reference_embeddings=model.encode(
                                  images=[references.image(i) for i in range(len(references))]).numpy(),
                              reference_labels=references.labels)
    for key in ("precision_at_1", "recall_at_4", "r_precision", "mean_average_precision_at_r"):
        assert again[key] == pytest.approx(validation[key], abs=1e-6), key


@pytest.mark.parametrize("validation, words", [
    ({"query": "q", "shelf": "g"}, "or a query set and a gallery: {query: ..., gallery: ...}"),
    ({"query": ["a", "b"], "gallery": "g"}, "query and gallery each take one ImageFolder directory"),
])
def test_a_held_out_split_of_other_sets_is_refused_naming_the_split(digits, tmp_path, validation, words):
    from vembed.components import recipe_from_dict
    from vembed.errors import RecipeError
    from vembed.recipe_checks import check_recipe

    raw = recipe(digits, tmp_path / "run", data={"train": str(digits / "train"), "validation": validation})
    with pytest.raises(RecipeError, match="data.validation: ") as refused:
        check_recipe(recipe_from_dict(raw))
    assert words in str(refused.value)


def test_arcface_centres_are_trained_checkpointed_and_resumed(digits, tmp_path):
    from interrupts import stop_after_checkpoint

    from vembed.components import recipe_from_dict
    from vembed.training.loop import Trainer

    def run(raw: dict) -> Trainer:
        trainer = Trainer(recipe_from_dict(raw))
        trainer.run()
        return trainer

    raw = recipe(digits, tmp_path / "whole", loss_type="subcenter_arcface", scale=16.0, sub_centers=2,
                 max_steps=4, save_steps=2)
    whole = run(raw)
    centres = whole.objective.loss.loss.W.detach().clone()
    assert centres.shape == (16, 3 * 2)
    untrained = Trainer(recipe_from_dict(dict(raw, output_dir=str(tmp_path / "unused"))))
    untrained.build()  # the centres as built: seeded as in every run
    assert not torch.equal(untrained.objective.loss.loss.W, centres)  # in the optimizer: they moved

    interrupted = dict(raw, output_dir=str(tmp_path / "interrupted"))
    stop_after_checkpoint(lambda: run(interrupted), 2)
    resumed = run(dict(interrupted, resume_from="auto"))
    assert torch.equal(resumed.objective.loss.loss.W, centres)
    final = {n: p for n, p in resumed.objective.adapter.named_parameters()}
    for name, value in whole.objective.adapter.named_parameters():
        assert torch.equal(final[name], value), name


def test_arcface_final_reloads_with_the_centres_of_its_last_step(digits, tmp_path):
    """final/ used to hold the model only: the centres of the steps after the last checkpoint existed nowhere. Now
    loss.safetensors holds them, `vembed.load` restores them, and the reloaded model scores and classifies with them
    as the trained loss does; the model card says so."""
    import vembed
    from vembed.classification.labelled import read_labelled_images
    from vembed.components import recipe_from_dict
    from vembed.training.loop import Trainer

    raw = recipe(digits, tmp_path / "run", loss_type="subcenter_arcface", scale=16.0, sub_centers=2, max_steps=5,
                 save_steps=2)
    trainer = Trainer(recipe_from_dict(raw))
    trainer.run()
    centres = trainer.objective.loss.loss.W.detach()
    final = tmp_path / "run" / "final"
    assert (final / "loss.safetensors").is_file()

    model = vembed.load(str(final), device="cpu")
    assert torch.equal(model.loss.module.loss.W, centres)  # step 5's, not checkpoint-4's
    assert model.class_names == list(trainer.task.train_data.names)
    assert sorted(model.class_names) == ["one", "two", "zero"]
    data = read_labelled_images(str(digits / "validation" / "labels.csv"), "data.validation")
    images = [data.image(i) for i in range(len(data))]
    scores = model.class_scores(images=images)
    with torch.no_grad():
        expected = trainer.objective.loss.class_scores(model.encode(images=images, normalize=False))
    assert scores.shape == (len(images), 3)
    assert torch.allclose(scores, expected, atol=1e-6)
    assert model.classify(images=images) == [model.class_names[i] for i in expected.argmax(1).tolist()]
    card = (final / "README.md").read_text()
    assert "`loss.safetensors`; `vembed.load` restores it" in card and "model.class_scores(images=" in card


def test_a_pair_based_loss_saves_no_loss_state(digits, tmp_path):
    import vembed

    assert train(recipe(digits, tmp_path / "run", max_steps=2), tmp_path / "recipe.yaml") == 0
    assert not (tmp_path / "run" / "final" / "loss.safetensors").exists()
    with pytest.raises(ValueError, match="saved without a loss state"):
        vembed.load(str(tmp_path / "run" / "final"), device="cpu").class_scores(images=[])


@pytest.mark.parametrize("case,message", [
    ("no_label_column", r"train.csv: has no 'label' column .*labelled images need 'image' and 'label'"),
    ("single_image_class", r"train.csv: 1 class\(es\) have a single image \('two'\); loss_type supcon needs two or "
                           "more images of every class"),
    ("num_labels", "num_labels: is not used by metric learning"),
    ("head_init", "head_init: is not used by metric learning"),
    ("metric", "metric_for_best_model: 'accuracy' is not a retrieval metric"),
    ("pml_argument", r"pml_arguments.gamma: MultiSimilarityLoss takes no argument 'gamma'; it takes: alpha, base"),
    ("m_per_class_batch", r"data.m_per_class: 4 images of a class per batch need a batch_size that is a multiple of 4"),
    ("m_per_class_images", r"train: data.m_per_class is 13 but class '\w+' has 12 image\(s\) \(3 class\(es\)"),
    ("m_per_class_views", r"data.m_per_class: balances classes, but with positives: views"),
    ("freeze_nothing_left", r"freeze_backbone: leaves nothing to train: the embedding is the backbone's output"),
])
def test_bad_input_stops_with_one_line_and_writes_nothing(digits, tmp_path, capsys, case, message):
    import re

    raw = recipe(digits, tmp_path / "run")
    if case in ("no_label_column", "single_image_class"):
        raw["data"] = {"train": str(tmp_path / "train.csv"), "image_root": str(digits / "train")}
        rows = "image,label\nzero/0.png,zero\nzero/10.png,zero\none/1.png,one\none/11.png,one\ntwo/2.png,two\n"
        if case == "no_label_column":
            rows = rows.replace("image,label", "image,class")
        (tmp_path / "train.csv").write_text(rows)
    elif case in ("num_labels", "head_init"):
        raw.update({"num_labels": 3} if case == "num_labels" else {"head_init": "class_names"})
    elif case == "pml_argument":
        raw.update(loss_type="pml", pml_loss="MultiSimilarityLoss", pml_arguments={"gamma": 1})
    elif case == "freeze_nothing_left":
        raw.update(freeze_backbone=True)
        raw.pop("projection_dim")
    elif case.startswith("m_per_class"):
        m = {"m_per_class_batch": 4, "m_per_class_images": 13, "m_per_class_views": 2}[case]
        raw.update(data=dict(raw["data"], m_per_class=m), batch_size=26 if m == 13 else 6)
        if case == "m_per_class_views":
            raw.update(loss_type="ntxent", positives="views")
    else:
        raw["metric_for_best_model"] = "accuracy"
    assert train(raw, tmp_path / "recipe.yaml") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err), err
    assert not (tmp_path / "run").exists()


def test_a_class_of_one_image_is_fine_for_arcface(digits, tmp_path):
    from vembed.components import recipe_from_dict
    from vembed.recipe_checks import check_recipe

    (tmp_path / "train.csv").write_text("image,label\nzero/0.png,zero\nzero/10.png,zero\none/1.png,one\n")
    raw = recipe(digits, tmp_path / "run", loss_type="subcenter_arcface",
                 data={"train": str(tmp_path / "train.csv"), "image_root": str(digits / "train")})
    check_recipe(recipe_from_dict(raw))


def test_class_balanced_batches_train_every_step_on_m_of_each_class_and_resume_exactly(digits, tmp_path, monkeypatch):
    """data.m_per_class through the loop: each step's batch holds m images of each class it draws (read from the
    labels the loss receives), and a run stopped at a checkpoint and resumed across an epoch boundary ends with the
    weights of the whole run."""
    from interrupts import stop_after_checkpoint

    from vembed.classification.metric_losses import SupConLoss
    from vembed.components import recipe_from_dict
    from vembed.training.loop import Trainer

    seen: list[list[int]] = []
    library_loss = SupConLoss.global_loss

    def recording(self, embeddings, labels):  # the global batch's labels, as the loss receives them
        seen.append(labels.tolist())
        return library_loss(self, embeddings, labels)

    def run(raw: dict) -> Trainer:
        trainer = Trainer(recipe_from_dict(raw))
        trainer.run()
        return trainer

    raw = recipe(digits, tmp_path / "whole", data=dict(recipe(digits, tmp_path)["data"], m_per_class=3),
                 max_steps=8, save_steps=4, eval_steps=100)  # 6 steps an epoch: the resume crosses into epoch 1
    monkeypatch.setattr(SupConLoss, "global_loss", recording)
    whole = run(raw)
    monkeypatch.undo()
    assert len(seen) == 8 and all(sorted(batch.count(label) for label in set(batch)) == [3, 3] for batch in seen)
    interrupted = dict(raw, output_dir=str(tmp_path / "interrupted"))
    stop_after_checkpoint(lambda: run(interrupted), 4)
    resumed = run(dict(interrupted, resume_from="auto"))
    final = dict(resumed.objective.adapter.named_parameters())
    for name, value in whole.objective.adapter.named_parameters():
        assert torch.equal(final[name], value), name


def test_a_pml_proxy_loss_by_name_trains_its_proxies_and_final_restores_them(digits, tmp_path):
    """`loss_type: pml` with a proxy loss: the proxies are sized from the data and the model, trained, saved in
    final/'s loss.safetensors and rebuilt by `vembed.load` with the step's values; a class of one image is fine."""
    import vembed
    from vembed.components import recipe_from_dict
    from vembed.recipe_checks import check_recipe
    from vembed.training.loop import Trainer

    raw = recipe(digits, tmp_path / "run", loss_type="pml", pml_loss="ProxyAnchorLoss",
                 pml_arguments={"margin": 0.1, "alpha": 32}, max_steps=3)
    trainer = Trainer(recipe_from_dict(raw))
    trainer.run()
    proxies = trainer.objective.loss.loss.proxies.detach()
    assert proxies.shape == (3, 16)  # the digits' 3 classes, projection_dim 16
    model = vembed.load(str(tmp_path / "run" / "final"), device="cpu")
    assert torch.equal(model.loss.module.loss.proxies, proxies)
    assert model.loss.config["name"] == "ProxyAnchorLoss" and model.loss.module.loss.margin == 0.1
    (tmp_path / "train.csv").write_text("image,label\nzero/0.png,zero\nzero/10.png,zero\none/1.png,one\n")
    one_image = {"train": str(tmp_path / "train.csv"), "image_root": str(digits / "train")}
    check_recipe(recipe_from_dict({**raw, "data": one_image}))
    with pytest.raises(DataError, match="loss_type pml needs two or more images"):  # a pair loss needs positives
        check_recipe(recipe_from_dict({**raw, "data": one_image, "pml_loss": "MultiSimilarityLoss",
                                       "pml_arguments": {}}))


SPREAD = [0, 13, 25, 1, 14, 26, 2, 15]  # rows of the ImageFolder dataset from all three classes; 4 per rank
LOSSES = ("supcon", "subcenter_arcface")  # one launch for both: starting ranks costs more than the steps


def _worker(raw_path: str, out_dir: str) -> None:
    import torch.distributed as dist

    from tests.training.test_ddp_step import _gradients

    raw = json.loads(Path(raw_path).read_text())
    rank = dist.get_rank()
    grads = {loss: _gradients(dict(raw, loss_type=loss), SPREAD[rank * 4:(rank + 1) * 4]) for loss in LOSSES}
    if rank == 0:
        torch.save(grads, Path(out_dir, "ddp.pt"))


@pytest.mark.slow
def test_two_gloo_ranks_take_the_step_one_process_takes_on_both_halves(digits, tmp_path):
    from ranks import run_on_ranks

    from tests.training.test_ddp_step import _gradients

    raw = recipe(digits, tmp_path / "run", batch_size=4)
    raw_path = tmp_path / "raw.json"
    raw_path.write_text(json.dumps(raw))
    run_on_ranks(_worker, str(raw_path), str(tmp_path), world=2)
    ddp = torch.load(tmp_path / "ddp.pt", weights_only=True)
    for loss in LOSSES:
        single = _gradients(dict(raw, batch_size=8, loss_type=loss), SPREAD)
        assert ddp[loss].keys() == single.keys() and any(name.startswith("adapter.projection") for name in single)
        reference = torch.cat([g.flatten() for g in single.values()])
        actual = torch.cat([ddp[loss][name].flatten() for name in single])
        relative = ((actual - reference).norm() / reference.norm()).item()
        print(f"{loss}: relative gradient difference {relative:.2e}")
        assert relative <= 1e-5, f"{loss}: relative gradient difference {relative:.2e}"
    assert "loss.loss.W" in ddp["subcenter_arcface"]


@pytest.mark.slow
@pytest.mark.parametrize("loss", LOSSES)
def test_zero3_on_two_ranks_trains_and_evaluates_as_one_process(digits, tmp_path, loss):
    """`accelerate launch` with the shipped ZeRO-3 config (2 gloo ranks, 6 images each; SupCon gathers the ranks'
    embeddings) against one process on the 12 images of each global batch: the same weights after 3 steps, the same
    retrieval report before and after (evaluated through the sharded model), and the saved final/ retrieves as the
    run measured. Sub-center ArcFace's class centres are parameters of the loss, partitioned by ZeRO-3 with the
    model: they train as in one process, and the checkpoint holds them whole once consolidated."""
    from launching import final_weights, max_relative_difference, one_process_and_launched

    arcface = {"scale": 16.0, "sub_centers": 2, "save_steps": 2} if loss == "subcenter_arcface" else {}
    raw = recipe(digits, tmp_path / "unused", loss_type=loss, batch_size=12, eval_before_training=True, **arcface)
    single, zero3 = one_process_and_launched(raw, tmp_path, "deepspeed_zero3.yaml")
    difference = max_relative_difference(final_weights(zero3), final_weights(single))
    # SupCon at temperature 0.1 sharpens the rounding of the gathered batch: the whole parameter vector agrees to
    # 1e-5, but one zero-init bias (the last block's layernorm_after.bias, entries ~4e-3 after 3 Adam steps) was
    # 1.5e-4 off its largest entry (6e-7 absolute, measured); ArcFace stays within 1e-4.
    tolerance = 2e-4 if loss == "supcon" else 1e-4
    assert difference <= tolerance, f"max relative parameter difference {difference:.2e}"
    launched, reference = (json.loads((out / "metrics.json").read_text()) for out in (zero3, single))
    assert launched["train"]["world_size"] == 2 and launched["train"]["loss"] == reference["train"]["loss"]
    keys = ("precision_at_1", "recall_at_1", "r_precision", "mean_average_precision_at_r")
    for when in ("before", "validation"):
        for key in keys:
            assert launched[when][key] == pytest.approx(reference[when][key], abs=1e-9), (when, key)
    saved = saved_model_metrics(zero3, digits)
    for key in keys:
        assert saved[key] == pytest.approx(launched["validation"][key], abs=1e-9), key
    if arcface:  # the checkpoint holds step 2's centres (final/loss.safetensors the last step's)
        from vembed.components import recipe_from_dict
        from vembed.training.loop import Trainer

        centres = {out: checkpoint_parameters(out / "checkpoint-2")["loss.loss.W"] for out in (single, zero3)}
        untrained = Trainer(recipe_from_dict(dict(raw, output_dir=str(tmp_path / "untrained"))))
        untrained.build()  # the centres as built: seeded as in every run
        initial = untrained.objective.loss.loss.W.detach()
        assert centres[zero3].shape == initial.shape == (16, 3 * 2)
        moved = (centres[single] - initial).abs().max().item()
        difference = (centres[zero3] - centres[single]).abs().max().item()
        assert moved > 1e-3 and difference <= 1e-4 * centres[single].abs().max().item(), (moved, difference)


def checkpoint_parameters(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The objective's whole parameters in a checkpoint: accelerate's model.safetensors, or the partitions of a
    DeepSpeed ZeRO-3 checkpoint consolidated on one process (DeepSpeed's zero_to_fp32)."""
    from safetensors.torch import load_file

    if (checkpoint / "model.safetensors").is_file():
        return load_file(checkpoint / "model.safetensors")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag="pytorch_model")


def test_ntxent_over_two_views_pairs_each_image_with_its_other_view(digits, tmp_path):
    """positives: views: each image twice in the batch, labelled by its row, so its only positive is its other view;
    a class of one image is then fine."""
    from pytorch_metric_learning import losses

    from vembed.components import recipe_from_dict
    from vembed.recipe_checks import check_recipe
    from vembed.training.loop import Trainer

    (tmp_path / "train.csv").write_text("image,label\nzero/0.png,zero\nzero/10.png,zero\none/1.png,one\n")
    raw = recipe(digits, tmp_path / "run", loss_type="ntxent", positives="views", temperature=0.5, batch_size=3,
                 data={"train": str(tmp_path / "train.csv"), "image_root": str(digits / "train")})
    check_recipe(recipe_from_dict(raw))
    trainer = Trainer(recipe_from_dict(raw))
    trainer.build()
    batch = trainer.collate([trainer.dataset[i] for i in (2, 0, 1)])
    assert batch["labels"].tolist() == [2, 2, 0, 0, 1, 1]
    pixels = batch["inputs"]["pixel_values"]
    assert pixels.shape[0] == 6 and torch.equal(pixels[0], pixels[1]) and not torch.equal(pixels[1], pixels[2])
    with torch.no_grad():
        embeddings = trainer.objective.adapter.encode(batch["inputs"])
        loss = trainer.objective(batch)
    assert loss == losses.NTXentLoss(temperature=0.5)(embeddings, batch["labels"])
    assert trainer.objective.loss.config == {"name": "NTXentLoss", "temperature": 0.5, "positives": "views"}


def test_augmented_views_of_an_image_differ_and_replay(digits, tmp_path):
    """With augmentation, the two views of an image are two crops (what NT-Xent over views learns from), drawn per
    (seed, epoch, view) so they replay; mixup/cutmix, which mix labels, are refused."""
    from vembed.components import recipe_from_dict
    from vembed.errors import RecipeError
    from vembed.recipe_checks import check_recipe
    from vembed.training.loop import Trainer

    augmentation = {"crop_scale": [0.3, 0.6], "horizontal_flip": 0.5}
    raw = recipe(digits, tmp_path / "run", loss_type="ntxent", positives="views", batch_size=2,
                 augmentation=augmentation)
    check_recipe(recipe_from_dict(raw))
    trainer = Trainer(recipe_from_dict(raw))
    trainer.build()
    keys = [(0, 0), (0, 5)]
    pixels = trainer.collate([trainer.dataset[key] for key in keys])["inputs"]["pixel_values"]
    assert not torch.equal(pixels[0], pixels[1])  # two crops of image 0
    assert torch.equal(pixels, trainer.collate([trainer.dataset[key] for key in keys])["inputs"]["pixel_values"])
    later = trainer.collate([trainer.dataset[(1, 0)], trainer.dataset[(1, 5)]])["inputs"]["pixel_values"]
    assert not torch.equal(pixels, later)  # another epoch, other crops
    with pytest.raises(RecipeError, match="augmentation.mixup_alpha: mixes two images' labels"):
        check_recipe(recipe_from_dict(dict(raw, augmentation={**augmentation, "mixup_alpha": 0.2})))


def test_a_datasets_folder_trains_with_the_image_cache(digits, tmp_path, capsys):
    from tests.classification.test_classification import digits_dataset

    saved = digits_dataset(digits / "train", tmp_path)
    raw = recipe(digits, tmp_path / "run", max_steps=2,
                 data={"train": str(saved), "image_cache_dir": str(tmp_path / "cache")})
    assert train(raw, tmp_path / "recipe.yaml") == 0
    assert "36 images resized once, built in" in capsys.readouterr().out
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["train"]["steps"] == 2 and metrics["train"]["data"]["num_images"] == 36


def test_a_missing_pytorch_metric_learning_is_refused_with_the_recipe_before_a_weight_is_read(digits, tmp_path,
                                                                                               monkeypatch):
    import sys

    from vembed.components import recipe_from_dict
    from vembed.errors import RecipeError
    from vembed.recipe_checks import check_recipe

    monkeypatch.setitem(sys.modules, "pytorch_metric_learning", None)  # its import fails as when it is not installed
    parsed = recipe_from_dict(recipe(digits, tmp_path / "run"))
    with pytest.raises(RecipeError, match=rf"^environment error: loss_type: {parsed.loss_type} is computed by "
                                          "pytorch-metric-learning, which is not installed; pip install "
                                          r"'vembed\[metric-learning\]'$"):
        check_recipe(parsed)


@pytest.mark.slow
def test_class_balanced_batches_on_two_ranks_train_as_one_process(digits, tmp_path):
    """data.m_per_class under `accelerate launch` (2 gloo ranks of one class each, 3 images): the ranks' halves make
    up the global batch one process draws (3 of each of 2 classes), so the weights after 4 steps are one process's."""
    from launching import final_weights, max_relative_difference, one_process_and_launched

    data = dict(recipe(digits, tmp_path)["data"], m_per_class=3)
    raw = recipe(digits, tmp_path / "unused", batch_size=6, data=data)
    single, launched = one_process_and_launched(raw, tmp_path, "ddp_cpu.yaml", steps=4)
    difference = max_relative_difference(final_weights(launched), final_weights(single))
    assert difference <= 2e-4, f"max relative parameter difference {difference:.2e}"  # SupCon: see the ZeRO-3 test
