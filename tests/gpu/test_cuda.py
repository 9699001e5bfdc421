"""CUDA-only checks (skipped without a GPU): bf16 training on one GPU, and DDP over NCCL matching one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ROOT = Path(__file__).resolve().parents[2]


def test_bf16_training_on_one_gpu_improves_and_saves(tiny_clip_recipe):
    from vembed.recipe import recipe_from_dict
    from vembed.training.loop import Trainer

    recipe = recipe_from_dict(dict(tiny_clip_recipe, mixed_precision="bf16", max_steps=20, eval_before_training=True))
    trainer = Trainer(recipe)
    assert trainer.accelerator.device.type == "cuda"
    result = trainer.run()
    history = result.metrics["loss_history"]
    assert history[-1]["loss"] < history[0]["loss"]
    assert (result.final_model_dir / "vembed.json").is_file()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_ddp_nccl_launch_two_gpus(tiny_clip_recipe, tmp_path):
    import yaml

    raw = dict(tiny_clip_recipe, max_steps=4, save_steps=2)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "run.py", str(recipe), "--accelerate_config", "ddp",
                             "--num_processes", "2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads(Path(raw["output_dir"], "metrics.json").read_text())
    assert metrics["train"]["world_size"] == 2
