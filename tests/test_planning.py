"""The memory planner: exact parameter counts, per-strategy arithmetic, the activation formula against the tensors a
real layer keeps, the decision tree, and the `vembed plan` command."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
import yaml

from vembed.components import recipe_from_dict
from vembed.planning import (
    GATHERED_LAYERS,
    GIB,
    KERNELS,
    STRATEGY_BY_NAME,
    EncoderShape,
    estimate,
    format_plan,
    make_plan,
    measure_model,
    usable_bytes,
    workload_for,
)

# A tiny BERT whose parameter count is easy to write out by hand.
V, P, H, M, L = 100, 16, 8, 12, 2  # vocab, positions, hidden, intermediate (MLP), layers
BERT = {"model_type": "bert", "vocab_size": V, "max_position_embeddings": P, "hidden_size": H,
        "intermediate_size": M, "num_hidden_layers": L, "num_attention_heads": 2, "type_vocab_size": 2}
EMBEDDINGS = V * H + P * H + 2 * H + 2 * H  # word, position, token type, LayerNorm
LAYER = 4 * (H * H + H) + 2 * H + (H * M + M) + (M * H + H) + 2 * H  # q,k,v,o; LN; MLP up, down; LN
POOLER = H * H + H  # frozen by the text adapter: we pool ourselves
R = 4
LORA = L * 2 * R * (H + H)  # query and value, A (r×in) + B (out×r)


def _recipe(tokenizer: str = "unused", **keys):
    raw = {"model_type": "text", "model_config": BERT, "tokenizer_name": tokenizer, "max_length": 16,
           "batch_size": 4, "mixed_precision": "no", "lora_r": R, "lora_target_modules": ["query", "value"]}
    return recipe_from_dict({**raw, **keys})


def test_parameter_counts_are_exact_by_hand_and_lora_matches_peft_on_the_real_model(tiny_tokenizer_dir):
    from vembed.models import MODELS

    recipe = _recipe(tiny_tokenizer_dir)
    size = measure_model(recipe)
    assert size.total == EMBEDDINGS + L * LAYER + POOLER
    assert size.trainable == EMBEDDINGS + L * LAYER
    assert size.trainable_lora == LORA

    real = MODELS.get("text").from_recipe(recipe)  # real weights on CPU, LoRA injected by peft as in training
    assert sum(p.numel() for p in real.parameters()) == size.total
    real.apply_lora(recipe)
    assert sum(p.numel() for p in real.parameters() if p.requires_grad) == size.trainable_lora


def test_model_state_bytes_per_strategy_by_hand():
    recipe = _recipe()
    size = measure_model(recipe)
    psi, trainable, n = size.total, size.trainable, 4
    work = workload_for(recipe, size, gpus=n)
    gathered = GATHERED_LAYERS * (4 * H * H + 2 * H * M) * 4  # fp32: mixed_precision no

    single = estimate(STRATEGY_BY_NAME["single"], size, work, lora=False)
    assert (single.parameters, single.gradients, single.optimizer) == (4 * psi, 4 * trainable, 8 * trainable)
    ddp = estimate(STRATEGY_BY_NAME["ddp"], size, work, lora=False)
    assert ddp.gradients == 8 * trainable  # gradients and DDP's bucket copy
    fsdp = estimate(STRATEGY_BY_NAME["fsdp"], size, work, lora=False)
    assert fsdp.parameters == pytest.approx(4 * psi / n + gathered)
    assert (fsdp.gradients, fsdp.optimizer) == pytest.approx((4 * trainable / n, 8 * trainable / n))
    fsdp_lora = estimate(STRATEGY_BY_NAME["fsdp+lora"], size, work, lora=False)
    assert (fsdp_lora.gradients, fsdp_lora.optimizer) == pytest.approx((4 * LORA / n, 8 * LORA / n))
    zero3 = estimate(STRATEGY_BY_NAME["zero3"], size, work, lora=False)
    assert zero3.parameters == pytest.approx(4 * psi / n + gathered)
    offload = estimate(STRATEGY_BY_NAME["fsdp+lora+offload"], size, work, lora=False)
    assert (offload.parameters, offload.gradients, offload.optimizer) == (gathered, 0, 0)
    # Activations do not depend on how model state is laid out.
    assert single.activations == fsdp.activations == zero3.activations


def test_deepspeed_under_bf16_keeps_a_16_bit_module_and_an_fp32_master_in_the_optimizer():
    recipe = _recipe(mixed_precision="bf16")
    size = measure_model(recipe)
    n = 8
    work = workload_for(recipe, size, gpus=n)
    gathered = GATHERED_LAYERS * (4 * H * H + 2 * H * M) * 2
    zero2 = estimate(STRATEGY_BY_NAME["zero2"], size, work, lora=False)
    zero3 = estimate(STRATEGY_BY_NAME["zero3"], size, work, lora=False)
    assert zero2.parameters == 2 * size.total
    assert zero3.parameters == pytest.approx(2 * size.total / n + gathered)
    assert zero3.optimizer == pytest.approx(12 * size.trainable / n)  # two moments + master, all fp32
    single = estimate(STRATEGY_BY_NAME["single"], size, work, lora=False)
    assert size.trainable < size.total  # the case that tells trainable from all weights
    assert single.parameters == 4 * size.total + 2 * size.trainable  # fp32 weights + autocast's cached bf16 copies


def test_autocast_caches_a_16_bit_copy_of_trainable_weights_only():
    """torch's autocast caches a 16-bit copy only of leaves that require grad (aten/src/ATen/autocast_mode.cpp,
    `can_try_cache`), for the whole forward; frozen weights (LoRA's base) are cast per use. Counting every weight
    over-planned Qwen3-VL-2B + LoRA by 4 GiB on an H200 (docs/benchmarks.md)."""
    recipe = _recipe(mixed_precision="bf16", use_lora=True)
    size = measure_model(recipe, with_lora=True)
    work = workload_for(recipe, size, gpus=1)
    single = estimate(STRATEGY_BY_NAME["single"], size, work, lora=True)
    assert single.parameters == 4 * size.total + 2 * size.trainable_lora
    assert size.trainable_lora < size.trainable


def test_activation_formula_by_hand():
    shape = EncoderShape(layers=2, hidden=4, intermediate=8, heads=2, tokens=3)  # no mask, no dropout
    e, samples = 4, 2
    per_layer = samples * 3 * (8 * e * 4 + 2 * e * 8)  # s·(8e·h + 2e·i) per sample
    ends = 2 * e * samples * 3 * 4
    cuda = KERNELS["cuda"]
    assert shape.activation_bytes(samples, e, cuda, eager=False, checkpointing=False) == ends + 2 * per_layer
    kept_inputs = 2 * e * samples * 3 * 4
    assert shape.activation_bytes(samples, e, cuda, eager=False, checkpointing=True) == ends + kept_inputs + per_layer
    # Eager attention adds the probabilities of every head: a·s²·e per sample and layer.
    eager = shape.activation_bytes(samples, e, cuda, eager=True, checkpointing=False)
    assert eager - (ends + 2 * per_layer) == 2 * samples * 2 * 3 * 3 * e


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("padded", [False, True])
def test_cpu_activation_formula_matches_the_tensors_a_real_bert_keeps(dropout, padded):
    """Independent reference: the bytes autograd saves for backward (saved-tensor hooks, storages counted once)."""
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.for_model("bert", hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                  intermediate_size=256, vocab_size=200, hidden_dropout_prob=dropout,
                                  attention_probs_dropout_prob=dropout)
    torch.manual_seed(0)
    model = AutoModel.from_config(config).train()
    samples, tokens = 4, 48
    storages: dict[int, int] = {}

    def keep(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    ids = torch.randint(0, 200, (samples, tokens))
    mask = torch.ones_like(ids)
    if padded:
        mask[0, -5:] = 0
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        model(input_ids=ids, attention_mask=mask)
    saved = sum(storages.values()) - sum(p.numel() * 4 for p in model.parameters())  # weights are saved too
    # transformers drops an all-ones mask, so only a padded batch hands SDPA a mask (which it then keeps).
    shape = dataclasses.replace(EncoderShape.from_config(config, "text", max_length=tokens), masked=padded)
    estimated = shape.activation_bytes(samples, 4, KERNELS["cpu"], eager=False, checkpointing=False)
    assert estimated == pytest.approx(saved, rel=0.1)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_autocast_activation_formula_matches_the_tensors_a_real_bert_keeps_in_bf16(dropout):
    """Under bf16 autocast (CPU's here: the same casts as CUDA's) LayerNorm inputs stay fp32 and Linear inputs are
    saved as 16-bit copies; the bytes autograd saves, less the weights' 16-bit copies (counted with the parameters:
    autocast's cache), are the planner's at e = 2."""
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.for_model("bert", hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                  intermediate_size=256, vocab_size=200, hidden_dropout_prob=dropout,
                                  attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = AutoModel.from_config(config, attn_implementation="sdpa").train()
    samples, tokens = 4, 48
    storages: dict[int, int] = {}
    weight_shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}

    def keep(tensor):
        if tuple(tensor.shape) not in weight_shapes or tensor.dtype == torch.float32:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=torch.randint(0, 200, (samples, tokens)))
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = sum(size for pointer, size in storages.items() if pointer not in parameters)
    shape = EncoderShape.from_config(config, "text", max_length=tokens)
    kernels = dataclasses.replace(KERNELS["cuda"], dropout_mask_bytes=2)  # CPU keeps masks at activation width
    estimated = shape.activation_bytes(samples, 2, kernels, eager=False, checkpointing=False)
    assert estimated == pytest.approx(saved, rel=0.1)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_packed_activations_are_those_of_the_real_tokens_without_any_attention_matrix(dropout):
    """A packed forward (vembed/models/packing.py) of texts of uneven length keeps what the planner's packed kernels
    count at the texts' mean real length: no padding mask copy, no attention-dropout matrices (saved-tensor hooks as
    above), where the padded count at the batch's width is far larger."""
    from transformers import AutoConfig, AutoModel

    from vembed.models.packing import packed_forward, use_packed_attention
    from vembed.planning import PACKED_KERNELS

    config = AutoConfig.for_model("bert", hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                  intermediate_size=256, vocab_size=200, hidden_dropout_prob=dropout,
                                  attention_probs_dropout_prob=dropout)
    torch.manual_seed(0)
    model = AutoModel.from_config(config).train()
    use_packed_attention(model)
    lengths = torch.tensor([48, 5, 20, 9, 33, 12])
    mask = (torch.arange(48)[None] < lengths[:, None]).long()
    storages: dict[int, int] = {}

    def keep(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        packed_forward(model, {"input_ids": torch.randint(0, 200, mask.shape), "attention_mask": mask},
                       lambda output: output.last_hidden_state, {"token_type_ids"})
    saved = sum(storages.values()) - sum(p.numel() * 4 for p in model.parameters())
    mean = int(lengths.float().mean())
    shape = EncoderShape.from_config(config, "text", max_length=mean)
    estimated = shape.activation_bytes(len(lengths), 4, PACKED_KERNELS["cpu"], eager=False, checkpointing=False)
    assert estimated == pytest.approx(saved, rel=0.1)
    padded = dataclasses.replace(EncoderShape.from_config(config, "text", max_length=48), masked=True)
    assert padded.activation_bytes(len(lengths), 4, KERNELS["cpu"], eager=False, checkpointing=False) > 2 * saved


def test_the_data_lengths_replace_max_length_in_the_estimate():
    from vembed.planning import estimate_line

    worst = float(estimate_line(_recipe(), "ddp", 1, device="cpu").split()[2])
    short = float(estimate_line(_recipe(), "ddp", 1, device="cpu", tokens_per_role={"query": 4, "document": 4})
                  .split()[2])
    assert short < worst


def _memory_for(total_bytes: float) -> float:
    """The --gpu-memory (GiB) whose usable part is exactly `total_bytes`."""
    gib = (total_bytes / GIB + 0.5) / 0.9
    assert usable_bytes(gib) == pytest.approx(total_bytes)
    return gib


# A model whose state dwarfs its activations at batch 1 (big vocabulary) but whose activations dominate at batch 64.
BIG_VOCAB = {**BERT, "vocab_size": 20000}


def test_fits_on_one_device_recommends_ddp_or_single():
    recipe = _recipe(batch_size=8)
    assert make_plan(recipe, gpus=2, gpu_memory_gib=80).recommendation == "DDP"
    assert make_plan(recipe, gpus=1, gpu_memory_gib=80).recommendation == "single device"


def test_model_fits_but_batch_does_not_recommends_gradcache_with_the_largest_chunk_that_fits():
    recipe = _recipe(batch_size=64, max_length=16)
    first = make_plan(recipe, gpus=2, gpu_memory_gib=80)
    ddp = next(e for e in first.estimates if e.strategy.name == "ddp")
    memory = _memory_for(ddp.total(False) * 0.6)  # the full batch no longer fits, ...
    plan = make_plan(recipe, gpus=2, gpu_memory_gib=memory)
    assert plan.recommendation.startswith("DDP + GradCache (use_gradient_cache: true, gradient_cache_chunk_size: ")
    chunk = int(plan.recommendation.split("gradient_cache_chunk_size: ")[1].rstrip(")"))
    gradcache, work = STRATEGY_BY_NAME["ddp+gradcache"], plan.work
    assert estimate(gradcache, plan.model, work, False, chunk).total(False) <= plan.usable  # ... this chunk fits
    assert estimate(gradcache, plan.model, work, False, 2 * chunk).total(False) > plan.usable  # ... twice it not


def test_checkpointing_is_proposed_when_it_is_what_makes_ddp_fit():
    recipe = _recipe(batch_size=64)
    ddp = next(e for e in make_plan(recipe, gpus=2, gpu_memory_gib=80).estimates if e.strategy.name == "ddp")
    plan = make_plan(recipe, gpus=2, gpu_memory_gib=_memory_for((ddp.total(True) + ddp.total(False)) / 2))
    assert plan.recommendation == "DDP with gradient_checkpointing: true"


def test_model_that_does_not_fit_recommends_fsdp_with_lora():
    recipe = _recipe(model_config=BIG_VOCAB, batch_size=1, max_length=4)
    probe = make_plan(recipe, gpus=8, gpu_memory_gib=80)
    by_name = {e.strategy.name: e for e in probe.estimates}
    # Between FSDP + LoRA and the model state under DDP, even at a chunk of one example.
    smallest_ddp = estimate(STRATEGY_BY_NAME["ddp+gradcache"], probe.model, probe.work, False, 1).total(True)
    fsdp_lora = by_name["fsdp+lora"].total(True)
    assert fsdp_lora < smallest_ddp
    plan = make_plan(recipe, gpus=8, gpu_memory_gib=_memory_for((fsdp_lora + smallest_ddp) / 2))
    assert plan.recommendation.startswith("FSDP + LoRA")
    assert "does not fit on one device" in plan.reason


def test_recommendation_says_gradcache_where_the_run_turns_it_on_by_itself():
    """One rule decides GradCache (planning.choose_gradient_cache): a >1B model with checkpointing fits under DDP,
    and the run then switches GradCache on automatically, so the plan must say so rather than plain DDP."""
    big = {**BERT, "vocab_size": 30522, "max_position_embeddings": 64, "hidden_size": 2048,
           "intermediate_size": 8192, "num_hidden_layers": 24, "num_attention_heads": 16}
    recipe = _recipe(model_config=big, batch_size=4, max_length=8, gradient_checkpointing=True)
    plan = make_plan(recipe, gpus=8, gpu_memory_gib=80)
    assert plan.model.total > 1_000_000_000
    assert plan.recommendation == "DDP + GradCache (gradient_cache_chunk_size: 4)"
    assert "automatic" in plan.reason
    # turned off in the recipe, the run does plain DDP and so does the plan
    off = make_plan(_recipe(model_config=big, batch_size=4, max_length=8, gradient_checkpointing=True,
                            use_gradient_cache=False), gpus=8, gpu_memory_gib=80)
    assert off.recommendation == "DDP"


def test_sharded_recommendation_for_a_gradcache_recipe_says_to_turn_it_off():
    """FSDP/ZeRO refuse use_gradient_cache: true at launch; recommending them must say what to change."""
    recipe = _recipe(model_config=BIG_VOCAB, batch_size=1, max_length=4)
    probe = make_plan(recipe, gpus=8, gpu_memory_gib=80)
    by_name = {e.strategy.name: e for e in probe.estimates}
    smallest_ddp = estimate(STRATEGY_BY_NAME["ddp+gradcache"], probe.model, probe.work, False, 1).total(True)
    memory = _memory_for((by_name["fsdp+lora"].total(True) + smallest_ddp) / 2)
    plan = make_plan(_recipe(model_config=BIG_VOCAB, batch_size=1, max_length=4, use_gradient_cache=True),
                     gpus=8, gpu_memory_gib=memory)
    assert plan.recommendation.startswith("FSDP + LoRA")
    assert plan.recommendation.endswith("and use_gradient_cache: false")
    assert "not available under FSDP" in plan.reason


def test_nothing_fits_says_so():
    recipe = _recipe(batch_size=64)
    probe = make_plan(recipe, gpus=1, gpu_memory_gib=80)
    one_chunk = estimate(STRATEGY_BY_NAME["ddp+gradcache"], probe.model, probe.work, False, 1)
    smallest = min(e.total(True) for e in [*probe.estimates, one_chunk])
    plan = make_plan(recipe, gpus=1, gpu_memory_gib=_memory_for(smallest / 2))
    assert plan.recommendation == "none fits" and "lower batch_size" in plan.reason


# --- the command ----------------------------------------------------------------------------------------------------
def test_plan_command_prints_the_table_and_a_recommendation(tmp_path, capsys):
    from vembed.cli import main

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"model_type": "text", "model_config": BERT, "tokenizer_name": "unused"}))
    code = main(["plan", str(path), "--gpus", "2", "--gpu-memory", "80", "--config_override", "batch_size=16"])
    out = capsys.readouterr().out
    assert code == 0
    assert "16 per device × 2 = 32 contrastive" in out
    for name in STRATEGY_BY_NAME:
        assert f"\n{name}" in out
    assert "recommendation: DDP — " in out


def test_plan_command_bad_recipe_is_one_line_and_exit_2(tmp_path, capsys):
    from vembed.cli import main

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"model_type": "text", "model_config": BERT, "batch_sise": 8}))
    code = main(["plan", str(path), "--gpu-memory", "80"])
    captured = capsys.readouterr()
    assert code == 2
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and "batch_sise" in lines[0] and "did you mean batch_size" in lines[0]
    assert captured.out == ""


def test_estimate_line_for_the_start_block_sums_its_parts():
    from vembed.planning import estimate_line

    recipe = _recipe(batch_size=4)
    model = measure_model(recipe)
    expected = estimate(STRATEGY_BY_NAME["ddp"], model, workload_for(recipe, model, 2), lora=False).total(False)
    line = estimate_line(recipe, "ddp", 2)
    unit, scale = ("GiB", GIB) if expected >= GIB else ("MiB", 2**20)
    assert line.startswith(f"memory estimate     {expected / scale:.1f} {unit} per device (params ")
    with pytest.raises(ValueError, match="unknown strategy"):
        estimate_line(recipe, "ddp3", 2)


def test_total_is_state_plus_buffers_plus_the_larger_of_activations_and_gradients():
    from vembed.planning import Estimate

    ddp = STRATEGY_BY_NAME["ddp"]
    # gradients 8 of which 4 are DDP buckets: the transient part is 4.
    estimate_ = Estimate(ddp, parameters=10, gradients=8, optimizer=16, activations=30, activations_checkpointed=3,
                         gradient_buffers=4)
    assert estimate_.total(False) == 10 + 16 + 4 + 30
    assert estimate_.total(True) == 10 + 16 + 4 + 4  # gradients outweigh checkpointed activations


# --- Qwen-VL: every side is one language-model sequence, images also pass through the vision tower -----------------
QWEN_TINY = Path(__file__).resolve().parents[1] / "configs" / "qwen3_vl_tiny.yaml"


@pytest.fixture(scope="module")
def qwen_tokenizer(tmp_path_factory):
    from vembed.data.tokenizer import train_qwen_tokenizer

    path = tmp_path_factory.mktemp("qwen_tokenizer")
    train_qwen_tokenizer(["a handwritten digit seven", "the digit three", "number one"] * 8, path)
    return str(path)


def _qwen_recipe(tokenizer: str, *overrides: str):
    from vembed.components import load_recipe

    return load_recipe(QWEN_TINY, [f"tokenizer_name={tokenizer}", *overrides])


def test_qwen_plan_command_prints_the_table(qwen_tokenizer, capsys):
    from vembed.cli import main

    code = main(["plan", str(QWEN_TINY), "--gpus", "2", "--gpu-memory", "24",
                 "--config_override", f"tokenizer_name={qwen_tokenizer}"])
    out = capsys.readouterr().out
    assert code == 0
    assert "16 per device × 2 = 32 contrastive" in out and "1 document → text " in out
    for name in STRATEGY_BY_NAME:
        assert f"\n{name}" in out
    assert "recommendation: DDP — " in out


def test_qwen_counts_equal_the_real_model_and_peft(qwen_tokenizer):
    """Parameter counts from the meta model equal the real (random-init) model's; the LoRA count equals what peft
    leaves trainable on the real model, and LoRA's r·(in + out) per projection by hand (vision tower frozen)."""
    from vembed.models import MODELS

    recipe = _qwen_recipe(qwen_tokenizer, "train_vision_tower=false", "lora_r=4")
    size = measure_model(recipe)
    real = MODELS.get("qwen_vl").from_recipe(recipe)
    assert size.total == sum(p.numel() for p in real.parameters())
    assert size.trainable == sum(p.numel() for p in real.parameters() if p.requires_grad)
    assert size.trainable < size.total  # the vision tower is frozen
    real.apply_lora(recipe)
    assert size.trainable_lora == sum(p.numel() for p in real.parameters() if p.requires_grad)
    text = real.model.config.text_config
    q = text.num_attention_heads * text.head_dim
    kv = text.num_key_value_heads * text.head_dim
    h, i = text.hidden_size, text.intermediate_size
    per_layer = (h + q) + 2 * (h + kv) + 2 * (h + i) + (i + h)  # q, k, v, gate, up, down (the released LoRA's)
    assert size.trainable_lora == 4 * per_layer * text.num_hidden_layers

    # With the vision tower trained, it stays fully trainable beside LoRA.
    vision = _qwen_recipe(qwen_tokenizer, "train_vision_tower=true", "lora_r=4")
    visual = sum(p.numel() for p in real.model.visual.parameters())
    assert measure_model(vision).trainable_lora == size.trainable_lora + visual


def test_qwen_planned_tokens_are_what_preprocessing_makes_of_an_image_at_the_pixel_cap(qwen_tokenizer):
    """Independent reference: the adapter's own image processor and token expansion on an image of max_pixels."""
    from PIL import Image

    from vembed.data.records import Side
    from vembed.models import MODELS

    recipe = _qwen_recipe(qwen_tokenizer)
    size = measure_model(recipe)
    real = MODELS.get("qwen_vl").from_recipe(recipe)
    side = int(recipe.model.max_pixels**0.5)
    batch = real.preprocess([Side(image=Image.new("RGB", (side, side)), role="document")])
    image_tokens = int((batch["input_ids"] == real.model.config.image_token_id).sum())
    assert size.routes["document"]["image"] == batch["pixel_values"].shape[0]  # patches the vision tower sees
    assert size.routes["document"]["text"] - size.routes["query"]["text"] == image_tokens  # merged, in the sequence
    # Both sides pass through the language model, only the document through the vision tower.
    work = workload_for(recipe, size, gpus=1)
    assert work.sides == {"text": 2, "image": 1} and work.roles == {"query": 1, "document": 1}

    bounded = measure_model(_qwen_recipe(qwen_tokenizer, "max_length=64"))  # max_length bounds the whole sequence
    assert bounded.routes["query"]["text"] == bounded.routes["document"]["text"] == 64


def test_qwen_plan_without_max_pixels_names_the_key(qwen_tokenizer):
    from vembed.errors import RecipeError

    with pytest.raises(RecipeError, match="max_pixels"):
        measure_model(_qwen_recipe(qwen_tokenizer, "min_pixels=null", "max_pixels=null"))


# --- every shipped recipe plans ---------------------------------------------------------------------------------------
REPO = Path(__file__).resolve().parents[1]
SHIPPED_RECIPES = sorted([*(REPO / "configs").glob("*.yaml"), *(REPO / "examples").rglob("*.yaml")])
# Hub checkpoints the shipped recipes name -> their architecture config in bench/configs/ (README there: sources), which
# the planner reads instead, offline. A new recipe naming another checkpoint needs its config added here.
ARCHITECTURES = {
    "openai/clip-vit-base-patch32": "clip_vit_base_patch32.json",
    "google/siglip-base-patch16-224": "siglip_base_patch16_224.json",
    "sentence-transformers/all-MiniLM-L6-v2": "all_minilm_l6_v2.json",
    "cross-encoder/ms-marco-MiniLM-L6-v2": "cross_encoder_ms_marco_minilm_l6_v2.json",
    "bert-base-uncased": "bert_base_uncased.json",
    "facebook/dinov2-small": "dinov2_small.json",
    "Qwen/Qwen3-VL-Embedding-2B": "qwen3_vl_2b.json",
    "Qwen/Qwen3-VL-Embedding-8B": "qwen3_vl_8b.json",
    # The Embedding models are fine-tunes of these (the ColQwen recipes' bases): the same architectures.
    "Qwen/Qwen3-VL-2B-Instruct": "qwen3_vl_2b.json",
    "Qwen/Qwen3-VL-8B-Instruct": "qwen3_vl_8b.json",
    "Qwen/Qwen3-VL-Reranker-2B": "qwen3_vl_2b.json",  # the same architecture, with its LM head
}
NAME_KEYS = {"model_name": "model_config", "text_model_name": "text_model_config",
             "vision_model_name": "vision_model_config"}


@pytest.fixture(scope="module")
def stand_in_shards(tmp_path_factory) -> Path:
    """One pair of the tiny teachers' shapes (tests/teachers.py), as `vembed extract` writes it: what a DiT recipe
    that states no token shapes reads them from."""
    from teachers import CLIP_DIM, EVA_DIM, NUM_TOKENS

    from vembed.data.embedding_shards import shard_name, write_index, write_shard

    directory = tmp_path_factory.mktemp("shards")
    shard = directory / shard_name(0)
    write_shard(shard, torch.zeros(1, NUM_TOKENS, EVA_DIM), torch.zeros(1, NUM_TOKENS, CLIP_DIM), ["stand-in.png"],
                [], writer_rank=0)
    write_index(directory, [shard], {"teachers": {"a": "stand-in", "b": "stand-in"}})
    return directory


def _offline_overrides(path: Path, shards: Path) -> list[str]:
    raw = yaml.safe_load(path.read_text())
    overrides = []
    for name_key, config_key in NAME_KEYS.items():
        hub_id = raw.get(name_key)
        if hub_id is None or Path(hub_id).exists():
            continue
        assert hub_id in ARCHITECTURES, f"{path.name} names {hub_id}: add its architecture to bench/configs/"
        config = (REPO / "bench" / "configs" / ARCHITECTURES[hub_id]).read_text()
        overrides += [f"{name_key}=null", f"{config_key}={config}"]
    if overrides and "tokenizer_name" not in raw:  # a model_config needs one named; the planner never reads it
        overrides.append("tokenizer_name=unused")
    dit = raw.get("dit", {})
    if raw.get("model_type") == "blip3o_dit" and not all(dit.get(k) for k in ("eva_dim", "clip_dim", "num_tokens")):
        overrides.append(f"data.train={shards}")
    return overrides


@pytest.mark.parametrize("path", SHIPPED_RECIPES, ids=[p.name for p in SHIPPED_RECIPES])
def test_every_shipped_recipe_plans(path, stand_in_shards, capsys):
    from vembed.cli import main
    from vembed.components import load_recipe
    from vembed.planning import estimate_line
    from vembed.tasks import task_for

    overrides = _offline_overrides(path, stand_in_shards)
    code = main(["plan", str(path), "--gpus", "8", "--gpu-memory", "80", *(["--config_override", *overrides]
                                                                            if overrides else [])])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "recommendation: " in out and "none fits" not in out.split("recommendation: ")[1][:9]
    plan = make_plan(load_recipe(path, overrides), gpus=8, gpu_memory_gib=80)
    assert plan.model.total > 0
    for e in plan.estimates:
        assert e.total(False) > 0 and e.activations > 0, e.strategy.name
    # The start block of a training run prints the same estimate, not "unavailable".
    assert estimate_line(load_recipe(path, overrides), "ddp", 8).startswith("memory estimate     ")
    # What the batch is and whether GradCache is planned are the recipe's task's (a classifier's batch is not
    # "contrastive", and its task refuses GradCache, so no GradCache row).
    task = task_for(load_recipe(path, overrides))
    assert re.search(rf"= \d+ {task.plan_batch}; ", out), out.splitlines()[2]
    if not task.uses_gradient_cache:
        assert "gradcache" not in out, task.name


def test_the_recipes_are_all_found():
    names = {p.name for p in SHIPPED_RECIPES}
    assert {"blip3o_dit_base.yaml", "blip3o_dit_fsdp.yaml", "qwen3_vl_embedding_8b_fsdp.yaml"} <= names


# --- the BLIP3-o DiT: its own blocks, no LoRA or GradCache ------------------------------------------------------------
DIT = {"model_type": "blip3o_dit", "loss_type": "flow_matching", "data": {"format": "shards", "train": "none"},
       "dit": {"size": None, "hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
               "eva_adapter_layers": 1, "eva_dim": 48, "clip_dim": 24, "num_tokens": 16},
       "batch_size": 8, "metric_for_best_model": "image_cosine"}


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_dit_plan_counts_its_state_and_its_blocks_activations(precision):
    from vembed.generation.dit import Blip3oDiT

    recipe = recipe_from_dict({**DIT, "mixed_precision": precision})
    size = measure_model(recipe)
    real = Blip3oDiT(Blip3oDiT.on_meta(recipe).config)
    assert size.total == size.trainable == size.trainable_lora == sum(p.numel() for p in real.parameters())
    plan = make_plan(recipe, gpus=4, gpu_memory_gib=80)
    names = [e.strategy.name for e in plan.estimates]
    assert names == ["single", "ddp", "fsdp", "zero2", "zero3", "zero3+offload"]  # no LoRA, no GradCache
    single = plan.estimates[0]
    wide, narrow = real.activation_elements(autocast=precision == "bf16", cosine_loss=False)
    element = 2 if precision == "bf16" else 4
    assert single.activations == 8 * (4 * wide + element * narrow)  # no contrastive loss matrix on top
    assert single.activations_checkpointed == single.activations  # the DiT trains without checkpointing
    assert single.parameters == (6 if precision == "bf16" else 4) * size.total
    assert (single.gradients, single.optimizer) == (4 * size.trainable, 8 * size.trainable)
    fsdp = plan.estimates[names.index("fsdp")]
    block = sum(p.numel() for p in real.blocks[0].parameters())
    assert fsdp.parameters == pytest.approx(4 * size.total / 4 + GATHERED_LAYERS * block * element)
    assert "1 sample → dit 16 tokens" in format_plan(plan) and "no LoRA for this model" in format_plan(plan)


def test_dit_that_does_not_fit_is_sharded_without_lora():
    recipe = recipe_from_dict({**DIT, "batch_size": 1})
    probe = make_plan(recipe, gpus=8, gpu_memory_gib=80)
    by_name = {e.strategy.name: e for e in probe.estimates}
    between = (by_name["fsdp"].total(False) + by_name["ddp"].total(False)) / 2
    plan = make_plan(recipe, gpus=8, gpu_memory_gib=_memory_for(between))
    assert plan.recommendation == "FSDP" and "with LoRA" not in plan.reason
