"""The classification loss's class weights: `balanced` as scikit-learn computes it from the training labels, a given
list checked against the classes, the value torch's weighted cross-entropy gives, and the task handing the loss its
training labels."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from training_digits import digits_recipe, train_classifier, write_digit_splits


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    return write_digit_splits(tmp_path_factory.mktemp("digits"))


def test_balanced_weights_are_scikit_learns():
    from sklearn.utils.class_weight import compute_class_weight

    from vembed.classification.losses import class_weight_tensor

    labels = [0] * 7 + [1] * 2 + [2] * 11 + [3]
    expected = compute_class_weight("balanced", classes=np.arange(4), y=np.array(labels))
    np.testing.assert_allclose(class_weight_tensor("balanced", labels, 4).numpy(), expected, rtol=1e-12)
    assert torch.equal(class_weight_tensor([0.5, 1.0, 2.0, 4.0], labels, 4),
                       torch.tensor([0.5, 1.0, 2.0, 4.0], dtype=torch.float64))
    assert class_weight_tensor(None, labels, 4) is None


@pytest.mark.parametrize("weights, message", [
    ([1.0, 2.0], "class_weights: has 2 weights but there are 3 classes; give one per class, in label-id order"),
    ("balanced", "class_weights: balanced weighs each class by its training images, but class 2 has none"),
])
def test_weights_that_do_not_fit_the_classes_are_refused_in_one_line(weights, message):
    from vembed.classification.losses import class_weight_tensor
    from vembed.errors import RecipeError

    with pytest.raises(RecipeError) as error:
        class_weight_tensor(weights, [0, 1, 1], 3)
    assert len(str(error.value).splitlines()) == 1 and message in str(error.value)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_the_weighted_loss_is_torchs_weighted_cross_entropy(smoothing):
    from vembed.classification.losses import CrossEntropyLoss

    torch.manual_seed(0)
    logits, labels = torch.randn(8, 3), torch.tensor([0, 0, 0, 0, 0, 1, 1, 2])
    weights = torch.tensor([0.5, 1.5, 3.0])
    loss = CrossEntropyLoss(label_smoothing=smoothing, class_weights=weights)
    expected = F.cross_entropy(logits, labels, weight=weights, label_smoothing=smoothing)
    torch.testing.assert_close(loss(logits, labels), expected, atol=0, rtol=1e-6)  # a sum over the weight sum
    assert not torch.allclose(expected, F.cross_entropy(logits, labels, label_smoothing=smoothing))
    assert loss.config["class_weights"] == [0.5, 1.5, 3.0]
    assert "class_weights" not in CrossEntropyLoss().config


def _imbalanced_csv(digits, tmp_path) -> dict:
    """6 zeros, 3 ones and 2 twos of the digits' training tree as a CSV split."""
    rows = [f"{name}/{path.name},{name}" for name, count in (("zero", 6), ("one", 3), ("two", 2))
            for path in sorted((digits / "train" / name).iterdir())[:count]]
    (tmp_path / "train.csv").write_text("image,label\n" + "\n".join(rows) + "\n")
    return {"train": str(tmp_path / "train.csv"), "image_root": str(digits / "train")}


def test_the_task_weighs_the_loss_by_its_training_labels_and_a_relaunch_gets_the_same(digits, tmp_path):
    from sklearn.utils.class_weight import compute_class_weight

    from vembed.components import recipe_from_dict
    from vembed.training.loop import Trainer

    raw = digits_recipe(digits, tmp_path / "run", data=_imbalanced_csv(digits, tmp_path), class_weights="balanced",
                        label_smoothing=0.0)
    built = []
    for _ in range(2):  # a resumed run rebuilds the weights from the same data: they are no checkpoint state
        trainer = Trainer(recipe_from_dict(raw))
        trainer.build()
        built.append(trainer.accelerator.unwrap_model(trainer.model).loss.class_weights)
    names = trainer.recipe.model.label_names  # label ids in the order the task reads the classes
    labels = [names.index(name) for name, count in (("zero", 6), ("one", 3), ("two", 2)) for _ in range(count)]
    expected = compute_class_weight("balanced", classes=np.arange(3), y=np.array(labels))
    np.testing.assert_allclose(built[0].numpy(), expected, rtol=1e-6)
    assert torch.equal(built[0], built[1])


def test_a_weight_list_of_the_wrong_length_stops_the_launch_with_one_line(digits, tmp_path, capsys):
    raw = digits_recipe(digits, tmp_path / "run", class_weights=[1.0, 2.0])
    assert train_classifier(raw, tmp_path / "recipe.yaml") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "class_weights: has 2 weights but there are 3 classes" in err, err
    assert not (tmp_path / "run").exists()


def _weighted_rank_gradient(out: str) -> None:
    """One rank's half of a weighted batch through a shared linear head; the gradient DDP would average, saved."""
    import torch.distributed as dist

    from vembed.classification.losses import CrossEntropyLoss

    rank, world = dist.get_rank(), dist.get_world_size()
    features, labels, weights = _weighted_batch()
    head = torch.nn.Linear(features.shape[1], 4)
    _same_head(head)
    half = slice(rank * len(labels) // world, (rank + 1) * len(labels) // world)
    loss = CrossEntropyLoss(label_smoothing=0.1, class_weights=weights)(head(features[half]), labels[half])
    loss.backward()
    gradient = head.weight.grad.clone()
    dist.all_reduce(gradient)
    if rank == 0:
        torch.save(gradient / world, out)


def _same_head(head: torch.nn.Linear) -> None:
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(1)))
        head.bias.zero_()


def _weighted_batch():
    features = torch.randn(12, 6, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 0, 0, 0, 0, 1, 2, 3, 3, 1, 0, 2])  # rank 0 holds mostly class 0, rank 1 the rest
    return features, labels, torch.tensor([0.5, 2.0, 3.0, 1.5])


def test_weighted_loss_on_two_ranks_has_the_gradient_of_the_whole_batch(tmp_path):
    """Each rank's weighted sum over the global weight sum: DDP's gradient mean is the whole batch's weighted mean
    (the ranks' own weight sums differ here, 4.5 and 11.5, so per-rank means would not average to it)."""
    from ranks import run_on_ranks

    from vembed.classification.losses import CrossEntropyLoss

    out = tmp_path / "gradient.pt"
    run_on_ranks(_weighted_rank_gradient, str(out), world=2)
    features, labels, weights = _weighted_batch()
    head = torch.nn.Linear(features.shape[1], 4)
    _same_head(head)
    loss = CrossEntropyLoss(label_smoothing=0.1, class_weights=weights)(head(features), labels)
    expected = F.cross_entropy(head(features), labels, weight=weights, label_smoothing=0.1)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)  # one process: torch's weighted mean
    loss.backward()
    torch.testing.assert_close(torch.load(out, weights_only=True), head.weight.grad, atol=1e-6, rtol=1e-5)
