"""The SigLIP adapter on a tiny random-init SiglipModel: what it shares with CLIP, and where it differs."""

from __future__ import annotations

import pytest
import torch

from vembed.data.records import Side
from vembed.errors import RecipeError


@pytest.fixture
def siglip(build):
    return build("siglip")


def test_embedding_size_is_the_vision_width(siglip):
    assert siglip.embedding_dim == 32


def test_texts_are_padded_to_a_fixed_length(siglip):
    # SigLIP pools the last position, so a text must not depend on how long its batch-mates are.
    short = siglip.preprocess([Side(text="a star")])["input_ids"]
    long = siglip.preprocess([Side(text="a star"), Side(text="two black lines crossing on white")])["input_ids"]
    assert short.shape[1] == long.shape[1] == siglip.settings.max_length == 16


def test_text_and_image_side_is_normalized_sum_of_both(siglip, mixed_sides, checks):
    side = mixed_sides[6]
    text = checks.encode(siglip, [Side(text=side.text)])
    image = checks.encode(siglip, [Side(image=side.image)])
    torch.testing.assert_close(checks.encode(siglip, [side]), checks.normalize(text + image), atol=1e-6, rtol=0)


def test_logit_scale_and_bias_are_frozen(siglip):
    frozen = {name for name, p in siglip.named_parameters() if not p.requires_grad}
    assert frozen == {"model.logit_scale", "model.logit_bias"}


def test_saved_folder_loads_with_plain_transformers(siglip, mixed_sides, checks, tmp_path):
    from transformers import AutoImageProcessor, AutoTokenizer, SiglipModel

    from vembed.data.images import load_image

    siglip.save(tmp_path)
    model = SiglipModel.from_pretrained(tmp_path).eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    processor = AutoImageProcessor.from_pretrained(tmp_path, backend="pil")
    texts = [side.text for side in mixed_sides if side.image is None]
    images = [load_image(side.image) for side in mixed_sides if side.text is None]
    tokens = tokenizer(texts, padding="max_length", truncation=True, max_length=16, return_tensors="pt")
    with torch.no_grad():
        text = model.get_text_features(**tokens).pooler_output
        image = model.get_image_features(**processor(images=images, return_tensors="pt")).pooler_output
    ours = checks.encode(siglip, [Side(text=t) for t in texts] + [Side(image=i) for i in images])
    torch.testing.assert_close(ours, checks.normalize(torch.cat([text, image])), atol=1e-5, rtol=0)


def test_lora_leaves_the_pooling_heads_attention_alone(siglip, recipe_for):
    siglip.apply_lora(recipe_for("siglip", use_lora=True, lora_r=4, lora_alpha=8))
    assert any("lora_" in name for name, _ in siglip.named_parameters())
    # The pooling head's nn.MultiheadAttention reads out_proj.weight directly; LoRA there would never run.
    assert not any("head.attention" in name and "lora_" in name for name, _ in siglip.named_parameters())


def test_towers_of_different_width_are_a_recipe_error(recipe_for, token_ids):
    from vembed.models.siglip import SiglipAdapter

    config = {"text_config": {"hidden_size": 32, **token_ids}, "vision_config": {"hidden_size": 48}}
    with pytest.raises(RecipeError, match="projection_size"):
        SiglipAdapter.embedding_dim_for(recipe_for("siglip", model_config=config))
