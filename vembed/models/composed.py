"""Any text tower plus any vision tower (`AutoModel` each), joined by learned linear projections into one space.

Saved as `text/` (model + tokenizer) and `vision/` (model + image processor), each loadable by transformers on its
own, plus `projections.safetensors`; a side with text and image is fused as in CLIP (`vembed.models.batch.combine`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import nn

from vembed.errors import RecipeError
from vembed.models import MODELS
from vembed.models.base import AdapterSettings, EmbeddingAdapter, require_tokenizer_name
from vembed.models.batch import PIXEL_VALUES, combine, forward_argument_names, make_batch, text_inputs
from vembed.models.hf import (
    auto_config,
    clip_image_processor,
    freeze_unused_pooler,
    hf_kwargs,
    load_image_processor,
    load_model,
    load_tokenizer,
    require_model_type,
    resolve_max_length,
    save_hf_model,
)
from vembed.models.lora import ATTENTION_PROJECTIONS
from vembed.models.pooling import cls_or_pooler, pool

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

    from vembed.data.records import Side
    from vembed.recipe import Recipe

TEXT_DIR, VISION_DIR, PROJECTIONS_FILE = "text", "vision", "projections.safetensors"
_PROJECTIONS = ("text_projection", "vision_projection")
TOWERS = ("text", "vision")


class ComposedSettings(AdapterSettings):
    text_model_name: str | None = None  # text tower (hub id or path) ...
    text_model_config: dict[str, Any] | None = None  # ... or its config for random init (naming its model_type)
    vision_model_name: str | None = None  # vision tower (hub id or path) ...
    vision_model_config: dict[str, Any] | None = None  # ... or its config for random init
    projection_dim: int | None = Field(default=None, gt=0)  # shared embedding size (unset: the text hidden size)
    pooling: Literal["cls", "mean", "last"] = "mean"  # of the text tower's states

    unsaved: ClassVar[frozenset[str]] = AdapterSettings.unsaved | {
        "text_model_name", "text_model_config", "vision_model_name", "vision_model_config",
    }  # fmt: skip


def _width(config: "PretrainedConfig") -> int:
    """Width of a tower's output: hidden_size, or the last stage of hierarchical vision models (ConvNeXt, Swin)."""
    if getattr(config, "hidden_size", None):
        return config.hidden_size
    return config.hidden_sizes[-1]


@MODELS.register("composed")
class ComposedAdapter(EmbeddingAdapter):
    """Text: pooled by `pooling`, then projected. Image: pooler_output (else the CLS token), then projected."""

    model_type = "composed"
    Settings: ClassVar[type[ComposedSettings]] = ComposedSettings
    modalities = frozenset({"text", "image"})
    modalities_per_record = modalities  # a dual encoder: a text-only (or image-only) step leaves a tower idle
    default_lora_target_modules = ATTENTION_PROJECTIONS
    image_cache = True

    def __init__(
        self, text_model: "PreTrainedModel", vision_model: "PreTrainedModel", tokenizer: Any, image_processor: Any,
        settings: ComposedSettings,
    ):  # fmt: skip
        dim = settings.projection_dim or _width(text_model.config)
        super().__init__(settings.model_copy(update={"projection_dim": dim}))
        self.text_model = text_model
        self.vision_model = vision_model
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        # Bias-free like CLIP's projections: a shared offset would only shift every embedding the same way.
        self.text_projection = nn.Linear(_width(text_model.config), dim, bias=False)
        self.vision_projection = nn.Linear(_width(vision_model.config), dim, bias=False)
        freeze_unused_pooler(text_model)  # the vision pooler (if any) is used, the text one never
        self._text_keys = forward_argument_names(text_model.forward)

    # --- built from a recipe ---------------------------------------------------------------------------------------
    @classmethod
    def check_recipe(cls, recipe: "Recipe") -> None:
        settings = cls.settings_of(recipe)
        for tower in TOWERS:
            name, config = getattr(settings, f"{tower}_model_name"), getattr(settings, f"{tower}_model_config")
            if (name is None) == (config is None):
                raise RecipeError(
                    f"{tower}_model_name",
                    f"model_type composed needs exactly one of {tower}_model_name (pretrained) or "
                    f"{tower}_model_config (random init)",
                )
            require_model_type(config, f"{tower}_model_config")
        if settings.text_model_config is not None:
            require_tokenizer_name(settings, "text_model_config")

    @classmethod
    def _tower_config(cls, settings: ComposedSettings, tower: str) -> "PretrainedConfig":
        name = getattr(settings, f"{tower}_model_name")
        key = f"{tower}_model_name" if name else f"{tower}_model_config"
        return auto_config(name, getattr(settings, f"{tower}_model_config"), key=key,
                           trust_remote_code=settings.trust_remote_code)

    @classmethod
    def embedding_dim_for(cls, recipe: "Recipe") -> int:
        settings = cls.settings_of(recipe)
        return settings.projection_dim or _width(cls._tower_config(settings, "text"))

    @classmethod
    def _load_tower(cls, settings: ComposedSettings, tower: str) -> "PreTrainedModel":
        name = getattr(settings, f"{tower}_model_name")
        return load_model(name, getattr(settings, f"{tower}_model_config"),
                          key=f"{tower}_model_name" if name else f"{tower}_model_config",
                          trust_remote_code=settings.trust_remote_code,
                          attn_implementation=settings.attn_implementation)

    @classmethod
    def from_recipe(cls, recipe: "Recipe") -> "ComposedAdapter":
        cls.check_recipe(recipe)
        settings = cls.settings_of(recipe)
        text_model, vision_model = (cls._load_tower(settings, tower) for tower in TOWERS)
        trust = settings.trust_remote_code
        tokenizer = load_tokenizer(settings.tokenizer_name or settings.text_model_name, trust)
        if settings.vision_model_name is not None:
            image_processor = load_image_processor(settings.vision_model_name, trust)
        else:
            image_processor = clip_image_processor(vision_model.config.image_size)
        max_length = resolve_max_length(settings.max_length, tokenizer, text_model.config)
        return cls(text_model, vision_model, tokenizer, image_processor,
                   settings.model_copy(update={"max_length": max_length}))

    @classmethod
    def on_meta(cls, recipe: "Recipe") -> "ComposedAdapter":
        from transformers import AutoModel

        cls.check_recipe(recipe)
        settings = cls.settings_of(recipe)
        configs = [cls._tower_config(settings, tower) for tower in TOWERS]
        kwargs = hf_kwargs(settings.trust_remote_code, settings.attn_implementation)
        max_length = resolve_max_length(settings.max_length, None, configs[0])
        with torch.device("meta"):  # the projections made in __init__ land on meta too
            towers = [AutoModel.from_config(config, **kwargs) for config in configs]
            return cls(*towers, None, None, settings.model_copy(update={"max_length": max_length}))

    def encoder_configs(self) -> "dict[str, PretrainedConfig]":
        return {"text": self.text_model.config, "image": self.vision_model.config}

    # --- used by the loop ------------------------------------------------------------------------------------------
    @property
    def embedding_dim(self) -> int:
        return self.settings.projection_dim

    def preprocess(self, sides: Sequence["Side"]) -> dict[str, torch.Tensor]:
        return make_batch(
            sides, self.tokenizer, self.image_processor, max_length=self.settings.max_length, text_keys=self._text_keys
        )

    def encode(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        text = image = None
        tokens = text_inputs(inputs)
        if tokens is not None:
            hidden = self.text_model(**tokens).last_hidden_state
            text = self.text_projection(pool(hidden, tokens.get("attention_mask"), self.settings.pooling))
        if PIXEL_VALUES in inputs:
            output = self.vision_model(pixel_values=inputs[PIXEL_VALUES].to(self.vision_model.dtype))
            image = self.vision_projection(cls_or_pooler(output))
        return combine(text, image, inputs, self.settings.normalize)

    def forward_flops(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor | int:
        """Each tower's weights per token (text) or per patch (images), its projection once per row (see
        vembed/models/flops.py)."""
        from vembed.models.flops import text_flops, vision_flops

        flops: torch.Tensor | int = 0
        tokens = text_inputs(inputs)
        if tokens is not None:
            flops = text_flops(tokens, self.matmul_weights(self.text_model), self.matmul_weights(self.text_projection))
        if PIXEL_VALUES in inputs:
            weights = self.matmul_weights(self.vision_model), self.matmul_weights(self.vision_projection)
            flops = flops + vision_flops(self.vision_model.config, *weights, inputs[PIXEL_VALUES])
        return flops

    def towers(self) -> list[nn.Module]:
        # Only the towers get LoRA; the projections are new, so they stay fully trainable.
        return [self.text_model, self.vision_model]

    # --- persistence -----------------------------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        path = Path(path)
        save_hf_model(self.text_model, path / TEXT_DIR)
        self.tokenizer.save_pretrained(path / TEXT_DIR)
        save_hf_model(self.vision_model, path / VISION_DIR)
        self.image_processor.save_pretrained(path / VISION_DIR)
        projections = {
            f"{name}.{key}": value.detach().cpu().contiguous()
            for name in _PROJECTIONS
            for key, value in getattr(self, name).state_dict().items()
        }
        save_file(projections, str(path / PROJECTIONS_FILE))
        self.write_adapter_file(path)

    @classmethod
    def load(cls, path: str | Path, *, trust_remote_code: bool = False) -> "ComposedAdapter":
        from safetensors.torch import load_file

        path = Path(path)
        _, settings = cls.saved_settings(path, trust_remote_code)
        towers = [load_model(str(path / folder), None, key="model", trust_remote_code=trust_remote_code,
                             attn_implementation=settings.attn_implementation) for folder in (TEXT_DIR, VISION_DIR)]
        adapter = cls(*towers, load_tokenizer(str(path / TEXT_DIR), trust_remote_code),
                      load_image_processor(str(path / VISION_DIR), trust_remote_code), settings)
        state = load_file(str(path / PROJECTIONS_FILE))
        for name in _PROJECTIONS:
            prefix = name + "."
            getattr(adapter, name).load_state_dict(
                {key[len(prefix):]: value for key, value in state.items() if key.startswith(prefix)}
            )
        return adapter
