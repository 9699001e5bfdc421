"""The text adapter on a tiny random-init BERT: pooling under both paddings, persistence, LoRA, checkpointing."""

from __future__ import annotations

import pytest
import torch

from vembed.data.records import Side
from vembed.errors import RecipeError


@pytest.fixture
def text(build):
    return build("text")


def test_embedding_size_is_the_hidden_size(text):
    assert text.embedding_dim == 32


@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("pooling", ["cls", "mean", "last"])
def test_pooling_matches_direct_computation(build, text_sides, checks, pooling, padding_side):
    adapter = build("text", pooling=pooling, normalize=False)
    adapter.tokenizer.padding_side = padding_side
    batch = adapter.preprocess(text_sides)
    mask = batch["attention_mask"]
    assert (mask[:, 0] == 0).any() if padding_side == "left" else (mask[:, -1] == 0).any()  # padding really happens
    with torch.no_grad():
        hidden = adapter.model(input_ids=batch["input_ids"], attention_mask=mask).last_hidden_state
    expected = []
    for row in range(len(text_sides)):
        real = mask[row].nonzero().squeeze(-1)  # positions of real tokens
        tokens = hidden[row, real]
        expected.append({"cls": tokens[0], "mean": tokens.mean(0), "last": tokens[-1]}[pooling])
    torch.testing.assert_close(checks.encode(adapter, text_sides), torch.stack(expected), atol=1e-5, rtol=1e-5)


def test_image_sides_are_rejected(text, mixed_sides):
    with pytest.raises(ValueError, match="text only"):
        text.preprocess(mixed_sides)
    with pytest.raises(ValueError, match="text only"):
        text.preprocess([Side(text="a star", image=mixed_sides[1].image)])


def test_unused_pooler_is_frozen(text):
    frozen = {name for name, p in text.named_parameters() if not p.requires_grad}
    assert frozen and all(name.startswith("model.pooler.") for name in frozen)


def test_saved_folder_loads_with_plain_transformers(text, text_sides, checks, tmp_path):
    from transformers import AutoModel, AutoTokenizer

    from vembed.models.pooling import pool

    text.save(tmp_path)
    model = AutoModel.from_pretrained(tmp_path).eval()
    tokens = AutoTokenizer.from_pretrained(tmp_path)(
        [s.text for s in text_sides], padding=True, truncation=True, return_tensors="pt"
    )
    with torch.no_grad():
        pooled = pool(model(**tokens).last_hidden_state, tokens["attention_mask"], "mean")
    torch.testing.assert_close(checks.encode(text, text_sides), checks.normalize(pooled), atol=1e-5, rtol=0)


def test_lora_defaults_to_the_attention_projections_the_tower_has(text, recipe_for):
    text.apply_lora(recipe_for("text", use_lora=True, lora_r=4, lora_alpha=8))
    wrapped = {name.split(".lora_A")[0].rsplit(".", 1)[-1] for name, _ in text.named_parameters() if "lora_A" in name}
    assert wrapped == {"query", "key", "value"}  # the defaults that a BERT has


def test_lora_target_that_matches_nothing_is_a_recipe_error(text, recipe_for):
    with pytest.raises(RecipeError, match="q_proj.*query"):
        text.apply_lora(recipe_for("text", use_lora=True, lora_target_modules=["q_proj"]))


def test_recipe_checks(recipe_for, token_ids):
    from vembed.models.text import TextAdapter

    with pytest.raises(RecipeError, match="model_config.*model_type"):
        TextAdapter.check_recipe(recipe_for("text", model_config={"hidden_size": 32}))
    with pytest.raises(RecipeError, match="tokenizer_name"):
        TextAdapter.check_recipe(recipe_for("text", tokenizer_name=None))
    with pytest.raises(RecipeError, match="vision_model_name.*composed"):
        TextAdapter.check_recipe(recipe_for("text", vision_model_name="somewhere"))
    with pytest.raises(RecipeError, match="max_length.*16"):
        TextAdapter.from_recipe(recipe_for("text", max_length=64))
