"""model_type vision: pooling over the right tokens (DINOv2's registers are not patches), GeM, the head saved and
loaded with the backbone, and what it refuses."""

from __future__ import annotations

import pytest
import torch

from tests.models.conftest import NO_DROPOUT, SMALL_VISION

DINO_REGISTERS = {"model_type": "dinov2_with_registers", **SMALL_VISION, "num_register_tokens": 4, **NO_DROPOUT}


def _adapter(recipe_for, config, **settings):
    from vembed.models import MODELS

    torch.manual_seed(0)
    return MODELS.get("vision").from_recipe(recipe_for("vision", model_config=config, **settings)).eval()


def _hidden(adapter, inputs):
    with torch.no_grad():
        return adapter.model(pixel_values=inputs["pixel_values"]).last_hidden_state


@pytest.mark.parametrize("config", [{"model_type": "vit", **SMALL_VISION}, {"model_type": "dinov2", **SMALL_VISION},
                                    DINO_REGISTERS], ids=["vit", "dinov2", "dinov2_registers"])
def test_pooling_reads_cls_or_the_patch_tokens_only(recipe_for, image_sides, config):
    patches = (32 // 8) ** 2
    for pooling in ("cls", "mean", "gem"):
        adapter = _adapter(recipe_for, config, pooling=pooling, projection_dim=None, normalize=False, gem_p=2.0)
        inputs = adapter.preprocess(image_sides)
        hidden = _hidden(adapter, inputs)
        assert hidden.shape[1] == patches + 1 + config.get("num_register_tokens", 0)
        expected = {"cls": hidden[:, 0], "mean": hidden[:, -patches:].mean(1),
                    "gem": hidden[:, -patches:].clamp(min=1e-6).pow(2).mean(1).sqrt()}[pooling]
        with torch.no_grad():
            torch.testing.assert_close(adapter.encode(inputs), expected, atol=1e-5, rtol=1e-5)


def test_clip_and_siglip_vision_towers_embed(recipe_for, image_sides):
    for model_type in ("clip_vision_model", "siglip_vision_model"):
        for pooling in ("cls", "mean"):
            adapter = _adapter(recipe_for, {"model_type": model_type, **SMALL_VISION}, pooling=pooling)
            with torch.no_grad():
                out = adapter.encode(adapter.preprocess(image_sides))
            assert out.shape == (len(image_sides), 24) and torch.isfinite(out).all()


def test_the_head_and_class_names_are_saved_with_the_backbone(recipe_for, image_sides, tmp_path):
    from transformers import AutoModel

    import vembed.models as models

    adapter = _adapter(recipe_for, {"model_type": "vit", **SMALL_VISION}, label_names=["cat", "dog", "fox"])
    with torch.no_grad():
        torch.nn.init.normal_(adapter.classifier.weight)
    adapter.save(tmp_path)
    loaded = models.load_adapter(tmp_path).eval()
    assert loaded.settings.label_names == ["cat", "dog", "fox"] and loaded.settings.num_labels == 3
    inputs = adapter.preprocess(image_sides)
    with torch.no_grad():
        torch.testing.assert_close(loaded.classify(inputs), adapter.classify(inputs), atol=1e-6, rtol=0)
    AutoModel.from_pretrained(tmp_path)  # the backbone folder stays plain transformers


def test_text_sides_and_non_vision_configs_are_refused(recipe_for, tiny_tokenizer_dir):
    from vembed.data.records import Side
    from vembed.errors import RecipeError

    adapter = _adapter(recipe_for, {"model_type": "vit", **SMALL_VISION})
    with pytest.raises(ValueError, match="embeds images only"):
        adapter.preprocess([Side(text="a cat")])
    with pytest.raises(RecipeError, match="not a vision backbone"):
        _adapter(recipe_for, {"model_type": "blip"})  # image and text towers, but not a dual encoder vembed drives
    with pytest.raises(RecipeError, match="label_names: names 2 classes but num_labels is 3"):
        _adapter(recipe_for, {"model_type": "vit", **SMALL_VISION}, label_names=["a", "b"])
