"""CUDA checks (skipped without a GPU): bf16 training on one GPU, GradCache under bf16, and launches on 2 GPUs over NCCL
that must train the same weights as one process on the concatenated batch.

The launch comparisons use tests/launching.py, the helpers of the CPU launch tests; the DDP one is parametrised over
gloo on CPU too, so the very comparison the GPU run makes also runs (`-m slow`) on machines without a GPU. The CPU
versions of the sharded launches are tests/training/test_launches.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from launching import final_weights, launch, max_relative_difference, write_recipe

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
PER_DEVICE = 8


def _tiny_clip(dummy_data_dir: Path, tmp_path: Path) -> dict:
    from tiny_models import TINY_CLIP_CONFIG

    return {"model_type": "clip", "model_config": TINY_CLIP_CONFIG, "tokenizer_name": str(dummy_data_dir / "tokenizer"),
            "data": {"train": str(dummy_data_dir / "train.jsonl")}, "seed": 0, "output_dir": str(tmp_path)}


@pytest.mark.gpu
@needs_cuda
def test_bf16_training_on_one_gpu_improves_and_saves(tiny_clip_recipe):
    from vembed.components import recipe_from_dict
    from vembed.training.loop import Trainer

    recipe = recipe_from_dict(dict(tiny_clip_recipe, mixed_precision="bf16", max_steps=20, eval_before_training=True))
    trainer = Trainer(recipe)
    assert trainer.accelerator.device.type == "cuda"
    result = trainer.run()
    history = result.metrics["loss_history"]
    assert history[-1]["loss"] < history[0]["loss"]
    assert (result.final_model_dir / "vembed.json").is_file()


@pytest.mark.parametrize("config, cpu_only", [
    pytest.param("ddp_cpu.yaml", True, marks=pytest.mark.slow, id="gloo-cpu"),
    pytest.param("ddp.yaml", False, marks=[pytest.mark.gpu, needs_two_gpus], id="nccl-2gpus"),
])
def test_ddp_launch_trains_the_same_weights_as_one_process(dummy_data_dir, tmp_path, config, cpu_only):
    """2 processes of 8 for 3 steps = one process on batches of 16 (fp32, no TF32), parameter by parameter."""
    base = _tiny_clip(dummy_data_dir, tmp_path)
    reference = tmp_path / "single"
    launch(None, write_recipe(base, reference, batch_size=2 * PER_DEVICE), cpu_only=cpu_only)
    launched = tmp_path / "ddp"
    result = launch(config, write_recipe(base, launched, batch_size=PER_DEVICE), cpu_only=cpu_only)
    assert "(2 processes)" in result.stdout + result.stderr
    difference = max_relative_difference(final_weights(launched), final_weights(reference))
    print(f"{config}: max relative parameter difference after 3 steps {difference:.2e}")
    assert difference <= 1e-4


@pytest.mark.gpu
@needs_cuda
def test_grad_cache_bf16_on_one_gpu_matches_the_plain_step(tiny_clip_recipe):
    """bf16 autocast in the no-grad pass, the cached loss and the replays: gradients close to the plain step.

    In this process, as the test above: tests/ranks.py's gloo ranks set ACCELERATE_USE_CPU, so the model would stay on
    the CPU (the first GPU run failed that way)."""
    from accelerate.utils import send_to_device

    from vembed.components import recipe_from_dict
    from vembed.training.loop import Trainer

    grads = {}
    for name, overrides in (("cached", {"use_gradient_cache": True, "gradient_cache_chunk_size": 3}), ("plain", {})):
        trainer = Trainer(recipe_from_dict(dict(tiny_clip_recipe, mixed_precision="bf16", **overrides)))
        trainer.build()
        assert trainer.accelerator.device.type == "cuda"
        batch = send_to_device(trainer.loader.collate_fn([trainer.dataset[i] for i in range(8)]), "cuda")
        torch.manual_seed(0)
        trainer.train_step(batch)
        model = trainer.accelerator.unwrap_model(trainer.model)
        grads[name] = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
    relative = ((grads["cached"] - grads["plain"]).norm() / grads["plain"].norm()).item()
    assert relative < 2e-2, relative  # bf16 rounding differs between chunked and whole-batch matmuls


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("config", ["fsdp.yaml", "deepspeed_zero2.yaml", "deepspeed_zero3.yaml"])
def test_sharded_launch_on_two_gpus_trains_the_same_weights_as_one_process(dummy_data_dir, tmp_path, config):
    """FSDP2 / ZeRO-2 / ZeRO-3 over NCCL, fp32: the final (gathered) weights equal one process on the concatenated
    batch, as on CPU (tests/training/test_launches.py, same bound); the export loads on one device."""
    base = _tiny_clip(dummy_data_dir, tmp_path)
    reference = tmp_path / "single"
    launch(None, write_recipe(base, reference, batch_size=2 * PER_DEVICE))
    launched = tmp_path / "sharded"
    launch(config, write_recipe(base, launched, batch_size=PER_DEVICE))
    difference = max_relative_difference(final_weights(launched), final_weights(reference))
    print(f"{config}: max relative parameter difference after 3 steps {difference:.2e}")
    assert difference <= 1e-4
    assert (launched / "checkpoint-2" / "trainer_state.json").is_file()
    import vembed

    model = vembed.load(str(launched / "final"), device="cuda")
    assert model.encode(texts=["a small yellow star"]).shape == (1, 16)


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("config", ["fsdp.yaml", "deepspeed_zero2.yaml", "deepspeed_zero3.yaml"])
def test_sharded_bf16_launch_on_two_gpus_trains_and_exports(dummy_data_dir, tmp_path, config):
    """The same launches under bf16 (FSDP with LoRA, as the 8B recipe): they train and export. bf16 rounding differs
    between the sharded and the one-process step, so exactness is the fp32 test's job."""
    base = _tiny_clip(dummy_data_dir, tmp_path)
    lora = {"use_lora": True, "lora_r": 4, "lora_dropout": 0.0} if config == "fsdp.yaml" else {}
    out = tmp_path / "bf16"
    launch(config, write_recipe(base, out, batch_size=PER_DEVICE, mixed_precision="bf16", **lora),
           mixed_precision="bf16")
    assert len(final_weights(out)) > 0
    import vembed

    model = vembed.load(str(out / "final"), device="cuda")
    assert model.encode(texts=["a small yellow star"]).shape == (1, 16)
