"""Any pytorch-metric-learning loss and miner by name (`loss_type: pml`, vembed/classification/pml.py): each selectable
loss equals PML's own on the same embeddings and labels (value and gradient); a miner changes which pairs count as PML's
does; 2 gloo ranks give one process's loss and gradients for a representative five; bad names and arguments are one line
naming the key."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from metric_losses import LABELS, OUT, WORLD, B, check_two_ranks_equal_one_process
from torch import nn

pytest.importorskip("pytorch_metric_learning")

CLASSES = 4
BALANCED = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3])  # 3 of each class, as data.m_per_class: 3 gives
# Required arguments vembed cannot fill, as a user gives them.
GIVEN = {"RankedListLoss": {"margin": 0.4, "Tn": 10}}


def _embeddings() -> torch.Tensor:
    return F.normalize(torch.randn(WORLD * B, OUT, generator=torch.Generator().manual_seed(3)), dim=-1)


def _selectable() -> list[str]:
    from vembed.classification.pml import selectable_losses

    return list(selectable_losses())


def _ours(name: str, miner: str | None = None, **arguments):
    from vembed.classification.pml import PMLLoss

    torch.manual_seed(7)  # proxies, centres: drawn alike on every rank and in the single process
    return PMLLoss(name, {**GIVEN.get(name, {}), **arguments}, miner, None, num_classes=CLASSES, embedding_dim=OUT)


def _library(name: str, ours) -> nn.Module:
    """PML's class built as a PML user builds it, holding our loss's initial state (proxies, centres)."""
    from pytorch_metric_learning import losses

    from vembed.classification.pml import constructor_arguments

    accepted, _ = constructor_arguments(getattr(losses, name))
    sizes = {key: value for key, value in (("num_classes", CLASSES), ("embedding_size", OUT),
                                           ("descriptors_dim", OUT)) if key in accepted}
    reference = getattr(losses, name)(**GIVEN.get(name, {}), **sizes)
    reference.load_state_dict(ours.loss.state_dict())
    return reference


def _value_and_gradient(loss: nn.Module, embeddings: torch.Tensor, *extra, labels: torch.Tensor = LABELS,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = embeddings.clone().requires_grad_(True)
    value = loss(leaf, labels, *extra)
    value.backward()
    return value.detach(), leaf.grad


def test_every_library_miner_is_offered_and_nothing_else():
    from pytorch_metric_learning import miners

    from vembed.classification.pml import selectable_miners

    offered = selectable_miners()
    assert {"MultiSimilarityMiner", "BatchHardMiner", "TripletMarginMiner"} <= set(offered)
    assert "BaseMiner" not in offered
    assert all(isinstance(value, type) and issubclass(value, miners.BaseMiner) for value in offered.values())


def test_every_selectable_library_loss_is_offered():
    from pytorch_metric_learning import losses

    from vembed.classification.pml import NOT_SELECTABLE

    offered = set(_selectable())
    assert {"MultiSimilarityLoss", "ProxyAnchorLoss", "CircleLoss", "TripletMarginLoss", "ArcFaceLoss"} <= offered
    every = {name for name, value in vars(losses).items()
             if isinstance(value, type) and issubclass(value, losses.BaseMetricLossFunction)}
    assert offered | set(NOT_SELECTABLE) == every and not offered & set(NOT_SELECTABLE)


@pytest.mark.parametrize("name", _selectable() if __import__("importlib").util.find_spec("pytorch_metric_learning")
                         else [])
def test_each_loss_by_name_equals_the_librarys_own(name):
    from vembed.classification.pml import EQUAL_CLASS_COUNTS

    labels = BALANCED if name in EQUAL_CLASS_COUNTS else LABELS  # what data.m_per_class batches hold
    ours = _ours(name)
    expected_value, expected_gradient = _value_and_gradient(_library(name, ours), _embeddings(), labels=labels)
    value, gradient = _value_and_gradient(ours, _embeddings(), labels=labels)
    torch.testing.assert_close(value, expected_value, rtol=1e-6, atol=1e-7, equal_nan=True)
    torch.testing.assert_close(gradient, expected_gradient, rtol=1e-6, atol=1e-7, equal_nan=True)
    assert ours.config["name"] == name


def test_a_miner_changes_which_pairs_count_as_the_librarys_does():
    from pytorch_metric_learning import losses, miners

    ours = _ours("TripletMarginLoss", "BatchHardMiner", margin=0.1)
    library = losses.TripletMarginLoss(margin=0.1)
    mined = miners.BatchHardMiner()(_embeddings(), LABELS)
    expected_value, expected_gradient = _value_and_gradient(library, _embeddings(), mined)
    value, gradient = _value_and_gradient(ours, _embeddings())
    torch.testing.assert_close(value, expected_value, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(gradient, expected_gradient, rtol=1e-6, atol=1e-7)
    every_triplet, _ = _value_and_gradient(_ours("TripletMarginLoss", margin=0.1), _embeddings())
    assert abs(value - every_triplet) > 1e-3  # the miner's hardest triplets, not all of them


def test_object_arguments_by_name_are_the_library_objects():
    from pytorch_metric_learning import distances, losses

    ours = _ours("ContrastiveLoss", distance="CosineSimilarity", pos_margin=1, neg_margin=0)
    assert isinstance(ours.loss.distance, distances.CosineSimilarity)
    library = losses.ContrastiveLoss(distance=distances.CosineSimilarity(), pos_margin=1, neg_margin=0)
    torch.testing.assert_close(ours(_embeddings(), LABELS), library(_embeddings(), LABELS), rtol=1e-6, atol=1e-7)


# --- two ranks: one process's loss and gradients (encoder and the loss's own proxies) ---------------------------------

RANKED = {"multi_similarity_mined": ("MultiSimilarityLoss", "MultiSimilarityMiner"), "proxy_anchor": ("ProxyAnchorLoss",
          None), "circle": ("CircleLoss", None), "triplet_hard": ("TripletMarginLoss", "BatchHardMiner"),
          "soft_triple": ("SoftTripleLoss", None)}


def _ranked_losses() -> dict:
    return {key: _ours(name, miner) for key, (name, miner) in RANKED.items()}


@pytest.mark.slow
def test_two_ranks_give_the_loss_and_gradients_of_one_process_on_the_whole_batch(tmp_path):
    ranks = check_two_ranks_equal_one_process(tmp_path, _ranked_losses)
    assert any(name.startswith("loss.loss.") for name in ranks[0]["proxy_anchor"]["grads"])  # proxies trained


# --- the recipe: one line naming the key --------------------------------------------------------------------------


@pytest.mark.parametrize("changes, key, words", [
    ({}, "pml_loss", "required"),
    ({"pml_loss": "MultiSimilarityLos"}, "pml_loss", "is not a pytorch-metric-learning loss (did you mean "
                                                     "MultiSimilarityLoss?)"),
    ({"pml_loss": "VICRegLoss"}, "pml_loss", "cannot be used: self-supervised"),
    ({"pml_loss": "MultiSimilarityLoss", "pml_arguments": {"alpha": 2, "gamma": 1}}, "pml_arguments.gamma",
     "MultiSimilarityLoss takes no argument 'gamma'; it takes: alpha, base, beta, distance, embedding_reg_weight, "
     "embedding_regularizer, reducer"),
    ({"pml_loss": "ProxyAnchorLoss", "pml_arguments": {"num_classes": 3}}, "pml_arguments.num_classes",
     "is filled by vembed"),
    ({"pml_loss": "RankedListLoss", "pml_arguments": {"margin": 0.4}}, "pml_arguments",
     "RankedListLoss requires Tn; give them, e.g. pml_arguments.Tn=<value>"),
    ({"pml_loss": "RankedListLoss"}, "pml_arguments", "RankedListLoss requires margin, Tn; give them"),
    ({"pml_loss": "TripletMarginLoss", "miner": "BatchHardMiners"}, "miner", "did you mean BatchHardMiner?"),
    ({"pml_loss": "TripletMarginLoss", "miner": "TripletMarginMiner", "miner_arguments": {"margn": 0.2}},
     "miner_arguments.margn", "TripletMarginMiner takes no argument 'margn' (did you mean margin?)"),
    ({"pml_loss": "TripletMarginLoss", "miner_arguments": {"margin": 0.2}}, "miner_arguments",
     "are given but miner is not"),
    ({"pml_loss": "SmoothAPLoss"}, "pml_loss", "SmoothAPLoss needs the same number of images of every class in a "
                                               "batch; set data.m_per_class"),
])
def test_a_bad_name_or_argument_is_one_line_naming_the_key(changes, key, words):
    from vembed.components import recipe_from_dict
    from vembed.errors import RecipeError

    raw = {"model_type": "vision", "model_config": {"model_type": "vit", "hidden_size": 32, "num_hidden_layers": 1,
                                                    "num_attention_heads": 4, "intermediate_size": 37,
                                                    "image_size": 32, "patch_size": 8},
           "loss_type": "pml", "data": {"train": "train"}, **changes}
    from vembed.classification.pml import PMLLoss

    with pytest.raises(RecipeError) as refused:  # as the recipe is read, else by the loss's check with the recipe
        PMLLoss.check_recipe(recipe_from_dict(raw))
    assert refused.value.key == key and words in str(refused.value), str(refused.value)
    assert "\n" not in str(refused.value)
