"""qwen_vl's token vectors (`embedding: multi_vector`, ColQwen) on a tiny random-init Qwen3-VL: which positions give
vectors (every attended token, text and image alike), the projection (bias-free, outside LoRA, trained fully),
saving and loading, and the keys."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vembed.data.records import Side
from vembed.errors import RecipeError
from vembed.models.token_vectors import token_mask

DIM = 16


def _image(seed: int, size: tuple[int, int]):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8))


def _queries() -> list[Side]:
    return [Side(text="a photo of a red square", role="query"), Side(text="a star", role="query")]


def _documents() -> list[Side]:
    """Page screenshots of different sizes (so different numbers of image tokens), one with a caption."""
    return [Side(image=_image(1, (32, 32)), role="document"), Side(image=_image(2, (16, 16)), role="document"),
            Side(text="a small yellow star", image=_image(3, (24, 16)), role="document")]


@pytest.fixture
def colqwen(build):
    return build("qwen_vl", embedding="multi_vector", multi_vector_dim=DIM, query_instruction="Find the page.")


def _encode(adapter, sides):
    with torch.no_grad():
        return adapter.encode(adapter.preprocess(sides))


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_every_attended_token_gives_the_projected_normalised_state(colqwen, padding_side):
    colqwen.tokenizer.padding_side = padding_side
    for sides in (_queries(), _documents()):
        batch = colqwen.preprocess(sides)
        vectors = _encode(colqwen, sides)
        with torch.no_grad():
            keys = ("input_ids", "attention_mask", "mm_token_type_ids", "image_grid_thw", "pixel_values")
            hidden = colqwen.model(**{k: batch[k] for k in keys if k in batch}).last_hidden_state
        attended = batch["attention_mask"].bool()
        assert vectors.shape == (len(sides), batch["input_ids"].shape[1], DIM) and vectors.dtype == torch.float32
        assert torch.equal(token_mask(vectors), attended)  # padding is the zero vector, every other position a token
        expected = F.normalize(hidden @ colqwen.projection.weight.T, dim=-1)
        torch.testing.assert_close(vectors[attended], expected[attended], atol=1e-5, rtol=0)
    image_tokens = batch["input_ids"] == colqwen.model.config.image_token_id
    assert image_tokens.sum(1).tolist() == [16, 4, 6]  # image tokens are token vectors too (32x32 -> 16, ...)
    assert token_mask(vectors)[image_tokens].all()


def test_instructions_and_chat_format_are_the_adapters(colqwen):
    query, document = _queries()[0], Side(text="a photo of a red square", role="document")
    assert "Find the page." in colqwen.prompt(query) and "Find the page." not in colqwen.prompt(document)
    assert not torch.allclose(_encode(colqwen, [query])[0, -1], _encode(colqwen, [document])[0, -1], atol=1e-4)


def test_saved_colqwen_reloads_with_its_projection_and_gives_the_same_vectors(colqwen, tmp_path):
    import vembed

    colqwen.save(tmp_path)
    assert (tmp_path / "1_Dense" / "model.safetensors").is_file()
    model = vembed.load(str(tmp_path), device="cpu")
    assert model.multi_vector and model.embedding_dim == DIM
    queries = model.encode_token_vectors([s.text for s in _queries()], role="query")
    documents = model.encode_token_vectors(images=[s.image for s in _documents()[:2]], role="document")
    torch.testing.assert_close(queries, _encode(colqwen, _queries()), atol=1e-6, rtol=0)
    torch.testing.assert_close(documents, _encode(colqwen, _documents()[:2]), atol=1e-6, rtol=0)
    assert model.score(queries, documents).shape == (2, 2)


def test_lora_leaves_the_projection_unwrapped_and_fully_trained(colqwen, recipe_for, tmp_path):
    from vembed.models import load_adapter

    colqwen.apply_lora(recipe_for("qwen_vl", embedding="multi_vector", multi_vector_dim=DIM, use_lora=True, lora_r=4))
    trainable = [name for name, p in colqwen.named_parameters() if p.requires_grad]
    assert any("lora_" in name for name in trainable) and "projection.weight" in trainable
    assert all("lora_" in name or name == "projection.weight" for name in trainable), trainable
    assert type(colqwen.projection) is torch.nn.Linear and colqwen.projection.bias is None  # not LoRA-wrapped
    with torch.no_grad():  # lora_B starts at zero; give it weight so the merge is actually tested
        for name, p in colqwen.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5, generator=torch.Generator().manual_seed(len(name)))
    sides = _queries() + _documents()
    expected = _encode(colqwen, sides)
    colqwen.save(tmp_path)
    loaded = load_adapter(tmp_path).eval()
    assert not any("lora_" in name for name, _ in loaded.named_parameters())  # merged
    torch.testing.assert_close(loaded.projection.weight, colqwen.projection.weight, atol=0, rtol=0)
    torch.testing.assert_close(_encode(loaded, sides), expected, atol=1e-5, rtol=0)  # merging rounds a little


def test_planned_on_meta_with_the_token_vector_size(recipe_for):
    from vembed.models import MODELS

    recipe = recipe_for("qwen_vl", embedding="multi_vector", multi_vector_dim=DIM)
    adapter = MODELS.get("qwen_vl").on_meta(recipe)
    assert adapter.embedding_dim == MODELS.get("qwen_vl").embedding_dim_for(recipe) == DIM
    assert adapter.projection.weight.shape == (DIM, 48) and adapter.projection.weight.is_meta


@pytest.mark.parametrize("changes, key", [
    ({"multi_vector_dim": 64}, "multi_vector_dim"),  # a token-vector key with embedding: single
    ({"embedding": "multi_vector", "normalize": False}, "normalize"),
])
def test_bad_token_vector_keys_name_the_key(recipe_for, changes, key):
    with pytest.raises(RecipeError) as err:
        recipe_for("qwen_vl", **changes)
    assert err.value.key == key


def test_card_states_what_the_vectors_depend_on_and_loads_pages_as_images(colqwen, tmp_path):
    import re

    import yaml

    from vembed.model_card import code_blocks, folder_card, render_card

    colqwen.save(tmp_path)
    card = render_card(folder_card(tmp_path), load_path="m")
    assert {"ColPali", "ColQwen", "image-feature-extraction"} <= set(yaml.safe_load(card.split("---\n")[1])["tags"])
    assert "ColBERT" not in card and "PyLate" not in card and "SentenceTransformer(" not in card
    assert f"Token vectors (ColQwen late interaction) of {DIM} dimensions, L2-normalised" in card
    table = card.split("## Late interaction", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| ([^|]+?) \| (.+?) \|$", table, flags=re.M))
    assert rows["query instruction"] == "`Find the page.`" and rows["prompt ending"] == "`endoftext`"
    assert rows["document instruction"] == "`Represent the user's input.`" and rows["score"].startswith("MaxSim")
    (block,) = code_blocks(card)
    assert "encode_token_vectors(images=['page.png'], role='document')" in block
