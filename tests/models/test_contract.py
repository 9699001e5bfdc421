"""The parts of the adapter contract the strategies use: `block_classes` (FSDP wrapping) and `slice_batch`
(GradCache chunks), on the adapters that take the defaults."""

from __future__ import annotations

import pytest
import torch


# transformers' `_no_split_modules` of these towers: the encoder layers, plus embeddings (and SigLIP's pooling head),
# which transformers also keeps whole.
@pytest.mark.parametrize(
    "model_type,expected",
    [
        ("clip", {"CLIPEncoderLayer", "CLIPTextEmbeddings", "CLIPVisionEmbeddings"}),
        ("siglip", {"SiglipEncoderLayer", "SiglipTextEmbeddings", "SiglipVisionEmbeddings",
                    "SiglipMultiheadAttentionPoolingHead"}),
        ("text", {"BertLayer", "BertEmbeddings"}),
        ("composed", {"BertLayer", "BertEmbeddings", "ViTLayer", "ViTEmbeddings"}),
    ],
)
def test_block_classes_default_to_the_towers_no_split_modules(build, model_type, expected):
    adapter = build(model_type)
    classes = adapter.block_classes()
    assert {cls.__name__ for cls in classes} == expected
    # Each class is the one the tower really holds (so FSDP's wrap policy matches modules).
    held = {type(module) for tower in adapter.towers() for module in tower.modules()}
    assert classes <= held


def test_slice_batch_default_is_a_method_giving_the_sides_own_batch(build, mixed_sides):
    adapter = build("clip")
    inputs = adapter.preprocess(mixed_sides)
    chunk, alone = adapter.slice_batch(inputs, 2, 5), adapter.preprocess(mixed_sides[2:5])
    with torch.no_grad():
        torch.testing.assert_close(adapter.encode(chunk), adapter.encode(alone), atol=1e-6, rtol=0)
