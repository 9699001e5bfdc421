"""The CLIP adapter on a tiny random-init CLIPModel, plus the shared batch layout helpers it relies on."""

from __future__ import annotations

import pytest
import torch

from vembed.data.records import Side
from vembed.errors import RecipeError


@pytest.fixture
def clip(build):
    return build("clip")


def test_embedding_size_is_the_projection_dim(clip):
    assert clip.embedding_dim == 24


def test_unnormalized_text_and_image_rows_are_raw_projected_features(build, mixed_sides, checks):
    clip = build("clip", normalize=False)
    text_sides = [side for side in mixed_sides if side.image is None]
    image_sides = [side for side in mixed_sides if side.text is None]
    with torch.no_grad():
        tokens = clip.preprocess(text_sides)
        expected = clip.model.get_text_features(tokens["input_ids"], tokens["attention_mask"]).pooler_output
        torch.testing.assert_close(checks.encode(clip, text_sides), expected, atol=1e-6, rtol=0)
        pixels = clip.preprocess(image_sides)["pixel_values"]
        expected = clip.model.get_image_features(pixels).pooler_output
        torch.testing.assert_close(checks.encode(clip, image_sides), expected, atol=1e-6, rtol=0)
    fused = mixed_sides[2]  # text + image: unit-norm even with normalize false
    assert abs(checks.encode(clip, [fused]).norm().item() - 1) < 1e-5


def test_text_and_image_side_is_normalized_sum_of_both(clip, mixed_sides, checks):
    side = mixed_sides[2]
    text = checks.encode(clip, [Side(text=side.text)])
    image = checks.encode(clip, [Side(image=side.image)])
    torch.testing.assert_close(checks.encode(clip, [side]), checks.normalize(text + image), atol=1e-6, rtol=0)


def test_preprocess_layout_marks_text_and_image_rows(clip, mixed_sides):
    batch = clip.preprocess(mixed_sides)
    assert set(batch) == {"input_ids", "attention_mask", "pixel_values", "text_index", "image_index"}
    assert batch["text_index"].tolist() == [0, -1, 1, -1, 2, -1, 3]
    assert batch["image_index"].tolist() == [-1, 0, 1, 2, -1, 3, 4]
    assert batch["input_ids"].shape[0] == 4 and batch["pixel_values"].shape == (5, 3, 32, 32)
    assert all(isinstance(value, torch.Tensor) for value in batch.values())
    assert set(clip.preprocess(mixed_sides[:1])) == {"input_ids", "attention_mask", "text_index", "image_index"}
    assert set(clip.preprocess(mixed_sides[1:2])) == {"pixel_values", "text_index", "image_index"}


def test_empty_side_is_rejected(clip):
    with pytest.raises(ValueError, match="neither text nor an image"):
        clip.preprocess([Side(text="a star"), Side()])


def test_logit_scale_is_frozen(clip):
    assert not clip.model.logit_scale.requires_grad
    assert all(p.requires_grad for name, p in clip.named_parameters() if "logit_scale" not in name)


def test_saved_folder_loads_with_plain_transformers(clip, mixed_sides, checks, tmp_path):
    from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

    from vembed.data.images import load_image

    clip.save(tmp_path)
    model = CLIPModel.from_pretrained(tmp_path).eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    processor = AutoImageProcessor.from_pretrained(tmp_path, backend="pil")
    texts = [side.text for side in mixed_sides if side.image is None]
    images = [load_image(side.image) for side in mixed_sides if side.text is None]
    tokens = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        text = model.get_text_features(**tokens).pooler_output
        image = model.get_image_features(**processor(images=images, return_tensors="pt")).pooler_output
    ours = checks.encode(clip, [Side(text=t) for t in texts] + [Side(image=i) for i in images])
    torch.testing.assert_close(ours, checks.normalize(torch.cat([text, image])), atol=1e-5, rtol=0)


def test_lora_wraps_the_attention_projections_of_both_towers(clip, recipe_for):
    clip.apply_lora(recipe_for("clip", use_lora=True, lora_r=4, lora_alpha=8))
    wrapped = {name.split(".lora_A")[0].rsplit(".", 1)[-1] for name, _ in clip.named_parameters() if "lora_A" in name}
    assert wrapped == {"q_proj", "k_proj", "v_proj", "out_proj"}
    towers = {name.split(".")[1] for name, _ in clip.named_parameters() if "lora_A" in name}
    assert towers == {"text_model", "vision_model"}


def test_lora_target_that_matches_nothing_is_a_recipe_error(clip, recipe_for):
    with pytest.raises(RecipeError, match="lora_target_modules.*query"):
        clip.apply_lora(recipe_for("clip", use_lora=True, lora_target_modules=["q_proj", "query"]))


def test_recipe_checks(recipe_for):
    from vembed.models.clip import ClipAdapter

    with pytest.raises(RecipeError, match="tokenizer_name"):
        ClipAdapter.check_recipe(recipe_for("clip", tokenizer_name=None))
    with pytest.raises(RecipeError, match="projection_dim.*composed"):
        ClipAdapter.check_recipe(recipe_for("clip", projection_dim=8))
    with pytest.raises(RecipeError, match="model_name"):
        ClipAdapter.check_recipe(recipe_for("clip", model_name="somewhere"))
    with pytest.raises(RecipeError, match="model_config.*'bert'"):
        ClipAdapter.embedding_dim_for(recipe_for("clip", model_config={"model_type": "bert"}))


def test_attn_implementation_reaches_a_pretrained_model(clip, recipe_for, tmp_path):
    from vembed.models.clip import ClipAdapter

    clip.save(tmp_path)
    recipe = recipe_for(
        "clip", model_config=None, tokenizer_name=None, model_name=str(tmp_path), attn_implementation="eager"
    )
    assert ClipAdapter.from_recipe(recipe).model.config._attn_implementation == "eager"
