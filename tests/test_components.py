"""vembed/components.py: every recipe key is typed by the component that owns it; a key that only another adapter or
loss reads (a key that would do nothing) stops the run naming the key and its owner; the recipe format of the
toolkit vembed replaces gets vembed's names."""

from __future__ import annotations

import pytest

from vembed.components import CATALOG, recipe_from_dict
from vembed.errors import RecipeError
from vembed.recipe import RECIPE_KEYS, RENAMED_KEYS

COMPONENTS = [(selector, name) for selector in CATALOG.registries for name in CATALOG.names(selector)]


def keys_of(selector: str, name: str) -> set[str]:
    settings = CATALOG.settings_for(selector, name)
    return {field.alias or field_name for field_name, field in settings.model_fields.items()}


def test_every_adapter_generator_and_loss_is_covered():
    names = {name for _, name in COMPONENTS}
    assert {"clip", "siglip", "text", "composed", "qwen_vl", "blip3o_dit", "infonce", "flow_matching"} <= names


@pytest.mark.parametrize("selector, name", COMPONENTS)
def test_every_other_components_keys_are_refused_naming_the_owner(selector, name):
    own = keys_of(selector, name)
    foreign = {key for other in CATALOG.names(selector) for key in keys_of(selector, other)} - own
    assert foreign  # every component lacks some key another one has
    for key in sorted(foreign):
        with pytest.raises(RecipeError) as info:
            recipe_from_dict({selector: name, key: 1}, "r.yaml")
        owners = CATALOG.owners_of(key)[selector]
        assert info.value.key == key
        assert f"is {'an' if owners[0][0] in 'aeiou' else 'a'} {' / '.join(owners)} setting" in info.value.message
        assert f"this recipe's {selector} is {name}" in info.value.message


@pytest.mark.parametrize("selector, name", COMPONENTS)
def test_its_own_keys_are_accepted_and_typed_into_its_settings(selector, name):
    settings = CATALOG.settings_for(selector, name)
    required = {field.alias or key: "given" for key, field in settings.model_fields.items() if field.is_required()}
    for key in required:  # a key without a default (gist_guide): left out, one error naming it
        with pytest.raises(RecipeError) as info:
            recipe_from_dict({selector: name, **{k: v for k, v in required.items() if k != key}})
        assert info.value.key == key
    defaults = settings(**required).model_dump(by_alias=True)
    recipe = recipe_from_dict({selector: name, **defaults})
    part = recipe.model if selector == "model_type" else recipe.loss
    assert type(part) is settings and part.model_dump(by_alias=True) == defaults


def test_no_key_has_two_owners_of_different_kinds():
    """A flat key must go to exactly one place: the recipe, the adapter, or the loss."""
    model_keys = {key for name in CATALOG.names("model_type") for key in keys_of("model_type", name)}
    loss_keys = {key for name in CATALOG.names("loss_type") for key in keys_of("loss_type", name)}
    assert not (model_keys & loss_keys) and not (model_keys & set(RECIPE_KEYS)) and not (loss_keys & set(RECIPE_KEYS))


@pytest.mark.parametrize("key", sorted(RENAMED_KEYS))
def test_keys_of_the_replaced_toolkit_point_at_vembeds_name(key):
    with pytest.raises(RecipeError) as info:
        recipe_from_dict({key: 1})
    assert info.value.key == key and f"did you mean {RENAMED_KEYS[key]}?" in info.value.message


@pytest.mark.parametrize("raw, key, message", [
    ({"model_type": "clip", "query_instruction": "x"}, "query_instruction",
     "is a qwen_vl setting; this recipe's model_type is clip"),
    ({"model_type": "clip", "min_pixels": 4096}, "min_pixels", "is a qwen_vl / qwen_vl_reranker setting"),
    ({"model_type": "clip", "prompt_ending": "endoftext"}, "prompt_ending", "is a qwen_vl setting"),
    ({"model_type": "clip", "pooling": "cls"}, "pooling", "is a composed / text / vision setting"),
    ({"dit": {"size": "tiny"}}, "dit", "is a blip3o_dit setting; this recipe's model_type is clip"),
    ({"flow": {"num_steps": 4}}, "flow", "is a flow_matching setting; this recipe's loss_type is infonce"),
    ({"loss_type": "siglip", "query_query_loss": True}, "query_query_loss",
     "is an infonce setting; this recipe's loss_type is siglip"),
    ({"scheduler_type": "constant", "warmup_ratio": 0.1}, "warmup_ratio", "does nothing with scheduler_type constant"),
    ({"false_negative_margin": 0.2}, "false_negative_margin", "does nothing unless mask_false_negatives"),
])
def test_the_issues_silent_keys_now_stop_the_run(raw, key, message):
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(raw, "r.yaml")
    assert info.value.key == key and message in info.value.message and "\n" not in str(info.value)


def test_a_saved_recipe_reads_back_whatever_its_components():
    recipe = recipe_from_dict({"model_type": "qwen_vl", "model_name": "x", "mask_false_negatives": True,
                               "scheduler_type": "constant"})
    again = recipe_from_dict(recipe.to_dict())
    assert again == recipe and again.lora_r == 32  # qwen_vl's default LoRA rank, written out and read back
