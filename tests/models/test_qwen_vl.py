"""The qwen_vl adapter on tiny random Qwen2-VL, Qwen2.5-VL and Qwen3-VL models with a byte-level Qwen tokenizer."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiny_models import QWEN_BACKBONES as BACKBONES
from tiny_models import QWEN_MODEL_CLASSES as MODEL_CLASSES
from tiny_models import QWEN_PIXELS as PIXELS

from vembed.components import recipe_from_dict
from vembed.data.records import Side
from vembed.errors import RecipeError
from vembed.models import MODELS


@pytest.fixture(scope="module")
def qwen_recipe(qwen_tokenizer_dir):
    def make(backbone: str = "qwen3_vl", **overrides):
        config = {"model_type": backbone, **copy.deepcopy(BACKBONES[backbone])}
        raw = {"model_type": "qwen_vl", "model_config": config, "tokenizer_name": qwen_tokenizer_dir, **PIXELS}
        return recipe_from_dict({**raw, **overrides})

    return make


@pytest.fixture(scope="module")
def qwen_build(qwen_recipe):
    def make(backbone: str = "qwen3_vl", seed: int = 0, **overrides):
        torch.manual_seed(seed)
        return MODELS.get("qwen_vl").from_recipe(qwen_recipe(backbone, **overrides)).eval()

    return make


def _image(seed: int, size: tuple[int, int]):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8))


def _sides_of_mixed_image_sizes() -> list[Side]:
    return [
        Side(text="a photo of a red square", role="query"),
        Side(image=_image(1, (16, 16))),
        Side(text="a small yellow star", image=_image(2, (40, 24))),
        Side(image=[_image(3, (24, 32)), _image(4, (16, 8))], text="two pictures"),
        Side(text="two black lines crossing on white", role="query"),
        Side(image=_image(5, (32, 32))),
        Side(text="an empty white page", image=_image(6, (8, 48)), role="query"),
        Side(text="a green triangle"),
    ]


def _model_inputs(adapter, inputs):
    keys = ("input_ids", "attention_mask", "mm_token_type_ids", "image_grid_thw", "pixel_values")
    return {key: inputs[key] for key in keys if key in inputs}


@pytest.mark.parametrize("backbone", BACKBONES)
def test_forward_text_only_image_only_and_mixed_batches(qwen_build, backbone, text_sides, mixed_sides, checks):
    adapter = qwen_build(backbone)
    assert type(adapter.model).__name__ == MODEL_CLASSES[backbone]  # chosen from the config's model_type
    assert adapter.embedding_dim == 48  # the language model's hidden size, not the vision tower's 32
    images_only = [side for side in mixed_sides if side.text is None]
    for sides in (text_sides, images_only, mixed_sides):
        checks.shapes_and_norms(adapter, sides)
    # Every row is the side's own embedding, whatever else is in the batch (padding and image packing included).
    checks.mixed_batch_matches_parts(adapter, mixed_sides)


@pytest.mark.parametrize("backbone", BACKBONES)
def test_pooled_row_is_the_last_valid_token_under_left_and_right_padding(qwen_build, backbone):
    adapter = qwen_build(backbone)
    sides = _sides_of_mixed_image_sizes()
    end_id = adapter.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    embeddings = {}
    for padding_side in ("right", "left"):
        adapter.tokenizer.padding_side = padding_side
        inputs = adapter.preprocess(sides)
        mask = inputs["attention_mask"]
        assert (mask[:, 0] == 0).any() if padding_side == "left" else (mask[:, -1] == 0).any()  # padding happened
        with torch.no_grad():
            hidden = adapter.model(**_model_inputs(adapter, inputs)).last_hidden_state
            embeddings[padding_side] = adapter.encode(inputs)
        for row in range(len(sides)):
            last = int(mask[row].nonzero().max())  # the last attended position, found directly
            assert inputs["input_ids"][row, last] == end_id
            expected = F.normalize(hidden[row, last].float(), dim=-1)
            torch.testing.assert_close(embeddings[padding_side][row], expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(embeddings["left"], embeddings["right"], atol=1e-5, rtol=0)


def test_prompt_matches_the_report_template_token_for_token(qwen_build):
    adapter = qwen_build("qwen3_vl", query_instruction="Find the image")
    # 32x16 and 24x24 are multiples of patch x merge (8) inside the pixel budget, so they are not resized:
    # (16/4)*(32/4)/2^2 = 8 and (24/4)^2/2^2 = 9 image tokens.
    query = Side(text="a red star", image=[_image(1, (32, 16)), _image(2, (24, 24))], role="query")
    empty, image_only = Side(), Side(image=_image(3, (24, 24)))

    def image(tokens: int) -> str:
        return "<|vision_start|>" + "<|image_pad|>" * tokens + "<|vision_end|>"

    def template(instruction: str, instance: str) -> str:
        return (f"<|im_start|>system\n{instruction}<|im_end|>\n<|im_start|>user\n{instance}<|im_end|>\n"
                "<|endoftext|>")

    expected = [
        template("Find the image.", image(8) + image(9) + "a red star"),  # instruction ends with a full stop
        template("Represent the user's input.", "NULL"),  # neither text nor image
        template("Represent the user's input.", image(9)),  # documents get the default instruction
    ]
    adapter.tokenizer.padding_side = "right"
    inputs = adapter.preprocess([query, empty, image_only])
    for row, text in enumerate(expected):
        ids = adapter.tokenizer(text, add_special_tokens=False)["input_ids"]
        length = int(inputs["attention_mask"][row].sum())
        assert inputs["input_ids"][row, :length].tolist() == ids, row
    image_pad = adapter.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert torch.equal(inputs["mm_token_type_ids"].bool(), inputs["input_ids"] == image_pad)
    # The released inference code's ending (chat template with the generation prompt) instead of <|endoftext|>.
    adapter.settings = adapter.settings.model_copy(update={"prompt_ending": "generation_prompt"})
    official = adapter.preprocess([query])["input_ids"][0].tolist()
    report_end, official_end = "<|im_end|>\n<|endoftext|>", "<|im_end|>\n<|im_start|>assistant\n"
    official_text = expected[0].replace(report_end, official_end)
    assert official_text.endswith("assistant\n")
    assert official == adapter.tokenizer(official_text, add_special_tokens=False)["input_ids"]
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 8], [1, 6, 6], [1, 6, 6]]
    assert inputs["images_per_side"].tolist() == [2, 0, 1]


@pytest.mark.parametrize("model_name, ending", [
    ("Qwen/Qwen3-VL-Embedding-2B", "generation_prompt"),  # the released embedders: their serving code's ending
    ("/models/qwen3-vl-embedding-8b", "generation_prompt"),  # a local copy keeping the name
    ("Qwen/Qwen3-VL-2B-Instruct", "endoftext"),  # a VLM that is not an embedder: the technical report's
    (None, "endoftext"),  # random init
])
def test_default_prompt_ending_follows_the_checkpoint(model_name, ending):
    from vembed.models.qwen_vl import default_ending

    assert default_ending(model_name) == ending


def test_a_qwen3_vl_embedding_checkpoint_ends_with_the_generation_prompt_unless_the_recipe_says(
    qwen_build, qwen_recipe, tmp_path
):
    """Unset prompt_ending on a checkpoint named Qwen3-VL-Embedding: the newline after <|im_start|>assistant is the
    last token, as the released embedder feeds it; the recipe's own value wins; a folder saved by vembed keeps its
    recorded ending whatever its name."""
    checkpoint = tmp_path / "Qwen3-VL-Embedding-tiny"
    qwen_build("qwen3_vl").save(checkpoint)
    (checkpoint / "vembed.json").unlink()  # a plain transformers folder, as downloaded
    pretrained = {"model_config": None, "tokenizer_name": None, "model_name": str(checkpoint)}
    adapter = MODELS.get("qwen_vl").from_recipe(qwen_recipe("qwen3_vl", **pretrained))
    assert adapter.settings.prompt_ending == "generation_prompt"
    ids = adapter.preprocess([Side(text="a red square")])["input_ids"][0].tolist()
    assert adapter.tokenizer.decode(ids).endswith("<|im_end|>\n<|im_start|>assistant\n")
    chosen = MODELS.get("qwen_vl").from_recipe(qwen_recipe("qwen3_vl", **pretrained, prompt_ending="endoftext"))
    assert chosen.settings.prompt_ending == "endoftext"
    chosen.save(tmp_path / "fine-tuned-Qwen3-VL-Embedding")  # records endoftext in its vembed.json
    again = qwen_recipe("qwen3_vl", **{**pretrained, "model_name": str(tmp_path / "fine-tuned-Qwen3-VL-Embedding")})
    assert MODELS.get("qwen_vl").from_recipe(again).settings.prompt_ending == "endoftext"


def test_truncation_cuts_only_the_text(qwen_build):
    adapter = qwen_build("qwen3_vl", max_length=64)
    long = Side(text="a photo of a red square " * 20, image=_image(1, (24, 24)))
    inputs = adapter.preprocess([long])
    ids = inputs["input_ids"][0].tolist()
    assert len(ids) == 64
    assert ids.count(adapter.tokenizer.convert_tokens_to_ids("<|image_pad|>")) == 9  # every image token kept
    assert adapter.tokenizer.decode(ids).endswith("<|im_end|>\n<|endoftext|>")


def test_full_processor_gives_identical_tensors(qwen_build):
    # transformers' Qwen-VL processors need a video processor, which needs torchvision; vembed does not depend on
    # torchvision, so its own path (PIL image processor + image-token expansion) is compared where it is installed.
    pytest.importorskip("torchvision")
    from transformers import AutoProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    adapter = qwen_build("qwen3_vl")
    sides = _sides_of_mixed_image_sizes()
    processor = Qwen3VLProcessor(image_processor=adapter.image_processor, tokenizer=adapter.tokenizer,
                                 video_processor=Qwen3VLVideoProcessor())
    assert AutoProcessor is not None
    adapter.tokenizer.padding_side = "right"
    ours = adapter.preprocess(sides)
    images = [image for side in sides for image in ([] if side.image is None else
                                                   (side.image if isinstance(side.image, list) else [side.image]))]
    theirs = processor(text=[adapter.prompt(side) for side in sides], images=images, padding=True,
                       return_tensors="pt")
    for key in ("input_ids", "attention_mask", "mm_token_type_ids", "image_grid_thw", "pixel_values"):
        torch.testing.assert_close(ours[key], theirs[key].to(ours[key].dtype), msg=key)


@pytest.mark.parametrize("backbone", BACKBONES)
def test_chunks_with_mixed_image_sizes_equal_the_full_batch(qwen_build, backbone):
    """What GradCache relies on: encoding chunks cut by `slice_batch` and concatenating gives the full batch's
    embeddings and, through a loss on the concatenation, the full batch's gradients (fp32, no dropout)."""
    from vembed.losses.contrastive import InfoNCELoss

    adapter = qwen_build(backbone, train_vision_tower=True).train()
    sides = _sides_of_mixed_image_sizes()
    inputs = adapter.preprocess(sides)
    loss_fn = InfoNCELoss(temperature=0.05)
    chunks = [(0, 3), (3, 6), (6, 8)]  # uneven, and cutting between sides with 0, 1 and 2 images
    for start, stop in chunks:  # a chunk is exactly what preprocess makes for those sides alone
        chunk, alone = adapter.slice_batch(inputs, start, stop), adapter.preprocess(sides[start:stop])
        assert chunk.keys() == alone.keys()
        for key in chunk:
            assert torch.equal(chunk[key], alone[key]), key

    def embeddings_and_gradients(parts):
        adapter.zero_grad()
        embeddings = torch.cat([adapter.encode(part) for part in parts])
        loss_fn(embeddings[:4], embeddings[4:]).backward()
        return embeddings.detach(), {n: p.grad.clone() for n, p in adapter.named_parameters() if p.grad is not None}

    full, full_grads = embeddings_and_gradients([inputs])
    chunked, chunk_grads = embeddings_and_gradients([adapter.slice_batch(inputs, *c) for c in chunks])
    torch.testing.assert_close(chunked, full, atol=1e-5, rtol=0)
    assert full_grads.keys() == chunk_grads.keys() and any(".visual." in name for name in full_grads)
    for name, grad in full_grads.items():
        torch.testing.assert_close(chunk_grads[name], grad, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("backbone", BACKBONES)
def test_block_classes_are_the_decoder_layers_and_vision_blocks(qwen_build, backbone):
    adapter = qwen_build(backbone)
    expected = {type(adapter.model.language_model.layers[0]), type(adapter.model.visual.blocks[0])}
    assert adapter.block_classes() == expected
    assert {cls.__name__ for cls in expected} == set(adapter.model._no_split_modules)


def test_lora_defaults_target_the_language_model_and_merge_on_save(qwen_build, qwen_recipe, tmp_path, checks):
    from transformers import AutoModel

    recipe = qwen_recipe("qwen3_vl", use_lora=True)
    assert (recipe.lora_r, recipe.lora_alpha) == (32, 32)  # the released Qwen3-VL-Embedding LoRA
    assert recipe_from_dict({"model_type": "qwen_vl", "lora_r": 16}).lora_r == 16  # a recipe's own value wins
    assert recipe_from_dict({"model_type": "clip"}).lora_r == 16
    adapter = qwen_build("qwen3_vl")
    sides = _sides_of_mixed_image_sizes()
    loaded = checks.lora_trains_only_lora_and_merges_on_save(adapter, recipe, sides, tmp_path / "merged")
    lora_layers = {name.rsplit(".lora_", 1)[0] for name, _ in adapter.named_parameters() if "lora_A" in name}
    assert lora_layers and all(".language_model." in name for name in lora_layers)
    wrapped = {name.rsplit(".", 1)[-1] for name in lora_layers}
    # The released LoRA table (Qwen3-VL-Embedding README): q/k/v and the MLP projections, no o_proj.
    assert wrapped == {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"}
    assert next(p for n, p in adapter.named_parameters() if "lora_A" in n).shape[0] == 32
    assert not any(p.requires_grad for p in adapter.model.visual.parameters())  # the vision tower stays frozen
    # The merged folder is a plain transformers Qwen3-VL model giving the same states.
    plain = AutoModel.from_pretrained(tmp_path / "merged").eval()
    inputs = loaded.preprocess(sides)
    with torch.no_grad():
        hidden = plain(**_model_inputs(loaded, inputs)).last_hidden_state
        expected = loaded.model(**_model_inputs(loaded, inputs)).last_hidden_state
    torch.testing.assert_close(hidden, expected, atol=1e-6, rtol=0)


def test_lora_adapter_only_save_loads_back_and_equals_the_merged_model(qwen_build, qwen_recipe, tmp_path):
    from vembed.models import load_adapter

    base = tmp_path / "base"
    qwen_build("qwen3_vl").save(base)  # a local "pretrained" checkpoint the LoRA weights apply to
    recipe = qwen_recipe("qwen3_vl", model_config=None, model_name=str(base), tokenizer_name=None, use_lora=True,
                         lora_r=4, lora_save="adapter")
    adapter = MODELS.get("qwen_vl").from_recipe(recipe).eval()
    adapter.apply_lora(recipe)
    with torch.no_grad():  # lora_B starts at zero; give it weight so that the saved LoRA changes something
        for name, p in adapter.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5, generator=torch.Generator().manual_seed(len(name)))
    sides = _sides_of_mixed_image_sizes()
    with torch.no_grad():
        expected = adapter.encode(adapter.preprocess(sides))
    adapter.save(tmp_path / "lora")
    saved = {path.name for path in (tmp_path / "lora").iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "vembed.json"} <= saved
    assert "model.safetensors" not in saved  # no base weights
    adapter.settings = adapter.settings.model_copy(update={"lora_save": "merged"})
    adapter.save(tmp_path / "merged")
    for folder in ("lora", "merged"):
        loaded = load_adapter(tmp_path / folder).eval()
        assert any("lora_A" in name for name, _ in loaded.named_parameters()) == (folder == "lora")
        with torch.no_grad():
            torch.testing.assert_close(loaded.encode(loaded.preprocess(sides)), expected, atol=1e-5, rtol=0)
    with pytest.raises(RecipeError, match="lora_save"):
        MODELS.get("qwen_vl").check_recipe(qwen_recipe("qwen3_vl", use_lora=True, lora_save="adapter"))


def test_backbone_is_chosen_from_the_config_and_checked(qwen_recipe, qwen_tokenizer_dir, tmp_path):
    from vembed.recipe_checks import check_recipe

    with pytest.raises(RecipeError, match="mrl_dims"):
        check_recipe(qwen_recipe("qwen2_vl", mrl_dims=[64, 32]), for_training=False)
    check_recipe(qwen_recipe("qwen2_vl", mrl_dims=[48, 16]), for_training=False)
    bert = recipe_from_dict({"model_type": "qwen_vl", "tokenizer_name": qwen_tokenizer_dir,
                             "model_config": {"model_type": "bert", "hidden_size": 32}})
    with pytest.raises(RecipeError, match="qwen2_vl, qwen2_5_vl, qwen3_vl"):
        MODELS.get("qwen_vl").from_recipe(bert)
    wrong_ids = copy.deepcopy(BACKBONES["qwen3_vl"])
    with pytest.raises(RecipeError, match="image_token_id"):
        MODELS.get("qwen_vl").from_recipe(
            qwen_recipe("qwen3_vl", model_config={"model_type": "qwen3_vl", **wrong_ids, "image_token_id": 7})
        )


@pytest.mark.parametrize("backbone", BACKBONES)
def test_mm_token_type_ids_are_needed_for_image_positions(qwen_build, backbone):
    """Why preprocess always returns mm_token_type_ids: without them Qwen2-VL/Qwen3-VL refuse image batches and
    Qwen2.5-VL silently gives image tokens text positions (a different embedding)."""
    adapter = qwen_build(backbone)
    inputs = adapter.preprocess(_sides_of_mixed_image_sizes())
    without = {key: value for key, value in inputs.items() if key != "mm_token_type_ids"}
    with torch.no_grad():
        proper = adapter.encode(inputs)
        if backbone == "qwen2_5_vl":
            assert (adapter.encode(without) - proper).abs().max() > 1e-4
        else:
            with pytest.raises(ValueError, match="mm_token_type_ids"):
                adapter.encode(without)


def test_several_images_per_side_from_a_data_file_reach_the_model(qwen_build, tmp_path):
    """A JSONL row listing two query images: loaded, decoded and collated into one side holding both images, which
    embeds as the same side built by hand; the check that single-image models refuse such rows lets qwen_vl through."""
    from vembed.data.collate import PairCollator
    from vembed.data.dataset import PairDataset
    from vembed.data.sources import load_examples
    from vembed.recipe import DataConfig
    from vembed.tasks.contrastive import check_images_per_side

    first, second = _image(3, (24, 32)), _image(4, (16, 8))
    first.save(tmp_path / "a.png")
    second.save(tmp_path / "b.png")
    rows = [{"query": "two pictures", "query_image": ["a.png", "b.png"], "positive": "a pair of photos"},
            {"query": "one picture", "query_image": ["b.png"], "positive": "a single photo"}]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    examples, _ = load_examples(DataConfig(train=str(tmp_path / "pairs.jsonl")), "train")
    check_images_per_side("qwen_vl", examples)  # qwen_vl takes any number

    adapter = qwen_build("qwen3_vl")
    batch = PairCollator(adapter)([PairDataset(examples)[i] for i in range(2)])
    assert batch["query"]["image_grid_thw"].shape[0] == 3  # two images in the first query, one in the second
    by_hand = adapter.preprocess([Side(text="two pictures", image=[first, second], role="query"),
                                  Side(text="one picture", image=second, role="query")])
    with torch.no_grad():
        torch.testing.assert_close(adapter(batch["query"]), adapter(by_hand), atol=1e-5, rtol=0)
        from vembed.api import Embedder  # the Python API takes the same: an item may list several images

        from_api = Embedder(adapter, device="cpu").encode(
            texts=["two pictures", "one picture"], images=[[tmp_path / "a.png", tmp_path / "b.png"], second],
            role="query")
        torch.testing.assert_close(from_api, F.normalize(adapter(by_hand), dim=-1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("backbone", BACKBONES)
def test_packed_sides_give_the_padded_embeddings_and_gradients(qwen_build, backbone):
    """`packing: true`: the language model runs text, image and mixed sides as one row of real tokens, with the
    model's own multimodal rope positions packed alongside (vembed/models/packing.py); embeddings and gradients are
    those of the padded batch (fp32), under left padding too."""
    sides = _sides_of_mixed_image_sizes()
    results = {}
    for name, overrides in (("padded", {}), ("packed", {"packing": True})):
        adapter = qwen_build(backbone, **overrides).train()
        adapter.tokenizer.padding_side = "left"
        inputs = adapter.preprocess(sides)
        embeddings = adapter.encode(inputs)
        (embeddings * torch.linspace(-1, 1, embeddings.shape[1])).sum().backward()
        grads = {n: p.grad.clone() for n, p in adapter.named_parameters() if p.grad is not None}
        results[name] = (embeddings.detach(), grads)
    (padded, padded_grads), (packed, packed_grads) = results["padded"], results["packed"]
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=0)
    assert packed_grads.keys() == padded_grads.keys()
    reference = torch.cat([g.flatten() for g in padded_grads.values()])
    got = torch.cat([packed_grads[n].flatten() for n in padded_grads])
    assert ((got - reference).norm() / reference.norm()).item() <= 1e-5
