"""The Qwen3-VL recipes users copy: they parse, pass the checks against a local checkpoint, and the tiny one trains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vembed.components import load_recipe
from vembed.recipe_checks import check_recipe

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """The demo's digits (images + captions) and a Qwen-style tokenizer trained on the captions."""
    from vembed.data.synthetic import make_digits_dataset
    from vembed.data.tokenizer import train_qwen_tokenizer

    path = tmp_path_factory.mktemp("qwen_demo") / "data"
    make_digits_dataset(path, image_size=32, seed=0)
    captions = [json.loads(line)["query"] for line in (path / "train.jsonl").read_text().splitlines()]
    train_qwen_tokenizer(captions, path / "qwen-tokenizer")
    return path


def _tiny_overrides(digits: Path, output_dir: Path) -> list[str]:
    # The accuracy threshold below was set with every in-batch record a negative. Same-label masking (on by default)
    # moves this 30-step, 60-record figure by about 0.1 either way with the seed (q2d accuracy@1, seed 0: 0.233
    # unmasked, 0.117 masked; seeds 1 and 2: equal or better masked), so this test keeps what it was calibrated on.
    return [f"tokenizer_name={digits / 'qwen-tokenizer'}", f"data.train={digits / 'train.jsonl'}",
            f"data.validation={digits / 'validation.jsonl'}", f"output_dir={output_dir}", "data.mask_same_label=false"]


def test_tiny_qwen3_vl_trains_on_the_demo_digits_and_improves_accuracy(digits, tmp_path):
    from vembed.training.loop import Trainer

    recipe = load_recipe(CONFIGS / "qwen3_vl_tiny.yaml", _tiny_overrides(digits, tmp_path / "run"))
    check_recipe(recipe)
    result = Trainer(recipe).run()
    before, after = result.metrics["before"], result.metrics["validation"]
    print(f"tiny Qwen3-VL on digits: q2d accuracy@1 {before['q2d/accuracy@1']:.3f} -> {after['q2d/accuracy@1']:.3f}, "
          f"d2q {before['d2q/accuracy@1']:.3f} -> {after['d2q/accuracy@1']:.3f}")
    assert after["q2d/accuracy@1"] > before["q2d/accuracy@1"] + 0.1
    assert after["q2d/mrr"] > before["q2d/mrr"]
    # The saved model loads back through the adapter registry and embeds as the trained one did.
    import vembed

    model = vembed.load(result.final_model_dir, device="cpu")
    assert model.model_type == "qwen_vl" and model.embedding_dim == 32
    embedding = model.encode(texts=["a handwritten digit seven"])
    assert embedding.shape == (1, 32) and torch.isfinite(embedding).all()
    as_query = model.encode(texts=["a handwritten digit seven"], role="query")  # the recipe's query instruction
    assert not torch.allclose(as_query, embedding, atol=1e-3)


@pytest.mark.parametrize("name", ["qwen3_vl_embedding_2b.yaml", "qwen3_vl_embedding_8b_fsdp.yaml"])
def test_released_model_recipes_parse_and_pass_the_checks_on_a_local_checkpoint(name, digits, tmp_path):
    """The recipes name hub checkpoints; offline, a tiny Qwen3-VL saved locally stands in for them (same adapter
    path: config, tokenizer and PIL image processor read from a folder)."""
    from vembed.models import MODELS

    recipe = load_recipe(CONFIGS / name)
    assert recipe.model_type == "qwen_vl" and recipe.loss.mask_false_negatives
    assert recipe.model.query_instruction == "Retrieve images or text relevant to the user's query."
    assert recipe.model.prompt_ending == "generation_prompt"  # what the released embedder feeds (and serves)
    if "2b" in name:
        assert (recipe.batch_size, recipe.use_gradient_cache, recipe.gradient_cache_chunk_size) == (64, True, 8)
        assert recipe.loss.mrl_dims[0] == 2048
    else:
        # The released Qwen3-VL-Embedding LoRA table: rank 32, alpha 32, q/k/v and the MLP projections, no o_proj.
        assert (recipe.batch_size, recipe.use_fsdp, recipe.use_lora) == (16, True, True)
        assert (recipe.lora_r, recipe.lora_alpha) == (32, 32)
        assert sorted(recipe.lora_target_modules) == ["down_proj", "gate_proj", "k_proj", "q_proj", "up_proj", "v_proj"]
        assert recipe.gradient_checkpointing and recipe.loss.mrl_dims[0] == 4096

    tiny = load_recipe(CONFIGS / "qwen3_vl_tiny.yaml", _tiny_overrides(digits, tmp_path / "unused"))
    torch.manual_seed(0)
    local = tmp_path / "checkpoint"
    MODELS.get("qwen_vl").from_recipe(tiny).save(local)
    recipe = load_recipe(CONFIGS / name, [
        f"model_name={local}", f"data.train={digits / 'train.jsonl'}", f"data.validation={digits / 'validation.jsonl'}",
        "data.image_root=null",
        "mrl_dims=[32, 16]",  # the stand-in is 32-d
    ])
    check_recipe(recipe)
    adapter = MODELS.get("qwen_vl").from_recipe(recipe)
    assert adapter.image_processor.size == {"shortest_edge": 4096, "longest_edge": 1843200}
    if recipe.use_lora:
        adapter.apply_lora(recipe)
        assert any("lora_" in n for n, p in adapter.named_parameters() if p.requires_grad)


@pytest.mark.parametrize("name", ["colqwen3_vl.yaml", "colqwen3_vl_8b_fsdp.yaml"])
def test_colqwen_recipes_parse_and_pass_the_checks_on_a_local_checkpoint(name, digits, tmp_path):
    """The ColQwen recipes (late interaction on page screenshots) with a tiny Qwen3-VL standing in for the hub
    checkpoint: colpali-engine's shape (LoRA r32/alpha32/dropout 0.1, 128-d token vectors), the projection trained
    fully beside the LoRA'd language model. (`vembed plan` on the real shapes: tests/test_planning.py.)"""
    from vembed.models import MODELS

    recipe = load_recipe(CONFIGS / name)
    assert (recipe.model.embedding, recipe.model.multi_vector_dim, recipe.loss_type) == (
        "multi_vector", 128, "late_interaction")
    assert (recipe.use_lora, recipe.lora_r, recipe.lora_alpha, recipe.lora_dropout) == (True, 32, 32, 0.1)
    assert recipe.gradient_checkpointing and recipe.mixed_precision == "bf16" and recipe.learning_rate == 5e-5
    assert recipe.use_fsdp == ("fsdp" in name)
    tiny = load_recipe(CONFIGS / "qwen3_vl_tiny.yaml", _tiny_overrides(digits, tmp_path / "unused"))
    torch.manual_seed(0)
    local = tmp_path / "checkpoint"
    MODELS.get("qwen_vl").from_recipe(tiny).save(local)
    recipe = load_recipe(CONFIGS / name, [f"model_name={local}", f"data.train={digits / 'train.jsonl'}",
                                          "data.image_root=null"])
    check_recipe(recipe)
    adapter = MODELS.get("qwen_vl").from_recipe(recipe)
    adapter.apply_lora(recipe)
    assert adapter.embedding_dim == 128 and adapter.projection.weight.requires_grad
    assert any("lora_" in n for n, p in adapter.named_parameters() if p.requires_grad)


GLOBAL_BATCH = 8  # 4 per rank


def _gradients(raw: dict, rows: list[int]) -> dict[str, torch.Tensor]:
    """One forward/backward of the loop's prepared objective (DDP-wrapped on 2 ranks) on `rows` of the data."""
    from accelerate.utils import send_to_device

    from vembed.components import recipe_from_dict
    from vembed.training.loop import Trainer

    trainer = Trainer(recipe_from_dict(raw))
    trainer.build()
    batch = send_to_device(trainer.loader.collate_fn([trainer.dataset[i] for i in rows]), trainer.accelerator.device)
    trainer.accelerator.backward(trainer.model(batch))
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    return {n: p.grad.detach().clone() for n, p in unwrapped.named_parameters() if p.grad is not None}


def _ddp_worker(raw_path: str, out_dir: str) -> None:
    import torch.distributed as dist

    rank, half = dist.get_rank(), GLOBAL_BATCH // 2
    grads = _gradients(json.loads(Path(raw_path).read_text()), list(range(rank * half, (rank + 1) * half)))
    if rank == 0:
        torch.save(grads, Path(out_dir, "ddp.pt"))


@pytest.mark.slow  # launches 2 processes
def test_ddp_gradients_match_single_process_full_batch(digits, tmp_path):
    """Two gloo ranks through the real loop components (collator, DDP, InfoNCE with false-negative masking and the
    qq/dd terms, gathered across ranks) give the gradients of one process on the concatenated batch."""
    from ranks import run_on_ranks

    recipe = load_recipe(CONFIGS / "qwen3_vl_tiny.yaml", _tiny_overrides(digits, tmp_path / "run"))
    raw = dict(recipe.to_dict(), batch_size=GLOBAL_BATCH // 2, query_query_loss=True, document_document_loss=True)
    raw_path = tmp_path / "raw.json"
    raw_path.write_text(json.dumps(raw))
    run_on_ranks(_ddp_worker, str(raw_path), str(tmp_path), world=2)
    ddp = torch.load(tmp_path / "ddp.pt", weights_only=True)
    single = _gradients(dict(raw, batch_size=GLOBAL_BATCH), list(range(GLOBAL_BATCH)))
    assert ddp.keys() == single.keys() and any(".visual." in name for name in single)
    reference = torch.cat([g.flatten() for g in single.values()])
    actual = torch.cat([ddp[name].flatten() for name in single])
    relative = ((actual - reference).norm() / reference.norm()).item()
    print(f"qwen_vl DDP relative gradient difference: {relative:.2e}")
    assert relative <= 1e-5


def test_grad_cache_with_mixed_image_sizes_equals_the_full_batch(digits, tmp_path):
    """The loop's GradCache step on Qwen3-VL, images of several sizes (so chunks hold different numbers of patch rows,
    split by `image_grid_thw`), chunks of 3 out of 8: gradients equal one plain step on the whole batch (fp32)."""
    from accelerate.utils import send_to_device
    from PIL import Image

    from vembed.training.loop import Trainer

    rows = []
    for i, (w, h) in enumerate([(32, 32), (64, 32), (32, 48), (48, 48), (64, 64), (32, 32), (48, 32), (64, 48)]):
        path = tmp_path / f"{i}.png"
        Image.fromarray(torch.randint(0, 255, (h, w, 3), generator=torch.Generator().manual_seed(i),
                                      dtype=torch.uint8).numpy()).save(path)
        rows.append({"query": f"a handwritten digit {i}", "positive_image": str(path)})
    data = tmp_path / "mixed.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    overrides = _tiny_overrides(digits, tmp_path / "run") + [
        f"data.train={data}", "data.validation=null", "min_pixels=256", "max_pixels=4096", "batch_size=8",
        "learnable_temperature=true"]

    grads = {}
    for name, extra in (("cached", ["use_gradient_cache=true", "gradient_cache_chunk_size=3"]), ("plain", [])):
        trainer = Trainer(load_recipe(CONFIGS / "qwen3_vl_tiny.yaml", overrides + extra))
        trainer.build()
        batch = send_to_device(trainer.loader.collate_fn([trainer.dataset[i] for i in range(8)]), "cpu")
        if name == "cached":
            assert trainer.plan.grad_cache.enabled
            assert len(set(batch["positive"]["image_grid_thw"].prod(-1).tolist())) > 1
        trainer.train_step(batch)
        model = trainer.accelerator.unwrap_model(trainer.model)
        grads[name] = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads["cached"].keys() == grads["plain"].keys() and any(".visual." in n for n in grads["plain"])
    reference = torch.cat([g.flatten() for g in grads["plain"].values()])
    actual = torch.cat([grads["cached"][n].flatten() for n in grads["plain"]])
    relative = ((actual - reference).norm() / reference.norm()).item()
    print(f"qwen_vl GradCache relative gradient difference: {relative:.2e}")
    assert relative <= 1e-5
