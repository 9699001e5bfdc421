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
from pathlib import Path

import pytest
import torch
import yaml
from launching import final_weights, launch, max_relative_difference, train_in_this_process, write_recipe

ROOT = Path(__file__).resolve().parents[2]
PER_DEVICE = 8
METRIC_TOLERANCE = 1e-6


def _metrics(out: Path) -> dict:
    return json.loads((out / "metrics.json").read_text())


def _assert_same_metrics(got: dict, expected: dict, what: str) -> None:
    assert got.keys() == expected.keys(), what
    for key, value in expected.items():
        assert abs(got[key] - value) <= METRIC_TOLERANCE, f"{what}: {key} {got[key]} vs {value}"


def _saved_model_metrics(out: Path, base: dict) -> dict:
    """The saved final/ evaluated on the validation split by one process, as `vembed eval` does."""
    from vembed.data.sources import load_examples
    from vembed.evaluation.pairs import evaluate_retrieval
    from vembed.evaluation.scored import evaluate_scored
    from vembed.models.base import load_adapter
    from vembed.recipe import DataConfig

    # negatives kept, as vembed eval keeps them: triplet accuracy reads the first
    examples, _ = load_examples(DataConfig(validation=base["data"]["validation"]), "validation",
                                num_hard_negatives=None)
    adapter = load_adapter(out / "final")
    return {**evaluate_retrieval(adapter, examples), **evaluate_scored(adapter, examples)}


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
            train_in_this_process(write_recipe(bases[model], out, batch_size=2 * PER_DEVICE, **_lora(lora)))
            cache[model, lora] = final_weights(out), _metrics(out)
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
    result = launch(config, write_recipe(base, out, batch_size=PER_DEVICE, **_lora(lora)))
    assert f"strategy            {strategy} (2 processes)" in result.stdout + result.stderr
    card = (out / "final" / "README.md").read_text()  # the model card, written with the gathered weights
    assert f"| strategy | {strategy} |" in card and "| world size (processes) | 2 |" in card
    launched = final_weights(out)  # the exported final model: full weights (LoRA merged), gathered by every rank
    reference_weights, reference_metrics = references(model, lora)
    difference = max_relative_difference(launched, reference_weights)
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
    launch(config, write_recipe(base, resumed_out, batch_size=PER_DEVICE, resume_from=str(out / "checkpoint-2"),
                            **_lora(lora)))
    assert max_relative_difference(final_weights(resumed_out), launched) <= 1e-6
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
    launch("fsdp.yaml", write_recipe(base, out, batch_size=PER_DEVICE, mixed_precision="bf16", save_steps=None))
    metrics = _metrics(out)
    _assert_same_metrics(metrics["before"], references("clip", False)[1]["before"], "before training, vs one process")
    _assert_same_metrics(metrics["validation"], _saved_model_metrics(out, base), "after training, vs the saved model")
