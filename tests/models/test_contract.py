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


@pytest.mark.parametrize("model_type", ["clip", "composed"])
def test_single_image_adapters_take_a_list_of_one_and_refuse_several(build, mixed_sides, model_type):
    import dataclasses

    adapter = build(model_type)
    listed = [dataclasses.replace(side, image=[side.image]) if side.image is not None else side for side in mixed_sides]
    with torch.no_grad():
        torch.testing.assert_close(adapter(adapter.preprocess(listed)), adapter(adapter.preprocess(mixed_sides)))
    two = dataclasses.replace(mixed_sides[1], image=[mixed_sides[1].image, mixed_sides[3].image])
    with pytest.raises(ValueError, match="side 1 of the batch has 2 images.*qwen_vl takes several"):
        adapter.preprocess([mixed_sides[0], two])


def test_rows_with_several_images_are_refused_for_single_image_models_naming_the_row(tmp_path):
    import json

    from PIL import Image

    from vembed.data.sources import load_examples
    from vembed.errors import DataError
    from vembed.recipe import DataConfig
    from vembed.tasks.contrastive import check_images_per_side

    for name in ("a", "b"):
        Image.new("RGB", (4, 4)).save(tmp_path / f"{name}.png")
    rows = [{"query": "q", "positive_image": "a.png", "negatives": ["n"]},
            {"query": "q", "positive_image": "a.png", "negatives": ["n"], "negative_images": [["a.png", "b.png"]]}]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    examples, _ = load_examples(DataConfig(train=str(path)), "train")
    check_images_per_side("qwen_vl", examples)
    with pytest.raises(DataError) as err:
        check_images_per_side("clip", examples)
    assert (err.value.file, err.value.row) == (str(path), 2)
    assert ": a hard negative has 2 images" in str(err.value) and "model_type clip" in str(err.value)
