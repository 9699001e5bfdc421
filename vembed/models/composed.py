"""Any text tower plus any vision tower (`AutoModel` each), joined by learned linear projections into one space.

Saved as `text/` (model + tokenizer) and `vision/` (model + image processor), each loadable by transformers on its
own, plus `projections.safetensors`; a side with text and image is fused as in CLIP (`vembed.models.batch.combine`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from vembed.errors import RecipeError
from vembed.models import MODELS
from vembed.models.base import EmbeddingAdapter, require_tokenizer_name, saved_settings
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


def _width(config: "PretrainedConfig") -> int:
    """Width of a tower's output: hidden_size, or the last stage of hierarchical vision models (ConvNeXt, Swin)."""
    if getattr(config, "hidden_size", None):
        return config.hidden_size
    return config.hidden_sizes[-1]


@MODELS.register("composed")
class ComposedAdapter(EmbeddingAdapter):
    """Text: pooled by `pooling`, then projected. Image: pooler_output (else the CLS token), then projected."""

    model_type = "composed"
    modalities = frozenset({"text", "image"})
    default_lora_target_modules = ATTENTION_PROJECTIONS

    def __init__(
        self,
        text_model: "PreTrainedModel",
        vision_model: "PreTrainedModel",
        tokenizer: Any,
        image_processor: Any,
        *,
        projection_dim: int | None = None,
        pooling: str = "mean",
        normalize: bool = True,
        max_length: int | None = None,
        trust_remote_code: bool = False,
        attn_implementation: str | None = None,
    ):
        super().__init__(normalize=normalize, max_length=max_length, trust_remote_code=trust_remote_code,
                         attn_implementation=attn_implementation)
        self.text_model = text_model
        self.vision_model = vision_model
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.projection_dim = projection_dim or _width(text_model.config)
        # Bias-free like CLIP's projections: a shared offset would only shift every embedding the same way.
        self.text_projection = nn.Linear(_width(text_model.config), self.projection_dim, bias=False)
        self.vision_projection = nn.Linear(_width(vision_model.config), self.projection_dim, bias=False)
        self.pooling = pooling
        freeze_unused_pooler(text_model)  # the vision pooler (if any) is used, the text one never
        self._text_keys = forward_argument_names(text_model.forward)

    # --- built from a recipe ---------------------------------------------------------------------------------------
    @classmethod
    def check_recipe(cls, recipe: "Recipe") -> None:
        if recipe.model_name is not None or recipe.model_config_dict is not None:
            key = "model_name" if recipe.model_name is not None else "model_config"
            raise RecipeError(
                key,
                "is not used by model_type composed; give text_model_name or text_model_config, and "
                "vision_model_name or vision_model_config",
            )
        for tower in ("text", "vision"):
            name, config = getattr(recipe, f"{tower}_model_name"), getattr(recipe, f"{tower}_model_config")
            if (name is None) == (config is None):
                raise RecipeError(
                    f"{tower}_model_name",
                    f"model_type composed needs exactly one of {tower}_model_name (pretrained) or "
                    f"{tower}_model_config (random init)",
                )
            require_model_type(config, f"{tower}_model_config")
        if recipe.text_model_config is not None:
            require_tokenizer_name(recipe, "text_model_config")

    @classmethod
    def _tower_config(cls, recipe: "Recipe", tower: str) -> "PretrainedConfig":
        name = getattr(recipe, f"{tower}_model_name")
        key = f"{tower}_model_name" if name else f"{tower}_model_config"
        return auto_config(
            name, getattr(recipe, f"{tower}_model_config"), key=key, trust_remote_code=recipe.trust_remote_code
        )

    @classmethod
    def embedding_dim_for(cls, recipe: "Recipe") -> int:
        return recipe.projection_dim or _width(cls._tower_config(recipe, "text"))

    @classmethod
    def _load_tower(cls, recipe: "Recipe", tower: str) -> "PreTrainedModel":
        name = getattr(recipe, f"{tower}_model_name")
        return load_model(
            name,
            getattr(recipe, f"{tower}_model_config"),
            key=f"{tower}_model_name" if name else f"{tower}_model_config",
            trust_remote_code=recipe.trust_remote_code,
            attn_implementation=recipe.attn_implementation,
        )

    @classmethod
    def from_recipe(cls, recipe: "Recipe") -> "ComposedAdapter":
        cls.check_recipe(recipe)
        text_model = cls._load_tower(recipe, "text")
        vision_model = cls._load_tower(recipe, "vision")
        tokenizer = load_tokenizer(recipe.tokenizer_name or recipe.text_model_name, recipe.trust_remote_code)
        if recipe.vision_model_name is not None:
            image_processor = load_image_processor(recipe.vision_model_name, recipe.trust_remote_code)
        else:
            image_processor = clip_image_processor(vision_model.config.image_size)
        return cls(
            text_model,
            vision_model,
            tokenizer,
            image_processor,
            projection_dim=recipe.projection_dim,
            pooling=recipe.pooling,
            normalize=recipe.normalize,
            max_length=resolve_max_length(recipe.max_length, tokenizer, text_model.config),
            trust_remote_code=recipe.trust_remote_code,
            attn_implementation=recipe.attn_implementation,
        )

    @classmethod
    def on_meta(cls, recipe: "Recipe") -> "ComposedAdapter":
        from transformers import AutoModel

        cls.check_recipe(recipe)
        configs = [cls._tower_config(recipe, tower) for tower in ("text", "vision")]
        kwargs = hf_kwargs(recipe.trust_remote_code, recipe.attn_implementation)
        with torch.device("meta"):  # the projections made in __init__ land on meta too
            towers = [AutoModel.from_config(config, **kwargs) for config in configs]
            return cls(*towers, None, None, projection_dim=recipe.projection_dim, pooling=recipe.pooling,
                       normalize=recipe.normalize, max_length=resolve_max_length(recipe.max_length, None, configs[0]))

    def encoder_configs(self) -> "dict[str, PretrainedConfig]":
        return {"text": self.text_model.config, "image": self.vision_model.config}

    # --- used by the loop ------------------------------------------------------------------------------------------
    @property
    def embedding_dim(self) -> int:
        return self.projection_dim

    def preprocess(self, sides: Sequence["Side"]) -> dict[str, torch.Tensor]:
        return make_batch(
            sides, self.tokenizer, self.image_processor, max_length=self.max_length, text_keys=self._text_keys
        )

    def encode(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        text = image = None
        tokens = text_inputs(inputs)
        if tokens is not None:
            hidden = self.text_model(**tokens).last_hidden_state
            text = self.text_projection(pool(hidden, tokens.get("attention_mask"), self.pooling))
        if PIXEL_VALUES in inputs:
            output = self.vision_model(pixel_values=inputs[PIXEL_VALUES].to(self.vision_model.dtype))
            image = self.vision_projection(cls_or_pooler(output))
        return combine(text, image, inputs, self.normalize)

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
    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "projection_dim": self.projection_dim, "pooling": self.pooling}

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
    def load(cls, path: str | Path) -> "ComposedAdapter":
        from safetensors.torch import load_file

        path = Path(path)
        settings = saved_settings(path, cls.model_type)
        trust, attention = settings.get("trust_remote_code", False), settings.get("attn_implementation")
        towers = [
            load_model(str(path / folder), None, key="model", trust_remote_code=trust, attn_implementation=attention)
            for folder in (TEXT_DIR, VISION_DIR)
        ]
        adapter = cls(
            *towers,
            load_tokenizer(str(path / TEXT_DIR), trust),
            load_image_processor(str(path / VISION_DIR), trust),
            **settings,
        )
        state = load_file(str(path / PROJECTIONS_FILE))
        for name in _PROJECTIONS:
            prefix = name + "."
            getattr(adapter, name).load_state_dict(
                {key[len(prefix):]: value for key, value in state.items() if key.startswith(prefix)}
            )
        return adapter
