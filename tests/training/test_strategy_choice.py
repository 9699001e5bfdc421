"""Choosing a launch: the configs run.py picks, and combinations refused before training with one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from vembed.components import recipe_from_dict
from vembed.errors import LaunchError, RecipeError
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
    from vembed.components import load_recipe

    path = tmp_path / "r.yaml"
    path.write_text("mixed_precision: no\n")
    assert load_recipe(str(path)).mixed_precision == "no"


FSDP_LAUNCH = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "WORLD_SIZE": "2"}
ZERO3_LAUNCH = {"ACCELERATE_USE_DEEPSPEED": "true", "WORLD_SIZE": "2",
                "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(CONFIGS / "deepspeed" / "zero3.json")}


@pytest.fixture
def launch_env(monkeypatch):
    """Set the variables an `accelerate launch` of some kind would set (and clear those of other launches)."""
    for name in ("ACCELERATE_USE_FSDP", "VEMBED_FSDP", "ACCELERATE_USE_DEEPSPEED", "WORLD_SIZE",
                 "VEMBED_EXPECTED_WORLD_SIZE", "VEMBED_LAUNCHER", "ACCELERATE_DEEPSPEED_CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("vembed.training.launch_promise._parent_accelerate_launch_arguments", lambda: None)

    def apply(variables: dict[str, str]) -> None:
        for name, value in variables.items():
            monkeypatch.setenv(name, value)

    return apply


def test_use_fsdp_without_an_fsdp_launch_is_refused(tiny_clip_recipe, launch_env):
    from vembed.training.launch_plan import decide_launch

    with pytest.raises(RecipeError, match="not FSDP") as info:
        decide_launch(recipe_from_dict(dict(tiny_clip_recipe, use_fsdp=True)))
    assert info.value.key == "use_fsdp"


@pytest.mark.parametrize("launch, named", [(FSDP_LAUNCH, "FSDP"), (ZERO3_LAUNCH, "DeepSpeed")])
def test_gradient_cache_is_refused_under_deepspeed_and_fsdp_from_the_plan(tiny_clip_recipe, launch_env, launch,
                                                                          named, monkeypatch):
    from vembed.models.clip import ClipAdapter
    from vembed.training.launch_plan import decide_launch

    launch_env(launch)
    # The refusal is a decision: it needs no model. Building one would be too late for an 8B checkpoint.
    monkeypatch.setattr(ClipAdapter, "from_recipe", classmethod(lambda cls, recipe: pytest.fail("model built")))
    with pytest.raises(RecipeError, match=named) as info:
        decide_launch(recipe_from_dict(dict(tiny_clip_recipe, use_gradient_cache=True)))
    assert info.value.key == "use_gradient_cache"


def test_the_8b_fsdp_recipe_runs_without_gradcache_instead_of_being_refused(launch_env):
    """gradient_checkpointing on an 8B model would switch GradCache on by the automatic rule, which FSDP refuses;
    under FSDP the rule does not apply, decided from the meta-device model in seconds."""
    import time

    from vembed.components import load_recipe
    from vembed.training.launch_plan import decide_launch

    launch_env(FSDP_LAUNCH)
    started = time.perf_counter()
    architecture = (ROOT / "bench" / "configs" / "qwen3_vl_8b.json").read_text()  # the checkpoint's sizes, offline
    recipe = load_recipe(ROOT / "configs" / "qwen3_vl_embedding_8b_fsdp.yaml",
                         ["model_name=null", f"model_config={architecture}", "tokenizer_name=never-read"])
    assert recipe.gradient_checkpointing and recipe.use_gradient_cache is None  # the rule would apply
    plan = decide_launch(recipe)
    assert plan.kind == "fsdp" and not plan.grad_cache.enabled and "not available under FSDP" in plan.grad_cache.reason
    assert plan.strategy == "FSDP2 FULL_SHARD (gloo)" or plan.strategy == "FSDP2 FULL_SHARD (NCCL)"
    assert time.perf_counter() - started < 30


def test_deepspeed_launch_without_deepspeed_installed_is_one_line(tiny_clip_recipe, launch_env, monkeypatch):
    import importlib.util

    from vembed.training.launch_plan import decide_launch

    launch_env(ZERO3_LAUNCH)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    with pytest.raises(LaunchError, match=r"pip install 'vembed\[deepspeed\]'"):
        decide_launch(recipe_from_dict(tiny_clip_recipe))


def test_zero3_without_16bit_gather_is_refused_before_training(tiny_clip_recipe, launch_env, tmp_path):
    import json

    from vembed.training.launch_plan import decide_launch

    config = json.loads((CONFIGS / "deepspeed" / "zero3.json").read_text())
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = False
    (tmp_path / "zero3.json").write_text(json.dumps(config))
    launch_env(dict(ZERO3_LAUNCH, ACCELERATE_DEEPSPEED_CONFIG_FILE=str(tmp_path / "zero3.json")))
    with pytest.raises(LaunchError, match="stage3_gather_16bit_weights_on_model_save"):
        decide_launch(recipe_from_dict(tiny_clip_recipe))


@pytest.mark.parametrize("launch, strategy, planner", [
    ({}, "single device", "single"),
    ({"WORLD_SIZE": "2"}, "DDP (gloo)", "ddp"),
    (FSDP_LAUNCH, "FSDP2 FULL_SHARD (gloo)", "fsdp"),
    (ZERO3_LAUNCH, "DeepSpeed ZeRO-3 (gloo)", "zero3"),
    (dict(ZERO3_LAUNCH, ACCELERATE_DEEPSPEED_CONFIG_FILE=str(CONFIGS / "deepspeed" / "zero2.json")),
     "DeepSpeed ZeRO-2 (gloo)", "zero2"),
    (dict(ZERO3_LAUNCH, ACCELERATE_DEEPSPEED_CONFIG_FILE=str(CONFIGS / "deepspeed" / "zero3_offload.json")),
     "DeepSpeed ZeRO-3 + CPU offload (parameters, optimizer) (gloo)", "zero3+offload"),
])
def test_the_plan_names_each_launch_with_its_stage(tiny_clip_recipe, launch_env, monkeypatch, launch, strategy,
                                                   planner):
    from vembed.training.launch_plan import decide_launch

    monkeypatch.setattr("vembed.training.launch_plan._cuda_available", lambda: False)
    launch_env(launch)
    plan = decide_launch(recipe_from_dict(tiny_clip_recipe))
    assert (plan.strategy, plan.planner_strategy) == (strategy, planner)


@pytest.mark.parametrize("command, hint", [
    ("python run.py", "`python run.py RECIPE --accelerate_config ddp_cpu`"),
    ("vembed train", "`vembed train RECIPE --accelerate_config ddp_cpu`"),
])
def test_a_broken_promise_names_the_flag_of_the_command_that_was_run(tiny_clip_recipe, launch_env, command, hint):
    from vembed.training.launch_plan import decide_launch

    launch_env({"VEMBED_EXPECTED_WORLD_SIZE": "2", "VEMBED_LAUNCHER": command})
    with pytest.raises(LaunchError, match="promised 2 processes") as info:
        decide_launch(recipe_from_dict(tiny_clip_recipe))
    assert hint in str(info.value) and "--config_file" not in str(info.value)


def test_accelerate_launch_promises_the_count_of_its_flag_or_its_config(tmp_path, monkeypatch):
    from vembed.training.launch_promise import promise_of_accelerate_launch

    saved = tmp_path / "default_config.yaml"
    saved.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\n")
    monkeypatch.setattr("accelerate.commands.config.default_config_file", str(saved))
    # the saved config (what `accelerate config` wrote), --config_file, and the flag, which wins
    assert promise_of_accelerate_launch(["train.py", "r.yaml"]).num_processes == 2
    assert promise_of_accelerate_launch(["train.py", "r.yaml"]).distributed_type == "MULTI_CPU"
    other = tmp_path / "other.yaml"
    other.write_text("distributed_type: MULTI_GPU\nnum_processes: 4\n")
    assert promise_of_accelerate_launch(["--config_file", str(other), "-m", "vembed.entrypoints.train"]
                                        ).num_processes == 4
    assert promise_of_accelerate_launch(["--cpu", "--num_processes", "3", "train.py"]).num_processes == 3


def test_an_adapter_without_block_classes_is_refused_for_fsdp(tiny_clip_recipe, launch_env, monkeypatch):
    from vembed.models.clip import ClipAdapter
    from vembed.training.launch_plan import decide_launch

    launch_env(FSDP_LAUNCH)
    monkeypatch.setattr(ClipAdapter, "block_classes", lambda self: set())
    with pytest.raises(RecipeError, match="names no transformer block") as info:
        decide_launch(recipe_from_dict(tiny_clip_recipe))
    assert info.value.key == "model_type"


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


def test_the_trainer_refuses_before_it_reads_data_or_builds_the_model(tiny_clip_recipe, launch_env, monkeypatch):
    from vembed.models.clip import ClipAdapter
    from vembed.tasks.contrastive import ContrastiveTask
    from vembed.training.loop import Trainer

    launch_env(FSDP_LAUNCH)
    monkeypatch.setattr(ClipAdapter, "from_recipe", classmethod(lambda cls, recipe: pytest.fail("model built")))
    monkeypatch.setattr(ContrastiveTask, "load_train_data", lambda self: pytest.fail("data read"))
    with pytest.raises(RecipeError, match="GradCache is not available under FSDP"):
        Trainer(recipe_from_dict(dict(tiny_clip_recipe, use_gradient_cache=True)))


def _saved_config_launch(tmp_path: Path, recipe: dict, command: list[str]) -> subprocess.CompletedProcess:
    """`command` with an `accelerate config` saved for 2 CPU processes (distributed_type MULTI_CPU, what `accelerate
    config` writes for "multi-CPU")."""
    import os

    home = tmp_path / "hf_home"
    (home / "accelerate").mkdir(parents=True, exist_ok=True)
    (home / "accelerate" / "default_config.yaml").write_text(yaml.safe_dump({
        "compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_CPU", "num_processes": 2,
        "num_machines": 1, "machine_rank": 0, "mixed_precision": "no", "use_cpu": True}))
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    env = dict(os.environ, HF_HOME=str(home), HF_HUB_OFFLINE="1", WANDB_MODE="offline", OMP_NUM_THREADS="1")
    return subprocess.run([*command, str(path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_a_saved_multi_cpu_config_is_refused_by_accelerate_launch_and_honoured_by_vembed_train(tiny_clip_recipe,
                                                                                                tmp_path):
    raw = dict(tiny_clip_recipe, max_steps=2, data={"train": tiny_clip_recipe["data"]["train"]})
    # accelerate's launcher starts such a config as ONE process; training it silently would be the bug.
    refused = _saved_config_launch(tmp_path, raw, [sys.executable, "-m", "accelerate.commands.launch",
                                                   "vembed/entrypoints/train.py"])
    # Our line comes first; accelerate's simple launcher then re-raises the child's exit code as its own traceback.
    assert refused.returncode != 0
    first = refused.stderr.splitlines()[0]
    assert first.startswith("launch error: this launch promised 2 processes"), refused.stderr[-2000:]
    assert "MULTI_CPU config as one process" in first and "--config_file" in first and "ddp_cpu.yaml" in first
    assert not Path(raw["output_dir"]).exists()  # nothing written

    # vembed train keeps the promise: the same config, launched as 2 real gloo ranks.
    launched = _saved_config_launch(tmp_path, raw, [sys.executable, "-m", "vembed", "train"])
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert "strategy            DDP (gloo) (2 processes)" in launched.stdout + launched.stderr
    metrics = json.loads((Path(raw["output_dir"]) / "metrics.json").read_text())
    assert metrics["train"]["world_size"] == 2 and metrics["train"]["steps"] == 2
