"""`vembed plan` for a cross-encoder: exact parameter counts from the meta device, activations of B lists x (1 + K)
pairs read jointly (or of one `pairs_per_chunk` chunk), no contrastive loss matrix, no GradCache strategies, and
use_gradient_cache answered with why rerankers need none."""

from __future__ import annotations

import pytest
from rerank_lists import TINY_BERT

from vembed.components import recipe_from_dict


def _recipe(tokenizer, **changes):
    raw = {"model_type": "cross_encoder", "loss_type": "rerank_bce", "model_config": TINY_BERT,
           "tokenizer_name": tokenizer, "max_length": 24, "data": {"train": "unused", "num_hard_negatives": 3},
           "batch_size": 4, "mixed_precision": "no"}
    return recipe_from_dict({**raw, **changes})


def test_a_cross_encoder_plans_as_lists_of_pairs_through_one_encoder(tiny_tokenizer_dir):
    from transformers import AutoModelForSequenceClassification, BertConfig

    from vembed.planning import KERNELS, EncoderShape, make_plan, measure_model

    recipe = _recipe(tiny_tokenizer_dir)
    model = measure_model(recipe)
    real = AutoModelForSequenceClassification.from_config(BertConfig(**{**TINY_BERT, "num_labels": 1}))
    assert model.total == model.trainable == sum(p.numel() for p in real.parameters())
    assert model.routes == {"pair": {"text": 24}} and not model.contrastive and not model.gradient_cache
    assert 0 < model.trainable_lora < model.trainable  # attention LoRA + the score head in full

    plan = make_plan(recipe, gpus=2, gpu_memory_gib=80)
    assert plan.work.roles == {"pair": 4}  # the positive and 3 mined negatives
    assert not any(e.strategy.gradient_cache for e in plan.estimates)
    single = next(e for e in plan.estimates if e.strategy.name == "single")
    shape = EncoderShape.from_config(real.config, "text", max_length=24)
    pairs = 4 * 4  # batch_size lists x 4 pairs, nothing else (no embeddings, no batch x batch logits)
    assert single.activations == shape.activation_bytes(pairs, 4, KERNELS["cuda"], eager=False, checkpointing=False)
    assert plan.recommendation == "DDP"

    chunked = make_plan(_recipe(tiny_tokenizer_dir, pairs_per_chunk=5), gpus=2, gpu_memory_gib=80)
    single = next(e for e in chunked.estimates if e.strategy.name == "single")
    assert single.activations == shape.activation_bytes(5, 4, KERNELS["cuda"], eager=False, checkpointing=False)


def test_the_plan_says_why_a_reranker_needs_no_gradient_cache(tiny_tokenizer_dir, capsys):
    from vembed.planning import make_plan
    from vembed.reranking.task import NO_GRADIENT_CACHE

    plan = make_plan(_recipe(tiny_tokenizer_dir, use_gradient_cache=True), gpus=1, gpu_memory_gib=80)
    assert plan.recommendation.endswith("use_gradient_cache: false") and NO_GRADIENT_CACHE in plan.reason


def test_the_shipped_minilm_reranker_plans_at_its_published_size(tiny_tokenizer_dir):
    """configs/reranker_minilm.yaml with the architecture of cross-encoder/ms-marco-MiniLM-L6-v2 (bench/configs/):
    22.7M parameters, 32 lists x 8 pairs of 256 tokens in chunks of 64 pairs."""
    from pathlib import Path

    from vembed.components import load_recipe
    from vembed.planning import format_plan, make_plan

    repo = Path(__file__).resolve().parents[2]
    config = (repo / "bench" / "configs" / "cross_encoder_ms_marco_minilm_l6_v2.json").read_text()
    recipe = load_recipe(repo / "configs" / "reranker_minilm.yaml",
                         ["model_name=null", f"model_config={config}", f"tokenizer_name={tiny_tokenizer_dir}"])
    plan = make_plan(recipe, gpus=1, gpu_memory_gib=24)
    assert plan.model.total == 22_713_601  # MiniLM-L6-H384 (22,713,216) + the 385-weight score head
    assert plan.work.roles == {"pair": 8} and plan.model.chunk_samples == 64
    assert plan.recommendation == "single device"
    print(format_plan(plan))


def _qwen_reranker(tmp_path, size: str, *overrides: str):
    """configs/qwen3_vl_reranker.yaml with the released architecture of `size` (bench/configs/), offline."""
    from pathlib import Path

    from vembed.components import load_recipe

    repo = Path(__file__).resolve().parents[2]
    config = (repo / "bench" / "configs" / f"qwen3_vl_{size}.json").read_text()
    return load_recipe(repo / "configs" / "qwen3_vl_reranker.yaml",
                       ["model_name=null", f"model_config={config}", "tokenizer_name=never-read", *overrides])


def test_the_shipped_qwen_vl_reranker_plans_at_2b_and_8b_with_fsdp_lora(tmp_path):
    """The Qwen-VL reranker on the meta device: Qwen3-VL-2B's parameters (the LM head tied to the embeddings adds
    none), LoRA on the language model only, one `pair` route through the language model and the vision tower; the 8B
    (untied head) plans FSDP2 with LoRA where a GPU cannot hold its replica."""
    from vembed.planning import format_plan, make_plan

    recipe = _qwen_reranker(tmp_path, "2b")
    assert recipe.model_type == "qwen_vl_reranker" and recipe.use_lora and recipe.gradient_checkpointing
    assert (recipe.lora_r, recipe.lora_alpha, recipe.mixed_precision) == (32, 32, "bf16")
    plan = make_plan(recipe, gpus=1, gpu_memory_gib=80)
    assert 2.0e9 < plan.model.total < 2.3e9 and 0 < plan.model.trainable_lora < 0.02 * plan.model.total
    assert plan.model.routes == {"pair": {"text": 2048, "image": 602112 // 16**2}}  # max_length; patches at the cap
    assert plan.work.roles == {"pair": 8} and plan.model.chunk_samples == 16  # lists of 1 + 7 documents
    assert not any(e.strategy.gradient_cache for e in plan.estimates)
    assert plan.recommendation == "single device"
    print(format_plan(plan))

    big = make_plan(_qwen_reranker(tmp_path, "8b", "use_fsdp=true"), gpus=8, gpu_memory_gib=48)
    assert 8.5e9 < big.model.total < 9.0e9  # 8B: its own LM head (untied), 151936 x 4096 more
    fsdp = next(e for e in big.estimates if e.strategy.name == "fsdp+lora")
    ddp = next(e for e in big.estimates if e.strategy.name == "ddp")
    assert fsdp.total(True) < 48 * 2**30 < ddp.total(True)  # 8B fp32 master weights: no replica fits
    assert big.recommendation == "FSDP + LoRA"
    print(format_plan(big))
