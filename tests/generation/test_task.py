"""The measured bar, end to end on CPU: `vembed extract` over a fixed teacher pair → the training loop trains a tiny
DiT → held-out cosine with Heun ≥ 0.90, and Heun solves the sampling ODE more accurately than Euler at equal cost
(20 model evaluations; at fewer, Euler is closer: see docs/notes.md)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from interrupts import stop_after_checkpoint
from teachers import save_teachers, write_images

from vembed.cli import main as vembed
from vembed.components import load_recipe
from vembed.recipe_checks import check_recipe

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "blip3o_dit_tiny.yaml"


@pytest.fixture
def one_thread():
    # Two shared cores: one thread per process is several times faster than two fighting for them.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("blip3o")
    eva, clip = save_teachers(root)
    for split, n, seed in (("train", 512, 0), ("validation", 64, 1)):
        images = write_images(root / "images" / split, n, seed=seed, start=seed * 100000)
        code = vembed(["extract", "--teacher-a", eva, "--teacher-b", clip, "--images", str(images),
                       "--out", str(root / "shards" / split), "--shard-size", "128", "--dtype", "float32"])
        assert code == 0
    return root / "shards"


def tiny_recipe(shards: Path, output_dir: Path, *overrides: str):
    return load_recipe(TINY, [f"data.train={shards / 'train'}", f"data.validation={shards / 'validation'}",
                              f"output_dir={output_dir}", *overrides])


def test_tiny_dit_reaches_090_cosine_with_heun_and_heun_beats_euler(shards, tmp_path, one_thread, capsys):
    from vembed.generation import load_generator
    from vembed.training.loop import Trainer

    recipe = tiny_recipe(shards, tmp_path / "run")
    check_recipe(recipe)
    started = time.perf_counter()
    result = Trainer(recipe).run()
    seconds = time.perf_counter() - started

    validation = result.metrics["validation"]
    assert validation["image_cosine"] >= 0.90
    assert validation["token_cosine"] >= 0.90
    assert validation["num_samples"] == 64
    assert (result.output_dir / "similarity_histogram.png").stat().st_size > 0
    saved = json.loads((result.output_dir / "metrics.json").read_text())
    assert saved["validation"]["image_cosine"] == pytest.approx(validation["image_cosine"])
    card = (result.final_model_dir / "README.md").read_text()  # a generator's card: its metrics, plot and loader
    assert f"| image_cosine | {validation['image_cosine']:.4f} |" in card
    assert "![" in card and (result.final_model_dir / "similarity_histogram.png").is_file()
    assert "load_generator(" in card

    # Solver accuracy: distance to a fine reference solution of the same ODE from the same noise, at equal cost.
    from vembed.data.embedding_shards import EmbeddingShardDataset
    from vembed.evaluation.similarity import per_image_cosine

    model = load_generator(result.final_model_dir).eval()
    data = EmbeddingShardDataset(str(shards / "validation")).tensors()
    noise = torch.randn(data["clip"].shape, generator=torch.Generator().manual_seed(0))
    reference = model.generate(data["eva"], noise=noise, sampler="euler", num_steps=400)
    nfe = 20  # Heun: 2 evaluations per step
    figures = {}
    for sampler, steps in (("heun", nfe // 2), ("euler", nfe)):
        out = model.generate(data["eva"], noise=noise, sampler=sampler, num_steps=steps)
        figures[sampler] = {"distance_to_reference": ((out - reference).norm() / reference.norm()).item(),
                            "image_cosine": per_image_cosine(out, data["clip"]).mean().item()}
    with capsys.disabled():
        print(f"\nblip3o tiny: {seconds:.1f} s training+eval; validation {json.dumps(validation)}; at {nfe} model "
              f"evaluations, relative distance to a 400-step Euler solution: {json.dumps(figures)}")
    assert figures["heun"]["distance_to_reference"] < figures["euler"]["distance_to_reference"], figures


def test_wrong_dims_are_one_recipe_line_naming_key_and_index(shards, tmp_path):
    from vembed.errors import RecipeError

    with pytest.raises(RecipeError) as info:
        check_recipe(tiny_recipe(shards, tmp_path / "run", "dit.clip_dim=1024"))
    message = str(info.value)
    assert "dit.clip_dim" in message and str(shards / "train" / "index.json") in message
    assert "32" in message and len(message.splitlines()) == 1


def test_a_flow_loss_on_a_contrastive_model_is_refused(shards, tmp_path):
    from vembed.components import recipe_from_dict
    from vembed.errors import RecipeError

    recipe = recipe_from_dict({"model_type": "clip", "loss_type": "flow_matching", "model_name": "x",
                               "data": {"train": str(shards / "train")}})
    with pytest.raises(RecipeError, match="loss_type: 'flow_matching' is a flow_matching loss but model_type 'clip'"):
        check_recipe(recipe)
    with pytest.raises(RecipeError, match="dit in .*: is a blip3o_dit setting; this recipe's model_type is clip"):
        tiny_recipe(shards, tmp_path / "run", "model_type=clip")  # the DiT's own keys do not fit CLIP either


def test_a_resumed_dit_run_ends_with_the_same_weights(shards, tmp_path, one_thread, monkeypatch):
    """Same checkpointing as contrastive runs: interrupted mid second epoch and resumed = uninterrupted (the noise
    and times drawn each step come back with the RNG state)."""
    from safetensors.torch import load_file

    from vembed.training.loop import Trainer

    settings = ["max_steps=11", "save_steps=10", "eval_steps=null", "flow.num_steps=2", "dit.num_layers=1",
                "flow.time_sampling=logit_normal", "flow.cosine_weight=0.1"]
    Trainer(tiny_recipe(shards, tmp_path / "reference", *settings)).run()

    stop_after_checkpoint(lambda: Trainer(tiny_recipe(shards, tmp_path / "interrupted", *settings)).run())
    Trainer(tiny_recipe(shards, tmp_path / "interrupted", *settings, "resume_from=auto")).run()

    expected = load_file(str(tmp_path / "reference" / "final" / "model.safetensors"))
    actual = load_file(str(tmp_path / "interrupted" / "final" / "model.safetensors"))
    assert expected.keys() == actual.keys()
    for key, value in expected.items():
        assert torch.equal(value, actual[key]), key


@pytest.mark.parametrize("name", ["blip3o_dit_base.yaml", "blip3o_dit_fsdp.yaml", "blip3o_dit_tiny.yaml"])
def test_shipped_recipes_parse_and_check_against_shards(name, shards, tmp_path):
    recipe = load_recipe(ROOT / "configs" / name)
    assert recipe.model_type == "blip3o_dit" and recipe.loss_type == "flow_matching"
    # Point them at the test shards (whose dims are not the real teachers').
    overrides = [f"data.train={shards / 'train'}", f"data.validation={shards / 'validation'}",
                 f"output_dir={tmp_path}", "dit.eva_dim=null", "dit.clip_dim=null", "dit.num_tokens=null"]
    check_recipe(load_recipe(ROOT / "configs" / name, overrides))


def test_the_retrieval_metric_is_refused_with_the_fix(shards, tmp_path):
    from vembed.errors import RecipeError

    with pytest.raises(RecipeError, match="metric_for_best_model.*image_cosine"):
        check_recipe(tiny_recipe(shards, tmp_path / "run", "metric_for_best_model=q2d/accuracy@1"))


def test_the_task_is_chosen_by_the_model_through_the_registry():
    from vembed.components import recipe_from_dict
    from vembed.generation.task import FlowMatchingTask
    from vembed.tasks import task_for
    from vembed.tasks.contrastive import ContrastiveTask

    assert task_for(recipe_from_dict({"model_type": "clip"})) is ContrastiveTask
    assert task_for(recipe_from_dict({"model_type": "blip3o_dit", "loss_type": "flow_matching"})) is FlowMatchingTask


def test_a_dit_folder_given_to_the_embedding_api_is_one_clear_error(tmp_path):
    import vembed
    from vembed.errors import RecipeError
    from vembed.generation.dit import Blip3oDiT, DiTConfig

    Blip3oDiT(DiTConfig(eva_dim=12, clip_dim=8, num_tokens=4, hidden_size=16, num_layers=1, num_heads=4,
                        num_kv_heads=2, eva_adapter_layers=1, mlp_ratio=2.0)).save(tmp_path / "dit")
    with pytest.raises(RecipeError, match="not an embedding model.*vembed.generation.load_generator"):
        vembed.load(str(tmp_path / "dit"))
