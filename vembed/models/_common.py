"""Helpers the adapters share: loading HF pieces from a recipe, the batch layout of mixed text/image sides, pooling,
LoRA injection and LoRA-merged saving. Nothing here is adapter-specific; each adapter file composes these."""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from vembed.data.images import load_image
from vembed.errors import RecipeError

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

    from vembed.data.records import ImageLike, Side
    from vembed.recipe import Recipe

# --- the batch layout ------------------------------------------------------------------------------------------------
# `preprocess` returns one flat dict of tensors:
#   tokenizer outputs (input_ids, attention_mask, ...)  (n_text, seq): a row per side that has text, in side order
#   PIXEL_VALUES                                        (n_image, 3, H, W): a row per side that has an image
#   TEXT_INDEX, IMAGE_INDEX                             (n,) long: the side's row in the text / image tensors, or -1
# Text and image keys are absent when no side has that modality. Because rows are numbered in side order, any
# contiguous range of sides maps to a contiguous range of rows (`slice_batch` relies on this).
TEXT_INDEX = "text_index"
IMAGE_INDEX = "image_index"
PIXEL_VALUES = "pixel_values"
_LAYOUT_KEYS = (TEXT_INDEX, IMAGE_INDEX, PIXEL_VALUES)


def split_sides(sides: Sequence["Side"]) -> tuple[list[str], list["ImageLike"], dict[str, torch.Tensor]]:
    """The texts, the images and the TEXT_INDEX/IMAGE_INDEX layout of a list of sides."""
    texts: list[str] = []
    images: list[ImageLike] = []
    text_index, image_index = [], []
    for i, side in enumerate(sides):
        has_text = bool(side.text and side.text.strip())  # as in Side.is_empty: blank text counts as none
        if len(side.images) > 1:  # several images per side: only qwen_vl embeds more than one
            raise ValueError(f"side {i} of the batch has {len(side.images)} images; this model embeds one image per "
                             "side (model_type qwen_vl takes several)")
        image = side.images[0] if side.images else None
        if not has_text and image is None:
            raise ValueError(f"side {i} of the batch has neither text nor an image; empty sides cannot be embedded")
        text_index.append(len(texts) if has_text else -1)
        image_index.append(len(images) if image is not None else -1)
        if has_text:
            texts.append(side.text)
        if image is not None:
            images.append(image)
    layout = {
        TEXT_INDEX: torch.tensor(text_index, dtype=torch.long),
        IMAGE_INDEX: torch.tensor(image_index, dtype=torch.long),
    }
    return texts, images, layout


def make_batch(
    sides: Sequence["Side"],
    tokenizer: Any,
    image_processor: Any | None,
    *,
    max_length: int | None,
    text_keys: Iterable[str],
    padding: str = "longest",
) -> dict[str, torch.Tensor]:
    """Tokenise the texts and process the images of `sides` into the flat layout above.

    Only tokenizer outputs named in `text_keys` are kept (the text tower's forward arguments), because e.g. a
    tokenizer returning token_type_ids would break a CLIP text tower.
    """
    texts, images, batch = split_sides(sides)
    if texts:
        encoded = tokenizer(texts, padding=padding, truncation=True, max_length=max_length, return_tensors="pt")
        keep = set(text_keys)
        batch.update({key: value for key, value in encoded.items() if key in keep})
    if images:
        if image_processor is None:
            raise ValueError(
                "this model embeds text only, but the batch has images; use model_type clip, siglip or composed"
            )
        pixels = image_processor(images=[load_image(image) for image in images], return_tensors="pt")
        batch[PIXEL_VALUES] = pixels["pixel_values"]
    return batch


def text_inputs(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """The tokenizer outputs of a batch, or None when the batch has no text."""
    found = {key: value for key, value in inputs.items() if key not in _LAYOUT_KEYS}
    return found or None


def forward_argument_names(function: Any) -> set[str]:
    """Named parameters of a forward function: which tokenizer outputs a tower accepts."""
    return {
        name
        for name, parameter in inspect.signature(function).parameters.items()
        if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
    }


def combine(
    text: torch.Tensor | None,
    image: torch.Tensor | None,
    inputs: dict[str, torch.Tensor],
    normalize: bool,
) -> torch.Tensor:
    """Put text and image embeddings back in side order; a side with both gets the fused embedding.

    Fusion: the L2-normalised sum of the L2-normalised text and image embeddings (so both count equally whatever
    their norms); fused rows are therefore unit-norm even when `normalize` is false. Output is float32 so the loss
    never runs in half precision.
    """
    text_index, image_index = inputs[TEXT_INDEX], inputs[IMAGE_INDEX]
    text_rows, image_rows = _gather(text, text_index), _gather(image, image_index)
    if text_rows is None and image_rows is None:
        raise ValueError("empty batch: no text and no image rows")
    if text_rows is None:
        out = image_rows
    elif image_rows is None:
        out = text_rows
    else:
        both = ((text_index >= 0) & (image_index >= 0)).unsqueeze(-1)
        fused = F.normalize(F.normalize(text_rows, dim=-1) + F.normalize(image_rows, dim=-1), dim=-1)
        # Single-modality rows have zeros for the missing part, so the plain sum is just the present embedding.
        out = torch.where(both, fused, text_rows + image_rows)
    return F.normalize(out, dim=-1) if normalize else out


def _gather(embeddings: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    """One row per side (zeros where the side lacks this modality); indexing keeps the graph differentiable."""
    if embeddings is None:
        return None
    present = (index >= 0).unsqueeze(-1)
    return embeddings.float()[index.clamp(min=0)] * present


def slice_batch(inputs: dict[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
    """The preprocessed batch of sides `start:stop` (e.g. GradCache chunks), re-indexed to start at row 0."""
    out: dict[str, torch.Tensor] = {}
    text_keys = [key for key in inputs if key not in _LAYOUT_KEYS]
    for index_key, keys in ((TEXT_INDEX, text_keys), (IMAGE_INDEX, [PIXEL_VALUES])):
        index = inputs[index_key][start:stop]
        present = index[index >= 0]
        if len(present):
            first, last = int(present.min()), int(present.max()) + 1
            out.update({key: inputs[key][first:last] for key in keys})
            index = torch.where(index >= 0, index - first, index)
        out[index_key] = index
    return out


# --- pooling --------------------------------------------------------------------------------------------------------
def pool(hidden: torch.Tensor, attention_mask: torch.Tensor | None, pooling: str) -> torch.Tensor:
    """Pool token states `(n, seq, d)` to `(n, d)`; correct under left and right padding.

    cls: the first attended token; mean: the mean over attended tokens; last: the last attended token.
    """
    if attention_mask is None:
        attention_mask = torch.ones(hidden.shape[:2], dtype=torch.long, device=hidden.device)
    attention_mask = attention_mask.long()  # argmax is not defined for bool masks on every device
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    if pooling == "mean":
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
    if pooling == "cls":
        return hidden[rows, attention_mask.argmax(1)]  # argmax returns the first maximum: the first real token
    if pooling == "last":
        last = hidden.shape[1] - 1 - attention_mask.flip(1).argmax(1)
        return hidden[rows, last]
    raise ValueError(f"unknown pooling {pooling!r}; use cls, mean or last")


def cls_or_pooler(output: Any) -> torch.Tensor:
    """A vision tower's image embedding: its pooler_output when it has one, else the first (CLS) token."""
    pooled = getattr(output, "pooler_output", None)
    return pooled if pooled is not None else output.last_hidden_state[:, 0]


# --- building from a recipe -----------------------------------------------------------------------------------------
def hf_kwargs(trust_remote_code: bool, attn_implementation: str | None) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    return kwargs


@contextmanager
def _loading(key: str, name: str):
    """Turn transformers' "can't find / can't download" errors into one recipe line that names the key."""
    try:
        yield
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        offline = " (HF_HUB_OFFLINE is set: only local folders and the local cache are used)" if os.environ.get(
            "HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes") else ""
        raise RecipeError(key, f"cannot load {name!r}{offline}: {first}; check the hub id or local path") from None


def auto_config(
    name: str | None,
    config_dict: dict[str, Any] | None,
    *,
    key: str,
    trust_remote_code: bool = False,
    model_type: str | None = None,
) -> "PretrainedConfig":
    """The HF config of a pretrained `name`, or one built from `config_dict` (which names its `model_type`, unless the
    adapter fixes it). `key` is the recipe key blamed in errors."""
    from transformers import AutoConfig

    if name is not None:
        with _loading(key, name):
            config = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    else:
        kwargs = dict(config_dict or {})
        given = kwargs.pop("model_type", None)
        if model_type is not None and given not in (None, model_type):
            raise RecipeError(key, f"has model_type {given!r}, but this adapter builds {model_type!r} models")
        chosen = model_type or given
        if chosen is None:
            raise RecipeError(key, "needs a model_type naming the transformers architecture (e.g. bert, vit)")
        # huggingface_hub's typed configs raise StrictDataclassError (an Exception, not a ValueError) for a value of
        # the wrong type (`projection_dim: big`); its message spans lines, the first says which field.
        from huggingface_hub.errors import StrictDataclassError

        try:
            config = AutoConfig.for_model(chosen, **kwargs)
        except (ValueError, TypeError, StrictDataclassError) as err:
            cause = err.__cause__ if isinstance(err, StrictDataclassError) and err.__cause__ else err
            first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(err).__name__
            raise RecipeError(key, f"is not a valid {chosen!r} config: {first.split('. Errors:')[0]}") from None
    if model_type is not None and config.model_type != model_type:
        raise RecipeError(key, f"points at a {config.model_type!r} model, but this adapter needs {model_type!r}")
    return config


def load_model(
    name: str | None,
    config_dict: dict[str, Any] | None,
    *,
    key: str,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    model_type: str | None = None,
) -> "PreTrainedModel":
    """`AutoModel` from pretrained weights, or randomly initialised from a config dict."""
    from transformers import AutoModel

    kwargs = hf_kwargs(trust_remote_code, attn_implementation)
    if name is not None:
        auto_config(name, None, key=key, trust_remote_code=trust_remote_code, model_type=model_type)
        # float32 master weights whatever the checkpoint's dtype ("auto" is the transformers default): mixed
        # precision comes from autocast, and AdamW on bf16 weights loses small updates.
        with _loading(key, name):
            return AutoModel.from_pretrained(name, dtype=torch.float32, **kwargs)
    config = auto_config(None, config_dict, key=key, model_type=model_type)
    return AutoModel.from_config(config, **kwargs)


def load_tokenizer(name: str, trust_remote_code: bool = False, key: str = "tokenizer_name") -> Any:
    from transformers import AutoTokenizer

    with _loading(key, name):
        return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)


def load_image_processor(name: str, trust_remote_code: bool = False, key: str = "model_name") -> Any:
    """The PIL-backend image processor of a checkpoint (torchvision is not a dependency)."""
    from transformers import AutoImageProcessor

    with _loading(key, name):
        return AutoImageProcessor.from_pretrained(name, backend="pil", trust_remote_code=trust_remote_code)


def clip_image_processor(image_size: int) -> Any:
    """A processor for a randomly initialised vision tower: resize (shortest edge) + centre crop to `image_size`,
    CLIP's mean/std."""
    from transformers import CLIPImageProcessorPil

    return CLIPImageProcessorPil(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )


def require_model_type(config_dict: dict[str, Any] | None, key: str) -> None:
    """AutoConfig needs to know the architecture of a random-init config."""
    if config_dict is not None and "model_type" not in config_dict:
        raise RecipeError(key, "needs a model_type naming the transformers architecture (e.g. bert, vit, dinov2)")


def require_tokenizer_name(recipe: "Recipe", config_key: str) -> None:
    """A randomly initialised text tower has no tokenizer of its own."""
    if recipe.tokenizer_name is None:
        raise RecipeError(
            "tokenizer_name",
            f"is required when {config_key} builds a random-init text tower; point it at a tokenizer folder "
            "(e.g. one made by vembed.data.tokenizer.train_tokenizer)",
        )


# Recipe keys only the composed adapter reads; the single-model adapters reject them (see `reject_keys`).
COMPOSED_ONLY_KEYS = (
    "text_model_name", "text_model_config", "vision_model_name", "vision_model_config", "projection_dim",
)  # fmt: skip


def reject_keys(recipe: "Recipe", keys: Sequence[str], model_type: str, used_by: str) -> None:
    """Keys meant for another adapter are errors rather than silently ignored."""
    for key in keys:
        if getattr(recipe, key) is not None:
            raise RecipeError(key, f"is only used by model_type {used_by}, not {model_type}; remove it")


def resolve_max_length(requested: int | None, tokenizer: Any, config: Any, key: str = "max_length") -> int | None:
    """Tokens per text: the recipe's value, else the smaller of the tokenizer's and the position table's limits."""
    positions = getattr(config, "max_position_embeddings", None)
    if requested is not None:
        if positions is not None and requested > positions:
            raise RecipeError(key, f"{requested} exceeds the model's {positions} positions; use at most {positions}")
        return requested
    limits = [limit for limit in (getattr(tokenizer, "model_max_length", None), positions) if limit]
    limits = [int(limit) for limit in limits if limit < 1_000_000]  # tokenizers without a limit say ~1e30
    return min(limits) if limits else None


def freeze_unused_pooler(text_model: nn.Module) -> None:
    """We pool token states ourselves, so a BERT-style pooler gets no gradient; DDP (without
    find_unused_parameters) fails on trainable parameters that get no gradient, so they are frozen. Its weights are
    still saved, so the folder stays a complete HF model."""
    pooler = getattr(text_model, "pooler", None)
    if isinstance(pooler, nn.Module):
        pooler.requires_grad_(False)


def enable_checkpointing(*models: "PreTrainedModel") -> None:
    # Non-reentrant: works with frozen inputs (LoRA), DDP and torch.compile; the reentrant variant does not.
    for model in models:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.x's name; the old one warns
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


# --- LoRA -----------------------------------------------------------------------------------------------------------
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
    towers: Sequence[nn.Module], recipe: "Recipe", names: Sequence[str], *, strict: bool, model_type: str
) -> None:
    """Wrap, in place, the linear layers of each tower whose name ends with one of `names` with LoRA; everything
    else in the towers is frozen.

    `strict` (names the user chose): every name must match somewhere. Always: every tower must get at least one LoRA
    layer, since a tower without any would silently stay frozen. `inject_adapter_in_model` (not `get_peft_model`)
    keeps each tower its plain HF class, so its own methods (get_text_features, gradient_checkpointing_enable,
    save_pretrained) keep working.
    """
    from peft import LoraConfig, inject_adapter_in_model

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
        config = LoraConfig(
            r=recipe.lora_r, lora_alpha=recipe.lora_alpha, lora_dropout=recipe.lora_dropout, target_modules=targets
        )
        inject_adapter_in_model(config, tower)
        tower.train(tower.training)  # new LoRA dropout modules start in train mode; match the tower's mode


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


def save_hf_model(model: "PreTrainedModel", path: str | Path) -> None:
    """`save_pretrained` as safetensors, LoRA merged in, so `path` loads with plain transformers."""
    Path(path).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, state_dict=merged_state_dict(model))  # transformers 5 always writes safetensors


def saved_settings(path: str | Path, model_type: str) -> dict[str, Any]:
    """The settings of a saved adapter folder, after checking that it was saved by `model_type`."""
    from vembed.models.base import read_adapter_file

    info = read_adapter_file(path)
    if info.get("model_type") != model_type:
        raise RecipeError("model", f"{str(path)!r} holds a {info.get('model_type')!r} model, not {model_type!r}")
    return dict(info.get("settings", {}))


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
    from peft import LoraConfig, inject_adapter_in_model
    from safetensors.torch import load_file

    config = LoraConfig.from_pretrained(str(path))
    inject_adapter_in_model(config, model)
    weights = load_file(str(Path(path, LORA_WEIGHTS)))
    result = model.load_state_dict(weights, strict=False)
    missing_lora = [key for key in result.missing_keys if ".lora_" in key]
    if result.unexpected_keys or missing_lora:
        raise RecipeError("model", f"LoRA weights in {str(path)!r} do not match the base model "
                                   f"(unexpected {result.unexpected_keys[:3]}, missing {missing_lora[:3]})")
