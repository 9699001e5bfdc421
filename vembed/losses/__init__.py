"""Losses on embeddings, chosen by `loss_type` through the LOSSES registry; `build_loss` adds the Matryoshka and the
FLOPS (sparse vectors) wrappers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vembed.losses.base import EmbeddingLoss
from vembed.registry import Registry

if TYPE_CHECKING:
    from vembed.recipe import Recipe

LOSSES: Registry[type[EmbeddingLoss]] = Registry(
    "loss_type", modules=("vembed.losses.contrastive", "vembed.losses.scored", "vembed.losses.triplet",
                          "vembed.losses.gist", "vembed.losses.late_interaction",
                          "vembed.losses.distillation")
)
# Losses on class logits (the classification task), apart: they take no embeddings and no Matryoshka wrapper.
CLASSIFICATION_LOSSES: Registry = Registry("loss_type", modules=("vembed.losses.classification",))
# Losses on labelled embeddings computed by pytorch-metric-learning (the metric_learning task): their own contract,
# embeddings and class ids, and their own parameters (ArcFace's centres).
METRIC_LOSSES: Registry = Registry("loss_type", modules=("vembed.losses.metric_learning", "vembed.losses.pml"))


def build_loss(recipe: "Recipe") -> EmbeddingLoss:
    loss = LOSSES.get(recipe.loss_type).from_recipe(recipe)
    if recipe.loss.mrl_dims:
        from vembed.losses.matryoshka import MatryoshkaLoss

        loss = MatryoshkaLoss(loss, recipe.loss.mrl_dims, recipe.loss.mrl_weights)
    if recipe.loss.flops_regularized:
        from vembed.losses.sparse import FlopsRegularizedLoss

        settings = recipe.loss
        loss = FlopsRegularizedLoss(loss, settings.flops_query_weight, settings.flops_document_weight,
                                    settings.flops_query_threshold, settings.flops_document_threshold)
    return loss


__all__ = ["CLASSIFICATION_LOSSES", "LOSSES", "METRIC_LOSSES", "EmbeddingLoss", "build_loss"]
