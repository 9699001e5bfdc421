"""Loading and saving Hugging Face pieces (configs, models, tokenizers, image processors) for the adapters, with
loading errors turned into one recipe line that names the key."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from vembed.errors import RecipeError
from vembed.models.lora import merged_state_dict

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

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
    auto_class: str = "AutoModel",
    config: "PretrainedConfig | None" = None,
) -> "PreTrainedModel":
    """`auto_class` (a transformers Auto class name: AutoModel, or AutoModelForImageTextToText for a model with its
    LM head) from pretrained weights, or randomly initialised from a config dict. `config`: the pretrained model's
    config as the adapter changed it (vision: its stochastic depth), already read and checked."""
    import transformers

    AutoModel = getattr(transformers, auto_class)
    kwargs = hf_kwargs(trust_remote_code, attn_implementation)
    if name is not None:
        if config is None:
            auto_config(name, None, key=key, trust_remote_code=trust_remote_code, model_type=model_type)
        else:
            kwargs["config"] = config
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


def save_hf_model(model: "PreTrainedModel", path: str | Path) -> None:
    """`save_pretrained` as safetensors, LoRA merged in, so `path` loads with plain transformers."""
    Path(path).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, state_dict=merged_state_dict(model))  # transformers 5 always writes safetensors


