"""The composed adapter on a tiny BERT text tower + tiny ViT (and DINOv2) vision tower with learned projections."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vembed.data.records import Side
from vembed.errors import RecipeError


@pytest.fixture
def composed(build):
    return build("composed")


def test_embedding_size_is_the_projection_dim(composed):
    assert composed.embedding_dim == 24


def test_projection_dim_defaults_to_text_hidden_size(build, recipe_for):
    from vembed.models.composed import ComposedAdapter

    assert build("composed", projection_dim=None).embedding_dim == 32
    assert ComposedAdapter.embedding_dim_for(recipe_for("composed", projection_dim=None)) == 32


def test_features_are_pooled_then_projected(build, mixed_sides, checks):
    from vembed.models.pooling import pool

    adapter = build("composed", pooling="last", normalize=False)
    texts = [side for side in mixed_sides if side.image is None]
    images = [side for side in mixed_sides if side.text is None]
    with torch.no_grad():
        tokens = adapter.preprocess(texts)
        hidden = adapter.text_model(tokens["input_ids"], tokens["attention_mask"]).last_hidden_state
        expected = adapter.text_projection(pool(hidden, tokens["attention_mask"], "last"))
        torch.testing.assert_close(checks.encode(adapter, texts), expected, atol=1e-6, rtol=0)
        pooled = adapter.vision_model(adapter.preprocess(images)["pixel_values"]).pooler_output
        torch.testing.assert_close(checks.encode(adapter, images), adapter.vision_projection(pooled), atol=1e-6, rtol=0)


def test_image_falls_back_to_the_cls_token_without_a_pooler():
    from vembed.models.pooling import cls_or_pooler

    hidden = torch.randn(2, 5, 4)
    output = SimpleNamespace(pooler_output=None, last_hidden_state=hidden)
    torch.testing.assert_close(cls_or_pooler(output), hidden[:, 0])


def test_text_and_image_side_is_normalized_sum_of_both(composed, mixed_sides, checks):
    side = mixed_sides[2]
    text = checks.encode(composed, [Side(text=side.text)])
    image = checks.encode(composed, [Side(image=side.image)])
    torch.testing.assert_close(checks.encode(composed, [side]), checks.normalize(text + image), atol=1e-6, rtol=0)


def test_any_vision_tower_works_dinov2(build, recipe_for, mixed_sides, checks):
    vision = {"model_type": "dinov2", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "mlp_ratio": 1, "image_size": 32, "patch_size": 8}  # fmt: skip
    adapter = build("composed", vision_model_config=vision)
    checks.shapes_and_norms(adapter, mixed_sides)
    checks.mixed_batch_matches_parts(adapter, mixed_sides)


def test_saved_towers_load_with_plain_transformers(composed, mixed_sides, checks, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoImageProcessor, AutoModel, AutoTokenizer

    from vembed.data.images import load_image
    from vembed.models.pooling import pool

    composed.save(tmp_path)
    text_model = AutoModel.from_pretrained(tmp_path / "text").eval()
    vision_model = AutoModel.from_pretrained(tmp_path / "vision").eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "text")
    processor = AutoImageProcessor.from_pretrained(tmp_path / "vision", backend="pil")
    projections = load_file(str(tmp_path / "projections.safetensors"))
    texts = [side.text for side in mixed_sides if side.image is None]
    images = [load_image(side.image) for side in mixed_sides if side.text is None]
    tokens = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        text = pool(text_model(**tokens).last_hidden_state, tokens["attention_mask"], "mean")
        image = vision_model(**processor(images=images, return_tensors="pt")).pooler_output
    text, image = text @ projections["text_projection.weight"].T, image @ projections["vision_projection.weight"].T
    expected = torch.cat([text, image])
    ours = checks.encode(composed, [Side(text=t) for t in texts] + [Side(image=i) for i in images])
    torch.testing.assert_close(ours, checks.normalize(expected), atol=1e-5, rtol=0)


def test_lora_goes_into_both_towers_and_keeps_the_projections_trainable(composed, recipe_for):
    composed.apply_lora(recipe_for("composed", use_lora=True, lora_r=4, lora_alpha=8))
    assert composed.text_projection.weight.requires_grad and composed.vision_projection.weight.requires_grad
    towers = {name.split(".")[0] for name, _ in composed.named_parameters() if "lora_A" in name}
    assert towers == {"text_model", "vision_model"}


def test_lora_target_missing_from_one_tower_is_a_recipe_error(build, recipe_for):
    clip_vision = {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 37,
                   "num_hidden_layers": 1, "num_attention_heads": 4, "image_size": 32, "patch_size": 8}  # fmt: skip
    adapter = build("composed", vision_model_config=clip_vision)
    with pytest.raises(RecipeError, match="CLIPVisionModel"):  # BERT has query/value, CLIP's vision tower has not
        adapter.apply_lora(recipe_for("composed", use_lora=True, lora_target_modules=["query", "value"]))


def test_recipe_checks(recipe_for):
    from vembed.models.composed import ComposedAdapter

    with pytest.raises(RecipeError, match="model_name: is a .* setting; this recipe's model_type is composed"):
        ComposedAdapter.check_recipe(recipe_for("composed", model_name="somewhere"))
    with pytest.raises(RecipeError, match="text_model_name.*exactly one"):
        ComposedAdapter.check_recipe(recipe_for("composed", text_model_name="somewhere"))
    with pytest.raises(RecipeError, match="vision_model_name.*exactly one"):
        ComposedAdapter.check_recipe(recipe_for("composed", vision_model_config=None))
    with pytest.raises(RecipeError, match="vision_model_config.*model_type"):
        ComposedAdapter.check_recipe(recipe_for("composed", vision_model_config={"hidden_size": 32}))
    with pytest.raises(RecipeError, match="tokenizer_name"):
        ComposedAdapter.check_recipe(recipe_for("composed", tokenizer_name=None))
