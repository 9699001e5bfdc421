"""LoRA on an adapter's towers (PEFT), LoRA merged into a plain state dict for saving, and LoRA weights alone."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from vembed.errors import RecipeError

if TYPE_CHECKING:
    from peft import LoraConfig

# Attention projections under the names common encoders use (BERT/RoBERTa/ViT/DINOv2, MPNet, DistilBERT,
# CLIP/SigLIP/LLaMA/Qwen-style, ModernBERT): the default LoRA targets of AutoModel towers are those a tower has.
ATTENTION_PROJECTIONS = (
    "query", "key", "value", "q", "k", "v", "q_lin", "k_lin", "v_lin", "q_proj", "k_proj", "v_proj", "Wqkv",
)  # fmt: skip


def _linear_layers(model: nn.Module) -> list[str]:
    """Names of the layers LoRA can wrap. Linears inside nn.MultiheadAttention (e.g. SigLIP's pooling head
    `out_proj`) are left out: that module reads their weight directly, so a LoRA wrapper there would never run."""
    from transformers.pytorch_utils import Conv1D

    inside_mha = [name + "." for name, module in model.named_modules() if isinstance(module, nn.MultiheadAttention)]
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, (nn.Linear, Conv1D)) and not any(name.startswith(prefix) for prefix in inside_mha)
    ]


def inject_lora(
    towers: Sequence[nn.Module], names: Sequence[str], *, r: int, alpha: int, dropout: float, strict: bool,
    model_type: str,
) -> None:
    """Wrap, in place, the linear layers of each tower whose name ends with one of `names` with LoRA; everything
    else in the towers is frozen.

    `strict` (names the user chose): every name must match somewhere. Always: every tower must get at least one LoRA
    layer, since a tower without any would silently stay frozen. `inject_adapter_in_model` (not `get_peft_model`)
    keeps each tower its plain HF class, so its own methods (get_text_features, gradient_checkpointing_enable,
    save_pretrained) keep working.
    """
    from peft import LoraConfig

    plans = []
    matched: set[str] = set()
    available: set[str] = set()
    for tower in towers:
        linears = _linear_layers(tower)
        available.update(name.rsplit(".", 1)[-1] for name in linears)
        targets = []
        for target in names:
            hits = [name for name in linears if name == target or name.endswith("." + target)]
            if hits:
                matched.add(target)
            targets.extend(hits)
        plans.append((tower, sorted(set(targets))))
    unmatched = [name for name in names if name not in matched]
    hint = f"linear layers here are named: {', '.join(sorted(available))}"
    if strict and unmatched:
        message = f"{unmatched} match no linear layer of this {model_type} model; {hint}"
        raise RecipeError("lora_target_modules", message)
    for tower, targets in plans:
        if not targets:
            raise RecipeError(
                "lora_target_modules",
                f"none of {list(names)} is a linear layer of the {type(tower).__name__} tower; {hint}",
            )
    for tower, targets in plans:
        _inject(LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets), tower)


def _inject(config: "LoraConfig", model: nn.Module) -> None:
    """PEFT's LoRA layers wrapped into `model`, in `model`'s mode: new LoRA dropout modules start in train mode, which
    in an eval-mode model (a loaded one) would make its embeddings random."""
    from peft import inject_adapter_in_model

    inject_adapter_in_model(config, model)
    model.train(model.training)


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """`model`'s state dict with every LoRA layer folded into its base weight, keyed as in the plain HF model; None
    when `model` has no LoRA. Only the merged weights are new tensors, so saving mid-training costs no model copy and
    leaves the training model (and its LoRA weights) untouched."""
    from peft.tuners.lora import LoraLayer

    layers = {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    if not layers:
        return None
    merged: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if ".lora_" in key:  # lora_A / lora_B: folded into the base weight below
            continue
        merged[key.replace(".base_layer.", ".")] = value
    with torch.no_grad():
        for name, layer in layers.items():
            base = layer.get_base_layer().weight
            adapters = [adapter for adapter in layer.active_adapters if adapter in layer.lora_A]
            delta = sum(layer.get_delta_weight(adapter) for adapter in adapters)
            merged[f"{name}.weight"] = (base + delta).to(base.dtype)
    return merged


# --- LoRA weights alone ---------------------------------------------------------------------------------------------
LORA_WEIGHTS, LORA_CONFIG = "adapter_model.safetensors", "adapter_config.json"  # PEFT's file names


def save_lora_weights(model: nn.Module, path: str | Path) -> None:
    """Only `model`'s LoRA weights (safetensors) and a PEFT `adapter_config.json` naming the wrapped layers, with the
    rank, alpha and dropout they were built with. The base weights are not written: loading needs the base model."""
    from peft import LoraConfig
    from peft.tuners.lora import LoraLayer
    from safetensors.torch import save_file

    layers = {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    if not layers:
        raise ValueError("the model has no LoRA layers to save; save the full model instead")
    some = next(iter(layers.values()))
    adapter = some.active_adapters[0]
    dropout = some.lora_dropout[adapter]
    config = LoraConfig(
        r=some.r[adapter], lora_alpha=some.lora_alpha[adapter], target_modules=sorted(layers),
        lora_dropout=dropout.p if isinstance(dropout, nn.Dropout) else 0.0,
    )
    Path(path).mkdir(parents=True, exist_ok=True)
    weights = {key: value.detach().contiguous() for key, value in model.state_dict().items() if ".lora_" in key}
    save_file(weights, str(Path(path, LORA_WEIGHTS)))
    config.save_pretrained(str(path))


def load_lora_weights(model: nn.Module, path: str | Path) -> None:
    """Wrap `model` with the LoRA layers described in `path` and load their weights (inverse of
    `save_lora_weights`); every saved weight must find its layer."""
    from peft import LoraConfig
    from safetensors.torch import load_file

    _inject(LoraConfig.from_pretrained(str(path)), model)
    weights = load_file(str(Path(path, LORA_WEIGHTS)))
    result = model.load_state_dict(weights, strict=False)
    missing_lora = [key for key in result.missing_keys if ".lora_" in key]
    if result.unexpected_keys or missing_lora:
        raise RecipeError("model", f"LoRA weights in {str(path)!r} do not match the base model "
                                   f"(unexpected {result.unexpected_keys[:3]}, missing {missing_lora[:3]})")
