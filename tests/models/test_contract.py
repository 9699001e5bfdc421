"""The adapter contract, held by every embedding adapter (as transformers' model tester mixin runs one suite over
every model): encoding, fusion of mixed batches, chunking for GradCache, persistence, LoRA, checkpointing, sizes
from configs and from the meta device, building from a saved folder, and loading without the folder's own code.

A new adapter gets all of this by adding its name to ADAPTERS (and a tiny config to `recipe_for` in conftest.py).
"""

from __future__ import annotations

import json

import pytest
import torch

from vembed.models import MODELS

# Every registered adapter: a new one is held to the contract as soon as it is registered (and fails until
# tests/models/conftest.py `recipe_for` gives it a tiny config).
ADAPTERS = MODELS.names()
# Parameters an adapter adds outside its towers: they stay trainable beside LoRA.
OUTSIDE_TOWERS = {"composed": ("text_projection", "vision_projection"), "vision": ("projection", "classifier")}
# Settings under which every layer gets gradients (qwen_vl freezes its vision tower by default).
ALL_TRAINABLE = {"qwen_vl": {"train_vision_tower": True}}


@pytest.fixture(params=ADAPTERS)
def model_type(request):
    return request.param


@pytest.fixture
def sides(model_type, text_sides, mixed_sides, image_sides):
    return {"text": text_sides, "vision": image_sides}.get(model_type, mixed_sides)


def test_encodes_every_side_to_a_float32_unit_row_of_embedding_dim(build, model_type, sides, checks):
    checks.shapes_and_norms(build(model_type), sides)


def test_each_row_of_a_mixed_batch_equals_its_side_encoded_alone(build, model_type, sides, checks):
    checks.mixed_batch_matches_parts(build(model_type), sides)


def test_slice_batch_is_the_batch_preprocess_makes_of_those_sides(build, model_type, sides, checks):
    adapter = build(model_type)
    inputs = adapter.preprocess(sides)
    n = len(sides)
    for start, stop in ((0, 2), (1, n), (n - 1, n)):
        chunk = adapter.slice_batch(inputs, start, stop)
        assert adapter.num_sides(chunk) == stop - start
        torch.testing.assert_close(checks.encode(adapter, sides[start:stop]), adapter.encode(chunk).detach(),
                                   atol=1e-5, rtol=0)


def test_save_then_load_gives_the_same_embeddings_and_settings(build, model_type, sides, checks, tmp_path):
    max_length = 96 if model_type == "qwen_vl" else 12  # qwen_vl: images and template take tokens too
    adapter = build(model_type, normalize=False, max_length=max_length)
    loaded = checks.save_load_round_trip(adapter, sides, tmp_path / "final")
    assert (loaded.settings.normalize, loaded.settings.max_length) == (False, max_length)
    saved = json.loads((tmp_path / "final" / "vembed.json").read_text())["settings"]
    # Where the weights came from and whether to trust their code are not the folder's to say.
    assert not {"trust_remote_code", "tokenizer_name", "model_name", "model_config"} & set(saved)


def test_lora_trains_only_lora_and_save_merges_it(build, recipe_for, model_type, sides, checks, tmp_path):
    recipe = recipe_for(model_type, use_lora=True, lora_r=4, lora_alpha=8)
    checks.lora_trains_only_lora_and_merges_on_save(build(model_type), recipe, sides, tmp_path / "merged",
                                                    also_trainable=OUTSIDE_TOWERS.get(model_type, ()))


@pytest.mark.parametrize("lora", [False, True])
def test_gradient_checkpointing_gives_the_same_gradients(build, recipe_for, model_type, sides, checks, lora):
    lora_recipe = recipe_for(model_type, use_lora=True, lora_r=4, lora_dropout=0.0) if lora else None
    trainable = ALL_TRAINABLE.get(model_type, {})
    checks.checkpointing_keeps_gradients(lambda: build(model_type, **trainable), sides[:4], lora_recipe=lora_recipe)


def test_every_module_compile_compiles_runs_when_the_adapter_encodes(build, model_type, sides):
    """`compile: true` compiles `compiled_modules()` (each one's forward): a module encode never calls through its
    forward (CLIP's towers behind get_text_features) would be compiled for nothing."""
    adapter = build(model_type)
    modules = adapter.compiled_modules()
    assert modules and all(any(m is module for m in adapter.modules()) for module in modules)
    called: set[int] = set()
    hooks = [module.register_forward_hook(lambda mod, args, out: called.add(id(mod))) for module in modules]
    try:
        adapter.encode(adapter.preprocess(sides))
    finally:
        for hook in hooks:
            hook.remove()
    assert called == {id(module) for module in modules}


def test_embedding_dim_for_reads_the_config(build, recipe_for, model_type, checks):
    checks.embedding_dim_for_matches(build(model_type), recipe_for(model_type))


def test_on_meta_has_the_real_models_parameters_and_settings(build, recipe_for, model_type):
    """What the planner counts is what training builds: names, shapes, trainability, and the resolved settings."""
    recipe = recipe_for(model_type)
    meta, real = MODELS.get(model_type).on_meta(recipe), build(model_type)
    shapes = {name: (tuple(p.shape), p.requires_grad) for name, p in meta.named_parameters()}
    assert shapes == {name: (tuple(p.shape), p.requires_grad) for name, p in real.named_parameters()}
    assert all(p.is_meta for p in meta.parameters())
    assert meta.embedding_dim == real.embedding_dim


def test_builds_from_a_saved_folder_named_in_the_recipe(build, recipe_for, model_type, sides, checks, tmp_path):
    adapter = build(model_type)
    adapter.save(tmp_path)
    if model_type == "composed":
        pretrained = {"text_model_config": None, "vision_model_config": None, "tokenizer_name": None,
                      "text_model_name": str(tmp_path / "text"), "vision_model_name": str(tmp_path / "vision")}
    else:
        pretrained = {"model_config": None, "tokenizer_name": None, "model_name": str(tmp_path)}
    recipe = recipe_for(model_type, **pretrained)
    rebuilt = MODELS.get(model_type).from_recipe(recipe).eval()
    # The towers come from the folders; what an adapter adds outside them is new (a fresh pairing or head).
    for name in OUTSIDE_TOWERS.get(model_type, ()):
        getattr(rebuilt, name).load_state_dict(getattr(adapter, name).state_dict())
    assert MODELS.get(model_type).embedding_dim_for(recipe) == rebuilt.embedding_dim == adapter.embedding_dim
    torch.testing.assert_close(checks.encode(rebuilt, sides), checks.encode(adapter, sides), atol=1e-5, rtol=0)


def test_a_recipe_for_another_adapter_is_refused(recipe_for, model_type):
    from vembed.errors import RecipeError

    other = "text" if model_type == "composed" else "composed"
    with pytest.raises(RecipeError, match=f"this recipe holds {other} settings, not {model_type}'s"):
        MODELS.get(model_type).from_recipe(recipe_for(other))


def test_a_folder_asking_for_remote_code_runs_none_unless_the_caller_trusts_it(build, text_sides, checks, tmp_path):
    """A saved folder may claim `trust_remote_code` and ship Python (config.json's auto_map); loading it must not run
    that code unless the caller passes trust_remote_code=True. The code here only leaves a mark when imported."""
    import vembed

    folder = tmp_path / "model"
    adapter = build("text")
    adapter.save(folder)
    info = json.loads((folder / "vembed.json").read_text())
    info["settings"]["trust_remote_code"] = True  # what a folder saved by an older vembed (or anyone) may say
    (folder / "vembed.json").write_text(json.dumps(info))
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "shipped.ShippedConfig", "AutoModel": "shipped.ShippedModel"}
    (folder / "config.json").write_text(json.dumps(config))
    mark = tmp_path / "ran"
    (folder / "shipped.py").write_text(
        f"open({str(mark)!r}, 'w').close()\n"
        "from transformers import BertConfig, BertModel\n"
        "class ShippedConfig(BertConfig):\n    pass\n"
        "class ShippedModel(BertModel):\n    config_class = ShippedConfig\n"
    )
    model = vembed.load(str(folder), device="cpu")
    assert not mark.exists()
    torch.testing.assert_close(model.encode(texts=[s.text for s in text_sides]), checks.encode(adapter, text_sides),
                               atol=1e-5, rtol=0)
    vembed.load(str(folder), device="cpu", trust_remote_code=True)  # the caller's choice: now the code runs
    assert mark.exists()


# transformers' `_no_split_modules` of these towers: the encoder layers, plus embeddings (and SigLIP's pooling head),
# which transformers also keeps whole.
@pytest.mark.parametrize(
    "name,expected",
    [
        ("clip", {"CLIPEncoderLayer", "CLIPTextEmbeddings", "CLIPVisionEmbeddings"}),
        ("siglip", {"SiglipEncoderLayer", "SiglipTextEmbeddings", "SiglipVisionEmbeddings",
                    "SiglipMultiheadAttentionPoolingHead"}),
        ("text", {"BertLayer", "BertEmbeddings"}),
        ("composed", {"BertLayer", "BertEmbeddings", "ViTLayer", "ViTEmbeddings"}),
    ],
)
def test_block_classes_default_to_the_towers_no_split_modules(build, name, expected):
    adapter = build(name)
    classes = adapter.block_classes()
    assert {cls.__name__ for cls in classes} == expected
    # Each class is the one the tower really holds (so FSDP's wrap policy matches modules).
    held = {type(module) for tower in adapter.towers() for module in tower.modules()}
    assert classes <= held


@pytest.mark.parametrize("name", ["clip", "composed"])
def test_single_image_adapters_take_a_list_of_one_and_refuse_several(build, mixed_sides, name):
    import dataclasses

    adapter = build(name)
    listed = [dataclasses.replace(side, image=[side.image]) if side.image is not None else side for side in mixed_sides]
    with torch.no_grad():
        torch.testing.assert_close(adapter(adapter.preprocess(listed)), adapter(adapter.preprocess(mixed_sides)))
    two = dataclasses.replace(mixed_sides[1], image=[mixed_sides[1].image, mixed_sides[3].image])
    with pytest.raises(ValueError, match="side 1 of the batch has 2 images.*qwen_vl takes several"):
        adapter.preprocess([mixed_sides[0], two])


def test_rows_with_several_images_are_refused_for_single_image_models_naming_the_row(tmp_path):
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
