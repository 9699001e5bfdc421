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
# The losses on class logits and on labelled embeddings are the image-label wing's (vembed.classification).


def build_loss(recipe: "Recipe") -> EmbeddingLoss:
    loss = LOSSES.get(recipe.loss_type).from_recipe(recipe)
    if recipe.loss.mrl_dims:
        from vembed.losses.matryoshka import MatryoshkaLoss

        loss = MatryoshkaLoss(loss, recipe.loss.mrl_dims, recipe.loss.mrl_weights)
    if recipe.loss.flops_regularized:
        from vembed.losses.sparse import FlopsRegularizedLoss

        settings = recipe.loss
        loss = FlopsRegularizedLoss(loss, settings.flops_query_weight, settings.flops_document_weight,
                                    settings.flops_query_threshold, settings.flops_document_threshold,
                                    settings.flops_warmup_ratio, settings.flops_warmup)
    return loss


__all__ = ["LOSSES", "EmbeddingLoss", "build_loss"]
