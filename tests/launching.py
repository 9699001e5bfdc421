"""Launch a recipe the way users do (accelerate launch + a shipped config, or one process with no launcher) and
compare the final weights of two runs. Shared by the launch comparisons on CPU and on GPUs (tests/gpu/test_cuda.py),
so the comparison the GPU tests make is the one exercised on every CPU run.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
import yaml
from deadline import limit, run_with_deadline

ROOT = Path(__file__).resolve().parents[1]
# NVIDIA_TF32_OVERRIDE=0: no TF32 in cuBLAS/cuDNN, so fp32 on a GPU is fp32 (CLIP's patch embedding is a convolution,
# which cuDNN runs in TF32 by default). No effect on CPU.
ENV = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
           NVIDIA_TF32_OVERRIDE="0")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


LAUNCH_TIMEOUT = 900  # s; a launch takes 20-60 s on 2 idle cores (scaled by VEMBED_TEST_TIMEOUT_SCALE)


def write_recipe(base: dict, out: Path, **changes) -> Path:
    """A recipe file for 3 optimizer steps of `base` into `out` (checkpoint at step 2); the untrained model is
    evaluated too when `base` has a validation split."""
    raw = {**base, "output_dir": str(out), "max_steps": 3, "save_steps": 2, "logging_steps": 1,
           "learning_rate": 1e-3, "eval_before_training": "validation" in base["data"], **changes}
    out.parent.mkdir(parents=True, exist_ok=True)
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def launch(config: str | None, recipe: Path, *, processes: int = 2, mixed_precision: str = "no",
           cpu_only: bool = False) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file accelerate_configs/CONFIG` on `processes` processes, or (config None) one
    process with no launcher: the reference. `cpu_only` hides GPUs, so a CPU launch and its reference both run on
    CPU on a machine that has some."""
    if config is None:
        command = [sys.executable, "-m", "vembed.entrypoints.train", str(recipe)]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"accelerate_configs/{config}",
                   "--num_processes", str(processes), "--mixed_precision", mixed_precision,
                   "--main_process_port", str(free_port()), "vembed/entrypoints/train.py", str(recipe)]
    env = dict(ENV, CUDA_VISIBLE_DEVICES="") if cpu_only else ENV
    result = run_with_deadline(command, cwd=ROOT, env=env, timeout=limit(LAUNCH_TIMEOUT),
                               log_dir=recipe.with_suffix(".logs"))
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-4000:])
    return result


def train_in_this_process(recipe: Path) -> None:
    """The reference run (one process, no launcher, one thread as each launched rank has), in the test's own process:
    a fresh interpreter pays ~10 CPU s of imports (torch, transformers, DeepSpeed through save_pretrained) that the
    test process has paid already, for a 3-step run that takes one second."""
    import argparse
    from unittest import mock

    from vembed.entrypoints.train import run
    from vembed.training.threads import USER_THREADS_ENV

    threads = torch.get_num_threads()
    try:
        with mock.patch.dict(os.environ, {USER_THREADS_ENV: "1"}):
            code = run(argparse.Namespace(recipe=str(recipe), config_override=[], debug=False))
    finally:
        torch.set_num_threads(threads)
    assert code == 0, f"the one-process reference run of {recipe} failed (exit {code})"


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    """The exported model's tensors (`out/final/*.safetensors`): full weights, whatever the launch sharded. A loss's
    state saved beside them (ArcFace's centres: loss.safetensors) is not the model's; tests compare it on its own."""
    from safetensors.torch import load_file

    from vembed.losses.saved_state import LOSS_STATE_FILE

    files = sorted(path for path in (out / "final").glob("*.safetensors") if path.name != LOSS_STATE_FILE)
    assert files, f"no weights in {out / 'final'}"
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(file))
    return weights


# Key projections' biases (CLIP/Qwen: k_proj, BERT: attention.self.key): see max_relative_difference.
KEY_BIASES = ("k_proj.bias", "attention.self.key.bias")


def max_relative_difference(actual: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """The largest per-tensor difference relative to that tensor's largest entry; also asserts the same tensor names
    and shapes, and the whole parameter vector within 1e-5 relative."""
    assert actual.keys() == reference.keys(), sorted(set(actual) ^ set(reference))
    whole_ref = torch.cat([v.float().flatten() for v in reference.values()])
    whole_got = torch.cat([actual[k].float().flatten() for k in reference])
    assert whole_got.shape == whole_ref.shape
    assert ((whole_got - whole_ref).norm() / whole_ref.norm()).item() <= 1e-5
    worst = 0.0
    for name, ref in reference.items():
        if name.endswith(KEY_BIASES):
            # Softmax ignores a shift shared by all keys, so this gradient is zero in theory; Adam turns its rounding
            # noise (1e-9) into full-size steps in random directions, so it is compared only within the whole vector.
            continue
        got = actual[name].float()
        assert got.shape == ref.shape, f"{name}: {tuple(got.shape)} vs {tuple(ref.shape)}"
        scale = max(ref.float().abs().max().item(), 1e-6)
        worst = max(worst, (got - ref.float()).abs().max().item() / scale)
    return worst


def one_process_and_launched(raw: dict, out: Path, config: str, processes: int = 2, steps: int = 3) -> tuple[Path, Path]:
    """`raw` (a vision recipe; its batch_size the global batch) trained for `steps` steps in one process and under
    `config` on `processes` ranks of batch_size / processes each, into `out/single` (in this process) and
    `out/launched`: the two output folders, to compare as one run. No checkpoints or mid-run evaluations unless
    `raw` asks."""
    # No key bias: softmax ignores it, so its gradient is rounding noise (~1e-10) that Adam turns into full-size
    # steps of random sign; from its zero init, two launches' key biases differ by ~50% (measured) while the model
    # computes the same function.
    common = {"save_steps": None, "eval_steps": None, "logging_steps": 1, **raw, "max_steps": steps,
              "model_config": {**raw["model_config"], "qkv_bias": False}}
    runs = []
    for name, batch, launcher in (("single", raw["batch_size"], None),
                                  ("launched", raw["batch_size"] // processes, config)):
        recipe = out / f"{name}.yaml"
        recipe.parent.mkdir(parents=True, exist_ok=True)
        recipe.write_text(yaml.safe_dump({**common, "output_dir": str(out / name), "batch_size": batch}))
        if launcher is None:
            train_in_this_process(recipe)
        else:
            launch(launcher, recipe, processes=processes)
        runs.append(out / name)
    return runs[0], runs[1]
