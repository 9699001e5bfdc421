"""One recipe, every launch: the shipped accelerate configs, started the way users start them, train the same model
and measure it the same way.

Each launch runs 3 optimizer steps on 2 CPU processes (tiny CLIP; for FSDP2 + LoRA a tiny Qwen3-VL, what users
shard with LoRA) and is compared, parameter by parameter, with one process on the concatenated batch (same data
order, same seed). Resume from the step-2 checkpoint must land on the same final weights as the uninterrupted run.
Every run evaluates on the validation split before and after training: the figures in its metrics.json must be one
process's and those of its saved `final/` evaluated on one process (`evaluate_retrieval`, what `vembed eval` runs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from deadline import limit, run_with_deadline

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
PER_DEVICE = 8
LAUNCH_TIMEOUT = 900  # s; a launch takes 20-60 s on 2 idle cores
METRIC_TOLERANCE = 1e-6


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _recipe(base: dict, out: Path, **changes) -> Path:
    raw = {**base, "output_dir": str(out), "max_steps": 3, "save_steps": 2, "logging_steps": 1,
           "learning_rate": 1e-3, "eval_before_training": True, **changes}
    out.parent.mkdir(parents=True, exist_ok=True)
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _launch(config: str | None, recipe: Path) -> subprocess.CompletedProcess:
    if config is None:  # one process, no launcher: the reference
        command = [sys.executable, "-m", "vembed.entrypoints.train", str(recipe)]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"accelerate_configs/{config}",
                   "--num_processes", "2", "--mixed_precision", "no", "--main_process_port", str(_free_port()),
                   "vembed/entrypoints/train.py", str(recipe)]
    result = run_with_deadline(command, cwd=ROOT, env=ENV, timeout=limit(LAUNCH_TIMEOUT),
                               log_dir=recipe.with_suffix(".logs"))
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-4000:])
    return result


def _metrics(out: Path) -> dict:
    return json.loads((out / "metrics.json").read_text())


def _assert_same_metrics(got: dict, expected: dict, what: str) -> None:
    assert got.keys() == expected.keys(), what
    for key, value in expected.items():
        assert abs(got[key] - value) <= METRIC_TOLERANCE, f"{what}: {key} {got[key]} vs {value}"


def _saved_model_metrics(out: Path, base: dict) -> dict:
    """The saved final/ evaluated on the validation split by one process, as `vembed eval` does."""
    from vembed.data.sources import load_examples
    from vembed.evaluation.retrieval import evaluate_retrieval
    from vembed.models.base import load_embedding_adapter
    from vembed.recipe import DataConfig

    examples, _ = load_examples(DataConfig(validation=base["data"]["validation"]), "validation", num_hard_negatives=0)
    return evaluate_retrieval(load_embedding_adapter(out / "final"), examples)


def _weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted((out / "final").glob("*.safetensors"))
    assert files, f"no weights in {out / 'final'}"
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(file))
    return weights


def _max_relative_difference(actual: dict, reference: dict) -> float:
    """The largest per-tensor difference relative to that tensor's largest entry; also checks the whole vector."""
    assert actual.keys() == reference.keys()
    whole_ref = torch.cat([v.float().flatten() for v in reference.values()])
    whole_got = torch.cat([actual[k].float().flatten() for k in reference])
    assert ((whole_got - whole_ref).norm() / whole_ref.norm()).item() <= 1e-5
    worst = 0.0
    for name, ref in reference.items():
        if name.endswith("k_proj.bias"):
            # Softmax ignores a shift shared by all keys, so this gradient is zero in theory; Adam turns its rounding
            # noise (1e-9) into full-size steps in random directions, so it is compared only within the whole vector.
            continue
        got = actual[name].float()
        assert got.shape == ref.shape, f"{name}: {tuple(got.shape)} vs {tuple(ref.shape)}"
        scale = max(ref.float().abs().max().item(), 1e-6)
        worst = max(worst, (got - ref.float()).abs().max().item() / scale)
    return worst


@pytest.fixture(scope="module")
def bases(dummy_data_dir, tmp_path_factory):
    """Recipes of the two models the launches train: tiny CLIP, and tiny Qwen3-VL (what users shard with FSDP +
    LoRA: the 8B recipe), both on the dummy data."""
    from tiny_models import TINY_CLIP_CONFIG

    from vembed.data.tokenizer import train_qwen_tokenizer

    # The validation split (14 records) costs a second per evaluation.
    common = {"data": {"train": str(dummy_data_dir / "train.jsonl"),
                       "validation": str(dummy_data_dir / "validation.jsonl")},
              "seed": 0, "output_dir": str(tmp_path_factory.mktemp("launches"))}
    qwen = yaml.safe_load((ROOT / "configs" / "qwen3_vl_tiny.yaml").read_text())
    qwen_tokenizer = tmp_path_factory.mktemp("qwen_tokenizer")
    captions = [json.loads(line)["query"] for line in (dummy_data_dir / "train.jsonl").read_text().splitlines()]
    train_qwen_tokenizer(captions, qwen_tokenizer)
    return {
        "clip": {"model_type": "clip", "model_config": TINY_CLIP_CONFIG,
                 "tokenizer_name": str(dummy_data_dir / "tokenizer"), **common},
        "qwen_vl": {"model_type": "qwen_vl", "model_config": qwen["model_config"],
                    "tokenizer_name": str(qwen_tokenizer),
                    **{key: qwen[key] for key in ("min_pixels", "max_pixels", "query_instruction")}, **common},
    }


@pytest.fixture(scope="module")
def references(bases, tmp_path_factory):
    """Final weights and metrics.json of one process on batches of 2 x PER_DEVICE, per model, with and without LoRA
    (computed once)."""
    cache: dict[tuple[str, bool], tuple[dict[str, torch.Tensor], dict]] = {}

    def get(model: str, lora: bool) -> tuple[dict[str, torch.Tensor], dict]:
        if (model, lora) not in cache:
            out = tmp_path_factory.mktemp("single") / "run"
            _launch(None, _recipe(bases[model], out, batch_size=2 * PER_DEVICE, **_lora(lora)))
            cache[model, lora] = _weights(out), _metrics(out)
        return cache[model, lora]

    return get


def _lora(on: bool) -> dict:
    return {"use_lora": True, "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0} if on else {}


@pytest.mark.slow
@pytest.mark.parametrize(
    "config, model, lora, strategy",
    [
        ("deepspeed_zero2.yaml", "clip", False, "DeepSpeed ZeRO-2 (gloo)"),
        ("deepspeed_zero3.yaml", "clip", False, "DeepSpeed ZeRO-3 (gloo)"),
        ("fsdp.yaml", "clip", False, "FSDP2 FULL_SHARD (gloo)"),
        ("fsdp.yaml", "qwen_vl", True, "FSDP2 FULL_SHARD (gloo)"),
    ],
    ids=["zero2", "zero3", "fsdp", "fsdp-lora-qwen3vl"],
)
def test_launch_trains_and_evaluates_as_one_process_and_resumes_exactly(bases, references, tmp_path, config, model,
                                                                        lora, strategy):
    base = bases[model]
    out = tmp_path / "launched"
    result = _launch(config, _recipe(base, out, batch_size=PER_DEVICE, **_lora(lora)))
    assert f"strategy            {strategy} (2 processes)" in result.stdout + result.stderr
    launched = _weights(out)  # the exported final model: full weights (LoRA merged), gathered by every rank
    reference_weights, reference_metrics = references(model, lora)
    difference = _max_relative_difference(launched, reference_weights)
    print(f"{config} {model}{' + LoRA' if lora else ''}: max relative parameter difference after 3 steps "
          f"{difference:.2e}")
    assert difference <= (1e-5 if lora else 1e-4)

    # Evaluation before and after training, sharded over the ranks (ZeRO-3 and FSDP: through the sharded model),
    # computes what one process computes, and what the saved model computes.
    metrics = _metrics(out)
    _assert_same_metrics(metrics["before"], reference_metrics["before"], "before training, vs one process")
    _assert_same_metrics(metrics["validation"], reference_metrics["validation"], "after training, vs one process")
    _assert_same_metrics(metrics["validation"], _saved_model_metrics(out, base), "after training, vs the saved model")

    resumed_out = tmp_path / "resumed"
    _launch(config, _recipe(base, resumed_out, batch_size=PER_DEVICE, resume_from=str(out / "checkpoint-2"),
                            **_lora(lora)))
    assert _max_relative_difference(_weights(resumed_out), launched) <= 1e-6
    _assert_same_metrics(_metrics(resumed_out)["validation"], metrics["validation"], "resumed vs uninterrupted")

    import vembed

    loaded = vembed.load(str(out / "final"), device="cpu")  # loads on one device, no process group
    assert loaded.encode(texts=["a small yellow star"]).shape == (1, loaded.embedding_dim)


@pytest.mark.slow
def test_fsdp_bf16_evaluates_in_float32_as_the_saved_model(bases, references, tmp_path):
    """FSDP computes its bf16 training forward on bf16 copies of the weights; evaluation gathers the float32 weights
    it saves, so it reports what `vembed eval` reports on `final/` (and, before training, what one process does)."""
    base = bases["clip"]
    out = tmp_path / "launched"
    _launch("fsdp.yaml", _recipe(base, out, batch_size=PER_DEVICE, mixed_precision="bf16", save_steps=None))
    metrics = _metrics(out)
    _assert_same_metrics(metrics["before"], references("clip", False)[1]["before"], "before training, vs one process")
    _assert_same_metrics(metrics["validation"], _saved_model_metrics(out, base), "after training, vs the saved model")
