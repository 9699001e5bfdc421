"""model_type vision over a whole CLIP/SigLIP model: its image side is the backbone, and `head_init: class_names`
starts the head from the text tower's embeddings of the class names, so step 0 gives the model's own zero-shot
logits (HF logits_per_image); what it refuses."""

from __future__ import annotations

import pytest
import torch

from vembed.errors import RecipeError

NAMES = ["a red square", "a blue circle", "a small yellow star"]


@pytest.fixture(scope="module", params=["clip", "siglip"])
def dual_folder(request, build, tmp_path_factory):
    """A tiny random-init dual encoder saved as a run saves final/ (HF weights, tokenizer, image processor)."""
    path = tmp_path_factory.mktemp(request.param)
    build(request.param, seed=3).save(path)
    return request.param, path


def _vision(recipe_for, folder, **settings):
    from vembed.models import MODELS

    raw = {"model_name": str(folder), "model_config": None, "projection_dim": None, "num_labels": len(NAMES),
           "label_names": NAMES, "head_init": "class_names", **settings}
    torch.manual_seed(0)
    return MODELS.get("vision").from_recipe(recipe_for("vision", **raw)).eval()


def _zero_shot_logits(model_type, folder, prompts, pixels):
    """The dual encoder's own logits_per_image (scale x cosine, + SigLIP's bias), texts padded as it was trained."""
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    padding = {"clip": True, "siglip": "max_length"}[model_type]  # both truncated at the 16 positions
    tokens = tokenizer(prompts, padding=padding, truncation=True, max_length=16, return_tensors="pt")
    with torch.no_grad():
        return model(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"],
                     pixel_values=pixels).logits_per_image


def test_step_zero_logits_are_the_dual_encoders_zero_shot_logits(recipe_for, dual_folder, image_sides):
    model_type, folder = dual_folder
    adapter = _vision(recipe_for, folder, class_name_template="{}, drawn")
    inputs = adapter.preprocess(image_sides)
    with torch.no_grad():
        logits = adapter.classify(inputs)
    expected = _zero_shot_logits(model_type, folder, [f"{name}, drawn" for name in NAMES], inputs["pixel_values"])
    torch.testing.assert_close(logits, expected, atol=1e-6, rtol=0)
    assert logits.std(1).min() > 0.01  # the classes score apart: the head is not constant


def test_the_image_side_is_the_image_embedding_and_a_random_head_reads_it_unnormalised(recipe_for, dual_folder,
                                                                                     image_sides):
    from transformers import AutoModel

    model_type, folder = dual_folder
    adapter = _vision(recipe_for, folder, head_init="random")
    inputs = adapter.preprocess(image_sides)
    with torch.no_grad():
        expected = AutoModel.from_pretrained(folder).eval().get_image_features(inputs["pixel_values"]).pooler_output
        torch.testing.assert_close(adapter.features(inputs), expected, atol=1e-6, rtol=0)
        torch.testing.assert_close(adapter.classify(inputs), adapter.classifier(expected), atol=1e-6, rtol=0)
    assert adapter.settings.pooling == "pooler" and adapter.embedding_dim == expected.shape[1]
    assert all(p.requires_grad for p in adapter.parameters())  # the tower's pooling head is reached, so trained


def test_the_head_saves_and_reloads_over_the_vision_tower_alone(recipe_for, dual_folder, image_sides, tmp_path):
    from transformers import AutoModel

    from vembed.models import load_adapter

    model_type, folder = dual_folder
    adapter = _vision(recipe_for, folder)
    with torch.no_grad():
        adapter.classifier.weight.mul_(torch.linspace(0.5, 2, len(NAMES))[:, None])  # as if trained
    adapter.save(tmp_path)
    loaded = load_adapter(tmp_path).eval()
    assert loaded.settings.head_init == "class_names" and loaded.settings.label_names == NAMES
    inputs = adapter.preprocess(image_sides)
    with torch.no_grad():
        torch.testing.assert_close(loaded.classify(inputs), adapter.classify(inputs), atol=1e-6, rtol=0)
    assert AutoModel.from_pretrained(tmp_path).config.model_type == f"{model_type}_vision_model"


def test_the_meta_build_has_the_real_builds_parameters(recipe_for, dual_folder):
    from vembed.models import MODELS

    _, folder = dual_folder
    recipe = recipe_for("vision", model_name=str(folder), model_config=None, projection_dim=None,
                        head_init="class_names", num_labels=len(NAMES), label_names=NAMES)
    real = {name: p.shape for name, p in _vision(recipe_for, folder).named_parameters()}
    assert {name: p.shape for name, p in MODELS.get("vision").on_meta(recipe).named_parameters()} == real
    assert MODELS.get("vision").embedding_dim_for(recipe) == real["classifier.weight"][1]


def test_class_names_without_a_text_tower_and_keys_the_dual_encoder_decides_are_refused(recipe_for, dual_folder):
    from tests.models.conftest import SMALL_VISION

    model_type, folder = dual_folder
    with pytest.raises(RecipeError, match="head_init: class_names embeds the class names with a CLIP/SigLIP text "
                                          "tower, but model_config builds a 'vit' model, which has none"):
        _vision(recipe_for, None, model_name=None, model_config={"model_type": "vit", **SMALL_VISION})
    for key, value in (("pooling", "mean"), ("projection_dim", 8)):
        with pytest.raises(RecipeError, match=f"error: {key}: is decided by the {model_type} model that model_name"):
            _vision(recipe_for, folder, **{key: value})


@pytest.mark.parametrize("template", ["a photo", "{} and {}", "a {0} photo", "{name}", "{{}}", "a {"])
def test_a_template_without_one_name_slot_is_refused(recipe_for, template):
    from vembed.recipe import InvalidKey

    with pytest.raises((RecipeError, InvalidKey, ValueError), match="class_name_template"):
        recipe_for("vision", class_name_template=template)


def test_a_head_built_partitioned_is_refused_rather_than_left_random(recipe_for, dual_folder):
    from vembed.models import MODELS

    model_type, folder = dual_folder
    adapter = _vision(recipe_for, folder)
    adapter.classifier.weight.ds_id = 7  # what DeepSpeed's partitioned construction (zero3_init_flag) marks
    dual = MODELS.get(model_type).load(folder)
    with pytest.raises(RecipeError, match="head_init: class_names embeds the class names on each rank"):
        adapter.head_from_class_names(dual)
