"""The recipe: every class of bad input is one RecipeError naming the key and the fix; overrides and saving work."""

from __future__ import annotations

import pytest
import yaml

from vembed.components import load_recipe, recipe_from_dict
from vembed.errors import RecipeError
from vembed.recipe_checks import check_recipe


def _write(tmp_path, payload, name="recipe.yaml"):
    path = tmp_path / name
    path.write_text(payload if isinstance(payload, str) else yaml.safe_dump(payload))
    return path


def _error(raw) -> RecipeError:
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(raw, "r.yaml")
    return info.value


def test_defaults_are_valid_and_documented_names():
    recipe = recipe_from_dict({})
    assert recipe.learning_rate > 0 and recipe.batch_size > 0
    assert "model_config" in recipe.to_dict() and "model_config_dict" not in recipe.to_dict()


@pytest.mark.parametrize(
    "raw, key, hint",
    [
        ({"learnin_rate": 1e-4}, "learnin_rate", "did you mean learning_rate?"),
        ({"lr": 1e-4}, "lr", "did you mean learning_rate?"),  # the name in the toolkit vembed replaces
        ({"data": {"trian": "x.jsonl"}}, "data.trian", "did you mean train?"),
        ({"data": {"columns": {"qurey": "q"}}}, "data.columns.qurey", "did you mean query?"),
    ],
)
def test_unknown_keys_name_the_path_and_suggest(raw, key, hint):
    err = _error(raw)
    assert err.key == key
    assert hint in str(err)
    assert "\n" not in str(err)


@pytest.mark.parametrize(
    "raw, key",
    [
        ({"learning_rate": -1e-4}, "learning_rate"),
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": "many"}, "batch_size"),
        ({"scheduler_type": "cosin"}, "scheduler_type"),
        ({"warmup_ratio": 1.5}, "warmup_ratio"),
        ({"mrl_dims": [64, -8]}, "mrl_dims"),
        ({"mrl_dims": [64, 32], "mrl_weights": [1.0]}, "mrl_weights"),
        ({"use_gradient_cache": False, "gradient_cache_chunk_size": 8}, "gradient_cache_chunk_size"),
        ({"report_to": ["mlflow"]}, "report_to.0"),
        ({"layer_lr_decay": 1.5}, "layer_lr_decay"),
        ({"augmentation": {"crop_scale": [0.5, 0.2]}}, "augmentation.crop_scale"),
        ({"augmentation": {"horizontal_flip": 2}}, "augmentation.horizontal_flip"),
        ({"augmentation": {"mixup": 0.2}}, "augmentation.mixup"),
    ],
)
def test_wrong_types_and_impossible_values_name_the_key(raw, key):
    assert _error(raw).key == key


def test_yaml_scientific_notation_without_dot_is_a_number(tmp_path):
    recipe = load_recipe(_write(tmp_path, "learning_rate: 1e-5\n"))
    assert recipe.learning_rate == pytest.approx(1e-5)


def test_overrides_reach_nested_keys_and_parse_values(tmp_path):
    path = _write(tmp_path, {"model_type": "clip", "data": {"train": "a.jsonl"}})
    recipe = load_recipe(path, ["learning_rate=3e-4", "data.num_workers=2", "mrl_dims=[32, 16]", "use_lora=true"])
    assert recipe.learning_rate == pytest.approx(3e-4)
    assert recipe.data.num_workers == 2 and recipe.data.train == "a.jsonl"
    assert recipe.loss.mrl_dims == [32, 16] and recipe.use_lora is True


def test_bad_override_is_a_recipe_error(tmp_path):
    path = _write(tmp_path, {})
    with pytest.raises(RecipeError, match="key=value"):
        load_recipe(path, ["learning_rate"])
    with pytest.raises(RecipeError, match="did you mean learning_rate"):
        load_recipe(path, ["learning_rat=1"])


def test_missing_recipe_and_invalid_yaml(tmp_path):
    with pytest.raises(RecipeError, match="not found"):
        load_recipe(tmp_path / "nope.yaml")
    with pytest.raises(RecipeError, match="line 2"):
        load_recipe(_write(tmp_path, "a: 1\nb: : c\n"))


def test_saved_recipe_round_trips(tmp_path):
    recipe = recipe_from_dict({"model_config": {"projection_dim": 8}, "mrl_dims": [8, 4], "report_to": "tensorboard"})
    recipe.save(tmp_path / "out" / "recipe.yaml")
    again = load_recipe(tmp_path / "out" / "recipe.yaml")
    assert again == recipe


def test_check_recipe_rejects_unknown_adapter_loss_and_missing_data(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"query": "a", "positive": "b"}\n')
    base = {"model_type": "text", "model_config": {"model_type": "bert"}, "tokenizer_name": str(tmp_path),
            "data": {"train": str(data)}}
    with pytest.raises(RecipeError, match="did you mean clip"):
        check_recipe(recipe_from_dict({**base, "model_type": "clipp"}))
    with pytest.raises(RecipeError, match="did you mean infonce"):
        check_recipe(recipe_from_dict({**base, "loss_type": "infonc"}))
    with pytest.raises(RecipeError) as info:
        check_recipe(recipe_from_dict({**base, "data": {"train": str(tmp_path / "missing.jsonl")}}))
    assert info.value.key == "data.train"
    with pytest.raises(RecipeError) as info:
        recipe_from_dict({**base, "use_gradient_cache": False, "gradient_cache_chunk_size": 4})
    assert info.value.key == "gradient_cache_chunk_size"


def test_mrl_dims_above_embedding_size_rejected_before_building(tmp_path, tiny_tokenizer_dir):
    data = tmp_path / "train.jsonl"
    data.write_text('{"query": "a", "positive": "b"}\n')
    recipe = recipe_from_dict(
        {"model_type": "text", "tokenizer_name": tiny_tokenizer_dir, "data": {"train": str(data)},
         "model_config": {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                          "intermediate_size": 64, "vocab_size": 300},
         "mrl_dims": [64, 16]}
    )
    with pytest.raises(RecipeError) as info:
        check_recipe(recipe)
    assert info.value.key == "mrl_dims" and "32" in str(info.value)


@pytest.mark.parametrize(
    "raw, key, hint",
    [
        ({"data": {"train": {"a": {"filez": "x.jsonl"}}}}, "data.train.a.filez", "did you mean files?"),
        ({"data": {"train": {"a": {"files": "x", "weight": 1}, "b": "y"}}}, "data.train.b.weight",
         "set a weight on every source or on none"),
        ({"data": {"train": {}}}, "data.train", "empty mapping"),
        ({"data": {"train": "x", "validation": {"a": {"files": "v", "weight": 2}}}}, "data.validation.a.weight",
         "only training sources"),
        ({"data": {"train": {"a": "x"}}, "stages": [{"sources": ["b"]}]}, "stages.0.sources", "data.train names ['a']"),
        ({"data": {"train": "x"}, "stages": [{"sources": ["a"]}]}, "stages.0.sources", "not a mapping of named"),
        ({"stages": [{"epoch": 2}]}, "stages.0.epoch", "did you mean epochs?"),
        ({"stages": []}, "stages", "empty list"),
        ({"stages": [{"sources": {"a": 0}}], "data": {"train": {"a": "x"}}}, "stages.0.sources", "above 0"),
    ],
)
def test_source_and_stage_mistakes_name_the_key(raw, key, hint):
    err = _error(raw)
    assert err.key == key and hint in str(err), str(err)


def test_named_sources_inherit_data_settings_and_the_training_source_s(tmp_path):
    recipe = recipe_from_dict({"data": {
        "columns": {"query": "q"}, "num_hard_negatives": 2,
        "train": {"a": {"files": "a.jsonl", "query_prompt": "query: ", "columns": {"query": "question"}},
                  "b": "b.jsonl"},
        "validation": {"a": "a-val.jsonl", "c": {"files": "c.jsonl", "num_hard_negatives": 0}}}})
    train, validation = recipe.data.sources("train"), recipe.data.sources("validation")
    assert train["a"].columns.query == "question" and train["b"].columns.query == "q"
    assert train["b"].num_hard_negatives == 2 and train["b"].query_prompt is None
    assert validation["a"].query_prompt == "query: " and validation["a"].columns.query == "question"
    assert validation["c"].columns.query == "q" and validation["c"].num_hard_negatives == 0
    assert recipe.data.sources("test") is None


def test_keys_a_model_cannot_honour_are_refused_before_training(tmp_path, tiny_clip_recipe):
    raw = dict(tiny_clip_recipe)
    train = raw["data"]["train"]
    with pytest.raises(RecipeError) as err:
        check_recipe(recipe_from_dict(dict(raw, data={"train": {"a": {"files": train, "query_instruction": "x"}}})))
    assert err.value.key == "data.train.a.query_instruction" and "query_prompt" in str(err.value)
    with pytest.raises(RecipeError) as err:
        check_recipe(recipe_from_dict(dict(raw, stages=[{"max_pixels": 4096}])))
    assert err.value.key == "stages.0.max_pixels" and "fixed image size" in str(err.value)
    with pytest.raises(RecipeError) as err:
        check_recipe(recipe_from_dict(dict(raw, data={"train": {"a": str(tmp_path / "nope.jsonl")}})))
    assert err.value.key == "data.train.a.files"
@pytest.mark.parametrize("content, says", [
    (bytes(range(256)) * 4, "is not a text file"),
    ("", "is empty"),
    ("# only a comment\n", "is empty"),
    ("learning_rate: 1e-4\nbatch_size: 8\nlearning_rate: 0.5\n", "'learning_rate' is given twice (first on line 1)"),
], ids=["binary", "empty", "comments-only", "duplicate-key"])
def test_a_recipe_file_that_is_not_a_usable_mapping_is_one_line_naming_the_file(tmp_path, content, says):
    path = tmp_path / "recipe.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert says in str(info.value) and str(path) in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("raw, key, says", [
    ({"model_type": {"a": 1}}, "model_type", "must be a name"),  # used to reach ADAPTER_DEFAULTS: TypeError
    ({"data": {"train": {"a": 1}}}, "data.train.a", "should be a valid"),  # a named source; was data.train.str
    ({"batch_size": True}, "batch_size", "expects a number, not true"),  # was a batch of 1
    ({"data": {"num_workers": False}}, "data.num_workers", "expects a number, not false"),
    ({"mrl_dims": [8, 16]}, "mrl_dims", "not from largest to smallest; write [16, 8]"),
], ids=["dict-for-name", "union-path", "bool-for-int", "bool-nested", "unsorted-mrl"])
def test_values_of_the_wrong_kind_name_their_key(raw, key, says):
    err = _error(raw)
    assert err.key == key and says in str(err), str(err)
    assert "(and " not in str(err)  # a union's members are one problem, not several


def test_a_bad_override_is_reported_as_the_override_not_the_file(tmp_path):
    path = _write(tmp_path, {"learning_rate": 1e-4})
    for override, key in (("learning_rate=-1", "learning_rate"), ("data.num_workers=true", "data.num_workers")):
        with pytest.raises(RecipeError) as info:
            load_recipe(path, [override])
        assert info.value.key == key and f"in --config_override {override}:" in str(info.value)
        assert str(path) not in str(info.value)
    with pytest.raises(RecipeError) as info:  # the file's own mistake is still the file's
        load_recipe(_write(tmp_path, {"learning_rate": -1.0}), ["batch_size=4"])
    assert f"in {tmp_path / 'recipe.yaml'}" in str(info.value)


def test_a_model_config_value_of_the_wrong_type_is_one_line_naming_model_config(tmp_path, tiny_tokenizer_dir):
    data = tmp_path / "train.jsonl"
    data.write_text('{"query": "a", "positive": "b"}\n')
    recipe = recipe_from_dict({"model_type": "clip", "tokenizer_name": tiny_tokenizer_dir, "data": {"train": str(data)},
                               "model_config": {"projection_dim": "big"}})
    with pytest.raises(RecipeError) as info:
        check_recipe(recipe)
    assert info.value.key == "model_config" and "projection_dim" in str(info.value) and "\n" not in str(info.value)


def test_an_override_whose_value_is_not_yaml_is_one_line(tmp_path):
    with pytest.raises(RecipeError) as info:
        load_recipe(_write(tmp_path, {}), ["learning_rate=[1"])
    assert info.value.key == "--config_override" and "not valid YAML" in str(info.value)
