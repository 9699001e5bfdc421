"""Choosing a launch: the configs run.py picks, and combinations refused before training with one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from vembed.errors import LaunchError, RecipeError
from vembed.recipe import recipe_from_dict
from vembed.resources import accelerate_configs, package_root

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = accelerate_configs()  # the shipped ones, which the clone's accelerate_configs/ links to


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_shipped_accelerate_config_is_valid_yaml_with_its_files(name):
    config = yaml.safe_load((CONFIGS / name).read_text())
    assert config["distributed_type"] in {"NO", "MULTI_GPU", "DEEPSPEED", "FSDP"}
    deepspeed = (config.get("deepspeed_config") or {}).get("deepspeed_config_file")
    if deepspeed:
        import json

        ds = json.loads((package_root() / deepspeed).read_text())
        assert ds["zero_optimization"]["stage"] in (2, 3)
        # accelerate refuses a JSON config next to a mixed_precision in the YAML: precision comes from the recipe
        assert "mixed_precision" not in config
        if ds["zero_optimization"]["stage"] == 3:
            assert ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True  # final export
    if config["distributed_type"] == "FSDP":
        assert config["fsdp_config"]["fsdp_version"] == 2


def test_run_py_picks_fsdp_for_use_fsdp_and_one_process_per_gpu(monkeypatch):
    import torch

    from vembed.entrypoints.launch import choose_config

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr("vembed.entrypoints.launch._saved_accelerate_config", lambda: None)
    assert choose_config(None, use_fsdp=True) == (CONFIGS / "fsdp.yaml", 4)
    assert choose_config(None) == (CONFIGS / "ddp.yaml", 4)
    assert choose_config("deepspeed_zero3") == (CONFIGS / "deepspeed_zero3.yaml", 4)
    assert choose_config("ddp_cpu") == (CONFIGS / "ddp_cpu.yaml", None)  # a CPU config keeps its own count
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(LaunchError, match="use_fsdp needs several processes"):
        choose_config(None, use_fsdp=True)


def test_deepspeed_config_is_rewritten_with_an_absolute_json_path():
    from vembed.entrypoints.launch import _with_absolute_deepspeed_file

    copy = _with_absolute_deepspeed_file(CONFIGS / "deepspeed_zero2.yaml")
    named = yaml.safe_load(copy.read_text())["deepspeed_config"]["deepspeed_config_file"]
    assert Path(named).is_absolute() and Path(named).is_file()
    assert _with_absolute_deepspeed_file(CONFIGS / "ddp.yaml") == CONFIGS / "ddp.yaml"


def test_yaml_no_is_mixed_precision_no(tmp_path):
    from vembed.recipe import load_recipe

    path = tmp_path / "r.yaml"
    path.write_text("mixed_precision: no\n")
    assert load_recipe(str(path)).mixed_precision == "no"


def test_use_fsdp_without_an_fsdp_launch_is_refused(tiny_clip_recipe, monkeypatch):
    from vembed.training.strategy import build_accelerator

    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    monkeypatch.delenv("VEMBED_FSDP", raising=False)
    with pytest.raises(RecipeError, match="not FSDP") as info:
        build_accelerator(recipe_from_dict(dict(tiny_clip_recipe, use_fsdp=True)))
    assert info.value.key == "use_fsdp"


def test_gradient_cache_is_refused_under_deepspeed_and_fsdp_with_the_reason():
    from types import SimpleNamespace

    import torch
    from accelerate.utils import DistributedType
    from torch.distributed.fsdp import FSDPModule

    from vembed.training.strategy import GradientCacheChoice, build_train_step

    choice = GradientCacheChoice(True, 4, "on")
    deepspeed = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED)
    with pytest.raises(RecipeError, match="DeepSpeed") as info:
        build_train_step(deepspeed, torch.nn.Linear(2, 2), choice)
    assert info.value.key == "use_gradient_cache"

    sharded = torch.nn.Linear(2, 2)
    sharded.__class__ = type("FSDPLinear", (FSDPModule, torch.nn.Linear), {})  # what fully_shard does to a module
    plain = SimpleNamespace(distributed_type=DistributedType.MULTI_CPU)
    with pytest.raises(RecipeError, match="FSDP"):
        build_train_step(plain, sharded, choice)


def test_fsdp_no_shard_and_fsdp1_configs_are_refused(monkeypatch):
    from vembed.training.fsdp import settings_from_launch

    monkeypatch.setenv("FSDP_SHARDING_STRATEGY", "NO_SHARD")
    with pytest.raises(LaunchError, match="ddp.yaml"):
        settings_from_launch()
    monkeypatch.delenv("FSDP_SHARDING_STRATEGY")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(LaunchError, match="fsdp_version: 2"):
        settings_from_launch()
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", "false")
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "true")
    settings = settings_from_launch()
    assert settings.strategy_name == "SHARD_GRAD_OP + CPU offload"


def test_an_adapter_without_block_classes_is_refused_for_fsdp(tiny_clip_recipe, monkeypatch):
    from vembed.models.clip import ClipAdapter
    from vembed.training.fsdp import FsdpSettings, shard_objective
    from vembed.training.objective import ContrastiveObjective

    recipe = recipe_from_dict(tiny_clip_recipe)
    adapter = ClipAdapter.from_recipe(recipe)
    monkeypatch.setattr(ClipAdapter, "block_classes", lambda self: set())
    with pytest.raises(RecipeError, match="names no transformer block") as info:
        shard_objective(ContrastiveObjective(adapter, None), recipe, None, FsdpSettings(True, False))
    assert info.value.key == "model_type"


def test_clip_names_its_encoder_layers_as_blocks_from_no_split_modules(tiny_clip_recipe):
    from vembed.models.clip import ClipAdapter

    adapter = ClipAdapter.from_recipe(recipe_from_dict(tiny_clip_recipe))
    names = {cls.__name__ for cls in adapter.block_classes()}
    assert "CLIPEncoderLayer" in names and names <= {"CLIPEncoderLayer", "CLIPTextEmbeddings", "CLIPVisionEmbeddings"}


def test_launch_block_names_the_strategy_and_gradcache(tiny_clip_recipe, tmp_path):
    raw = dict(tiny_clip_recipe, max_steps=1, use_gradient_cache=True, gradient_cache_chunk_size=3,
               eval_before_training=False)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(raw))
    result = subprocess.run([sys.executable, "-m", "vembed.entrypoints.train", str(path)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300,
                            env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout + result.stderr
    assert "strategy            single device + GradCache (1 process)" in out
    assert "GradCache           on (use_gradient_cache); chunk 3 samples per forward" in out
