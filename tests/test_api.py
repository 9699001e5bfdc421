"""`vembed.load(path).encode(...)` on tiny saved models: same embeddings as the adapter, in the documented shapes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vembed
from vembed.api import Embedder
from vembed.data.records import Side

TINY = {"hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 1, "num_attention_heads": 4}
VISION = {**TINY, "image_size": 32, "patch_size": 8}
TEXTS = ["a photo of a red square", "a small yellow star", "two black lines crossing on white"]


@pytest.fixture(scope="module")
def saved(tiny_tokenizer_dir, tmp_path_factory):
    """`saved(model_type, **recipe)`: the folder of a tiny random-init model, built once per set of arguments."""
    from transformers import AutoTokenizer

    from vembed.components import recipe_from_dict
    from vembed.data.tokenizer import special_token_ids
    from vembed.models import MODELS

    token_ids = special_token_ids(AutoTokenizer.from_pretrained(tiny_tokenizer_dir))
    text = {**TINY, **token_ids, "max_position_embeddings": 16}
    configs = {
        "clip": {"text_config": text, "vision_config": VISION, "projection_dim": 24},
        "text": {"model_type": "bert", **text},
    }
    cache = {}

    def make(model_type: str, **overrides) -> str:
        key = (model_type, tuple(sorted(overrides.items())))
        if key not in cache:
            raw = {"model_type": model_type, "tokenizer_name": tiny_tokenizer_dir, "model_config": configs[model_type]}
            torch.manual_seed(0)
            adapter = MODELS.get(model_type).from_recipe(recipe_from_dict({**raw, **overrides}))
            path = tmp_path_factory.mktemp(model_type)
            adapter.save(path)
            cache[key] = str(path)
        return cache[key]

    return make


def _images():
    from PIL import Image

    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (30 + 5 * i, 40, 3), dtype=np.uint8)) for i in range(3)]


def _adapter_encode(embedder: Embedder, sides):
    with torch.no_grad():
        return embedder.adapter.encode(embedder.adapter.preprocess(sides))


def test_load_gives_an_embedder_that_matches_the_adapter_for_texts_images_and_pairs(saved, tmp_path):
    model = vembed.load(saved("clip"), device="cpu")
    assert isinstance(model, Embedder)
    assert model.model_type == "clip" and model.embedding_dim == 24
    images = _images()
    path = tmp_path / "image.png"
    images[0].save(path)

    texts_out = model.encode(texts=TEXTS, batch_size=2)
    assert texts_out.shape == (3, 24) and texts_out.dtype == torch.float32 and texts_out.device.type == "cpu"
    torch.testing.assert_close(texts_out, _adapter_encode(model, [Side(text=t) for t in TEXTS]), atol=1e-6, rtol=0)
    images_out = model.encode(images=images)
    torch.testing.assert_close(images_out, _adapter_encode(model, [Side(image=i) for i in images]), atol=1e-6, rtol=0)
    # Paths (str or Path) and PIL images of the same picture give the same embedding.
    torch.testing.assert_close(model.encode(images=[path, str(path)]), images_out[[0, 0]], atol=1e-6, rtol=0)
    # Texts and images together are pairs: one fused row each.
    pairs = model.encode(texts=TEXTS, images=images)
    expected = _adapter_encode(model, [Side(text=t, image=i) for t, i in zip(TEXTS, images)])
    torch.testing.assert_close(pairs, expected, atol=1e-6, rtol=0)
    assert not torch.allclose(pairs, texts_out) and not torch.allclose(pairs, images_out)
    torch.testing.assert_close(pairs.norm(dim=-1), torch.ones(3), atol=1e-5, rtol=0)


def test_single_items_are_lists_of_one_and_bad_calls_say_why(saved):
    model = Embedder.from_pretrained(saved("clip"), device="cpu")
    one = model.encode(texts=TEXTS[0])
    torch.testing.assert_close(one, model.encode(texts=TEXTS[:1]))
    assert model.encode(images=_images()[0]).shape == (1, 24)
    with pytest.raises(ValueError, match="needs texts, images, or both"):
        model.encode()
    with pytest.raises(ValueError, match="3 texts and 1 images"):
        model.encode(texts=TEXTS, images=_images()[:1])


def test_rows_are_normalised_even_when_the_model_is_not(saved):
    model = Embedder.from_pretrained(saved("text", normalize=False, pooling="cls"), device="cpu")
    assert model.model_type == "text" and model.embedding_dim == 32
    raw = model.encode(texts=TEXTS, normalize=False)
    torch.testing.assert_close(raw, _adapter_encode(model, [Side(text=t) for t in TEXTS]), atol=1e-6, rtol=0)
    assert not torch.allclose(raw.norm(dim=-1), torch.ones(3))
    torch.testing.assert_close(model.encode(texts=TEXTS), torch.nn.functional.normalize(raw, dim=-1))


def test_loading_a_folder_that_is_not_a_vembed_model_is_a_recipe_error(tmp_path):
    from vembed.errors import RecipeError

    with pytest.raises(RecipeError, match="not a vembed model folder"):
        vembed.load(str(tmp_path))


def test_loading_a_reranker_vembed_did_not_save_says_what_it_is(tmp_path, tiny_tokenizer_dir):
    pytest.importorskip("sentence_transformers")
    from tiny_models import save_cross_encoder_folders

    from vembed.errors import RecipeError

    for folder in save_cross_encoder_folders(tmp_path, tiny_tokenizer_dir).values():
        for load in (vembed.load, Embedder.from_pretrained):
            with pytest.raises(RecipeError, match=r"^recipe error: model: .* is a .*: it scores \(query, document\) "
                                                  "pairs and embeds nothing; vembed.load loads the rerankers vembed "
                                                  "saved: fine-tune this one with a cross_encoder recipe "
                                                  r"\(model_name: this folder\)$"):
                load(folder)
