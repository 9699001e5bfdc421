"""Reading a recipe with its components: every key typed by the component that owns it.

`model_type` names an adapter in MODELS (or a generator in GENERATORS), `loss_type` a loss in LOSSES (or
FLOW_LOSSES); each declares the recipe keys it reads as a
`Settings` class beside itself (`ClipAdapter.Settings`, `InfoNCELoss.Settings`, ...). This module hands those
registries to the recipe parser (`vembed/recipe.py` imports nothing above it), so `load_recipe` and
`recipe_from_dict` return a recipe whose `recipe.model` and `recipe.loss` are the chosen components' settings, and a
key that only another adapter or loss reads stops the run naming its owner:

    recipe error: query_instruction: is a qwen_vl setting; this recipe's model_type is clip (...)
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from vembed import recipe as schema
from vembed.classification import CLASSIFICATION_LOSSES, METRIC_LOSSES
from vembed.errors import RecipeError, did_you_mean
from vembed.generation import FLOW_LOSSES, GENERATORS
from vembed.losses import LOSSES
from vembed.models import MODELS
from vembed.reranking import RANKING_LOSSES, RERANKERS

if TYPE_CHECKING:
    from vembed.recipe import Recipe, Settings
    from vembed.registry import Registry


class RegistryCatalog:
    """The recipe parser's view of the registries (`vembed.recipe.Catalog`): for each selector key, the registries
    whose entries it names, every entry with a `Settings` class."""

    def __init__(self, registries: dict[str, tuple["Registry", ...]]):
        self.registries = registries

    def names(self, selector: str) -> list[str]:
        return sorted(name for registry in self.registries[selector] for name in registry.names())

    def component(self, selector: str, name: str) -> Any:
        """The class `selector: name` picks, e.g. `component("model_type", "clip")` is ClipAdapter."""
        for registry in self.registries[selector]:
            if name in registry:
                return registry.get(name)
        names = self.names(selector)
        hint = did_you_mean(name, names) or f" (choose one of: {', '.join(names)})"
        raise RecipeError(selector, f"unknown {selector} {name!r}{hint}")

    def settings_for(self, selector: str, name: str) -> type["Settings"]:
        return self.component(selector, name).Settings

    def owners_of(self, key: str) -> dict[str, list[str]]:
        owners: dict[str, list[str]] = {}
        for selector in self.registries:
            names = [name for name in self.names(selector) if key in _keys(self.settings_for(selector, name))]
            if names:
                owners[selector] = names
        return owners


def _keys(settings: type["Settings"]) -> set[str]:
    return {field.alias or name for name, field in settings.model_fields.items()}


# Embedding adapters and losses, then the generative path's (vembed.generation), then rerankers' (vembed.reranking),
# then losses on class logits, then metric-learning losses on labelled embeddings.
CATALOG = RegistryCatalog({"model_type": (MODELS, GENERATORS, RERANKERS),
                           "loss_type": (LOSSES, FLOW_LOSSES, RANKING_LOSSES, CLASSIFICATION_LOSSES,
                                         METRIC_LOSSES)})


def recipe_from_dict(raw: dict[str, Any], source: str | None = None) -> "Recipe":
    """Validate a flat recipe mapping (as a YAML recipe holds it) into a `Recipe`; `source` names it in errors."""
    return schema.recipe_from_dict(raw, source, CATALOG)


def load_recipe(path: str | os.PathLike, overrides: list[str] | None = None) -> "Recipe":
    """Read a YAML recipe, apply `key=value` overrides (dotted keys reach into sections), validate."""
    return schema.load_recipe(path, overrides, CATALOG)


def model_class(recipe: "Recipe") -> Any:
    """The class of the recipe's model (`model_type`)."""
    return CATALOG.component("model_type", recipe.model_type)


def loss_class(recipe: "Recipe") -> Any:
    """The class of the recipe's loss (`loss_type`)."""
    return CATALOG.component("loss_type", recipe.loss_type)


__all__ = ["CATALOG", "RegistryCatalog", "load_recipe", "loss_class", "model_class", "recipe_from_dict"]
