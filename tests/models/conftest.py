"""Tiny random-init configs for every adapter, sample sides, and the behaviour checks all adapters share.

The checks are exposed through the `checks` fixture so that each adapter's test file states, by test name, which
behaviours it holds to, without copying their bodies.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiny_models import QWEN_BACKBONES, QWEN_PIXELS

SMALL = {"hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2, "num_attention_heads": 4}
SMALL_VISION = {**SMALL, "image_size": 32, "patch_size": 8}
NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}  # BERT/ViT names; exact gradients


@pytest.fixture(scope="session")
def token_ids(tiny_tokenizer_dir):
    """pad/bos/eos ids and vocab size a text config must share with the tiny tokenizer."""
    from transformers import AutoTokenizer

    from vembed.data.tokenizer import special_token_ids

    return special_token_ids(AutoTokenizer.from_pretrained(tiny_tokenizer_dir))


@pytest.fixture(scope="session")
def qwen_tokenizer_dir(tmp_path_factory):
    """A byte-level BPE tokenizer with Qwen's chat and vision tokens (what qwen_vl needs), trained offline."""
    from tests.conftest import CAPTIONS
    from vembed.data.tokenizer import train_qwen_tokenizer

    path = tmp_path_factory.mktemp("qwen_tokenizer")
    train_qwen_tokenizer(CAPTIONS * 4 + ["Represent the user's input.", "Find the image."], path, vocab_size=300)
    return str(path)


@pytest.fixture(scope="session")
def recipe_for(tiny_tokenizer_dir, token_ids, qwen_tokenizer_dir):
    """`recipe_for(model_type, **overrides)`: a validated recipe for a tiny random-init model of that adapter."""
    from vembed.components import recipe_from_dict

    text = {**SMALL, **token_ids, "max_position_embeddings": 16}
    models = {
        "clip": {"model_config": {"text_config": text, "vision_config": SMALL_VISION, "projection_dim": 24}},
        "siglip": {"model_config": {"text_config": text, "vision_config": SMALL_VISION}},
        "text": {"model_config": {"model_type": "bert", **text, **NO_DROPOUT}},
        "composed": {
            "text_model_config": {"model_type": "bert", **text, **NO_DROPOUT},
            "vision_model_config": {"model_type": "vit", **SMALL_VISION, **NO_DROPOUT},
            "projection_dim": 24,
        },
        "qwen_vl": {"model_config": {"model_type": "qwen3_vl", **QWEN_BACKBONES["qwen3_vl"]}, **QWEN_PIXELS,
                    "tokenizer_name": qwen_tokenizer_dir},
        "vision": {"model_config": {"model_type": "vit", **SMALL_VISION, **NO_DROPOUT}, "num_labels": 3,
                   "projection_dim": 24},
    }

    def make(model_type: str, **overrides):
        raw = {"model_type": model_type, "tokenizer_name": tiny_tokenizer_dir, **copy.deepcopy(models[model_type])}
        raw.update(overrides)
        return recipe_from_dict(raw)

    return make


@pytest.fixture(scope="session")
def build(recipe_for):
    """`build(model_type, seed=0, **overrides)`: the adapter, seeded, in eval mode."""
    from vembed.models import MODELS

    def make(model_type: str, seed: int = 0, **overrides):
        recipe = recipe_for(model_type, **overrides)
        torch.manual_seed(seed)
        return MODELS.get(model_type).from_recipe(recipe).eval()

    return make


def _image(seed: int, size: tuple[int, int], mode: str = "RGB"):
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels).convert(mode)


@pytest.fixture(scope="session")
def image_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("images") / "noise.png"
    _image(7, (48, 40)).save(path)
    return str(path)


@pytest.fixture
def text_sides():
    from vembed.data.records import Side

    return [Side(text="a photo of a red square"), Side(text="a star"), Side(text="two black lines crossing on white")]


@pytest.fixture
def mixed_sides(image_file):
    """Text-only, image-only (PIL, grey PIL and a file path) and text+image sides, interleaved."""
    from vembed.data.records import Side

    return [
        Side(text="a photo of a red square"),
        Side(image=_image(1, (40, 32))),
        Side(text="a small yellow star", image=_image(2, (32, 48))),
        Side(image=image_file),
        Side(text="two black lines crossing"),
        Side(image=_image(3, (36, 36), mode="L")),
        Side(text="an empty white page", image=_image(4, (64, 40))),
    ]


@pytest.fixture
def image_sides(image_file):
    """Image-only sides (PIL, grey PIL, a file path) of several sizes: what model_type vision embeds."""
    from vembed.data.records import Side

    return [Side(image=_image(1, (40, 32))), Side(image=image_file), Side(image=_image(3, (36, 36), mode="L")),
            Side(image=_image(4, (64, 40)))]


# --- the shared behaviour checks --------------------------------------------------------------------------------------
def _encode(adapter, sides):
    with torch.no_grad():
        return adapter.encode(adapter.preprocess(sides))


def check_shapes_and_norms(adapter, sides, normalized: bool = True):
    out = _encode(adapter, sides)
    assert out.shape == (len(sides), adapter.embedding_dim)
    assert out.dtype == torch.float32
    if normalized:
        torch.testing.assert_close(out.norm(dim=-1), torch.ones(len(sides)), atol=1e-5, rtol=0)


def check_mixed_batch_matches_parts(adapter, sides):
    """A mixed batch equals encoding each kind of side separately (and each side alone), row for row."""
    mixed = _encode(adapter, sides)
    kinds = {}
    for i, side in enumerate(sides):
        kinds.setdefault((side.text is not None, side.image is not None), []).append(i)
    for rows in kinds.values():
        part = _encode(adapter, [sides[i] for i in rows])
        torch.testing.assert_close(mixed[rows], part, atol=1e-5, rtol=0)
    for i, side in enumerate(sides):
        torch.testing.assert_close(mixed[i : i + 1], _encode(adapter, [side]), atol=1e-5, rtol=0)


def check_save_load_round_trip(adapter, sides, path):
    from vembed.models import load_adapter

    before = _encode(adapter, sides)
    adapter.save(path)
    loaded = load_adapter(path).eval()
    assert type(loaded) is type(adapter)
    assert loaded.settings_to_save() == adapter.settings_to_save()
    torch.testing.assert_close(_encode(loaded, sides), before, atol=1e-6, rtol=0)
    return loaded


def check_lora_trains_only_lora_and_merges_on_save(adapter, recipe, sides, path, also_trainable=()):
    adapter.apply_lora(recipe)
    trainable = [name for name, p in adapter.named_parameters() if p.requires_grad]
    assert trainable and any("lora_" in name for name in trainable)
    assert all("lora_" in name or name.startswith(tuple(also_trainable)) for name in trainable), trainable
    torch.manual_seed(1)
    with torch.no_grad():  # lora_B starts at zero; give it weight so the merge is actually tested
        for name, p in adapter.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    lora_out = _encode(adapter, sides)
    loaded = check_save_load_round_trip(adapter, sides, path)
    assert not any("lora_" in name for name, _ in loaded.named_parameters())  # a plain HF model
    torch.testing.assert_close(_encode(adapter, sides), lora_out, atol=0, rtol=0)  # saving left the LoRA model intact
    return loaded


def check_checkpointing_keeps_gradients(build_fn, sides, lora_recipe=None):
    """Non-reentrant checkpointing gives the same gradients as a plain backward pass; with `lora_recipe`, LoRA is
    applied after checkpointing is enabled, in the training loop's order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    grads, layer_calls = [], []
    for checkpointing in (False, True):
        adapter = build_fn().train()
        if checkpointing:
            adapter.enable_gradient_checkpointing()
        if lora_recipe is not None:
            adapter.apply_lora(lora_recipe)
            generator = torch.Generator().manual_seed(1)
            with torch.no_grad():  # lora_B starts at zero, which would hide the gradients of lora_A
                for name, p in adapter.named_parameters():
                    if "lora_B" in name:
                        p.copy_(torch.randn(p.shape, generator=generator))
        # Calls of each layer's first child: transformers checkpoints the layer's `forward`, so that child runs again
        # in backward (later children may not, as torch stops recomputing once it has every saved tensor it needs).
        calls = []
        for module in adapter.modules():
            if isinstance(module, GradientCheckpointingLayer):
                next(module.children()).register_forward_hook(lambda *_: calls.append(1))
        inputs = adapter.preprocess(sides)
        weights = torch.randn(len(sides), adapter.embedding_dim, generator=torch.Generator().manual_seed(0))
        (adapter.encode(inputs) * weights).sum().backward()
        grads.append({n: p.grad.clone() for n, p in adapter.named_parameters() if p.grad is not None})
        layer_calls.append(len(calls))
    assert layer_calls[1] == 2 * layer_calls[0] > 0  # every checkpointed layer was recomputed
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-5, rtol=0, msg=name)


def check_embedding_dim_for_matches(adapter, recipe):
    assert type(adapter).embedding_dim_for(recipe) == adapter.embedding_dim


@pytest.fixture(scope="session")
def checks():
    return SimpleNamespace(
        encode=_encode,
        shapes_and_norms=check_shapes_and_norms,
        mixed_batch_matches_parts=check_mixed_batch_matches_parts,
        save_load_round_trip=check_save_load_round_trip,
        lora_trains_only_lora_and_merges_on_save=check_lora_trains_only_lora_and_merges_on_save,
        checkpointing_keeps_gradients=check_checkpointing_keeps_gradients,
        embedding_dim_for_matches=check_embedding_dim_for_matches,
        normalize=lambda x: F.normalize(x, dim=-1),
    )
