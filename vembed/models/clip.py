"""CLIP as an embedding model: the HF `CLIPModel` text and vision towers with their projections.

Text sides get text features, image sides image features; a side with both gets the L2-normalised sum of its
normalised text and image features (see `vembed.models.batch.combine`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from vembed.models import MODELS
from vembed.models.base import COMPOSED_ONLY_KEYS, EmbeddingAdapter, reject_keys, require_tokenizer_name, saved_settings
from vembed.models.batch import PIXEL_VALUES, combine, forward_argument_names, make_batch, text_inputs
from vembed.models.hf import (
    auto_config,
    clip_image_processor,
    hf_kwargs,
    load_image_processor,
    load_model,
    load_tokenizer,
    resolve_max_length,
    save_hf_model,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

    from vembed.data.records import Side
    from vembed.recipe import Recipe

@MODELS.register("clip")
class ClipAdapter(EmbeddingAdapter):
    """A CLIP-style dual encoder. SigLIP subclasses it, changing only the class attributes and hooks below."""

    model_type = "clip"
    modalities = frozenset({"text", "image"})
    default_lora_target_modules = ("q_proj", "k_proj", "v_proj", "out_proj")  # the attention projections, both towers
    text_padding: ClassVar[str] = "longest"  # CLIP pools at the EOS token under a causal mask, so padding is free
    # The HF model's own contrastive-loss scalars. The vembed loss owns the temperature, so these get no gradient;
    # DDP (without find_unused_parameters) fails on trainable parameters without a gradient, so they are frozen.
    unused_parameters: ClassVar[tuple[str, ...]] = ("logit_scale",)

    def __init__(
        self,
        model: "PreTrainedModel",
        tokenizer: Any,
        image_processor: Any,
        *,
        normalize: bool = True,
        max_length: int | None = None,
        trust_remote_code: bool = False,
        attn_implementation: str | None = None,
    ):
        super().__init__(normalize=normalize, max_length=max_length, trust_remote_code=trust_remote_code,
                         attn_implementation=attn_implementation)
        self.model = model
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        for name in self.unused_parameters:
            getattr(model, name).requires_grad_(False)
        self._text_keys = forward_argument_names(model.get_text_features)

    # --- hooks the SigLIP subclass overrides -----------------------------------------------------------------------
    @classmethod
    def _dim_from_config(cls, config: "PretrainedConfig") -> int:
        return config.projection_dim

    @classmethod
    def _new_image_processor(cls, config: "PretrainedConfig") -> Any:
        return clip_image_processor(config.vision_config.image_size)

    # --- built from a recipe ---------------------------------------------------------------------------------------
    @classmethod
    def check_recipe(cls, recipe: "Recipe") -> None:
        super().check_recipe(recipe)
        reject_keys(recipe, COMPOSED_ONLY_KEYS, cls.model_type, "composed")
        if recipe.model_config_dict is not None:
            require_tokenizer_name(recipe, "model_config")

    @classmethod
    def _config(cls, recipe: "Recipe") -> "PretrainedConfig":
        return auto_config(
            recipe.model_name,
            recipe.model_config_dict,
            key="model_name" if recipe.model_name else "model_config",
            trust_remote_code=recipe.trust_remote_code,
            model_type=cls.model_type,
        )

    @classmethod
    def embedding_dim_for(cls, recipe: "Recipe") -> int:
        return cls._dim_from_config(cls._config(recipe))

    @classmethod
    def from_recipe(cls, recipe: "Recipe") -> "ClipAdapter":
        cls.check_recipe(recipe)
        cls.embedding_dim_for(recipe)  # config-level checks (e.g. SigLIP's matching tower sizes) before any weights
        model = load_model(
            recipe.model_name,
            recipe.model_config_dict,
            key="model_name" if recipe.model_name else "model_config",
            trust_remote_code=recipe.trust_remote_code,
            attn_implementation=recipe.attn_implementation,
            model_type=cls.model_type,
        )
        tokenizer = load_tokenizer(recipe.tokenizer_name or recipe.model_name, recipe.trust_remote_code)
        if recipe.model_name is not None:
            image_processor = load_image_processor(recipe.model_name, recipe.trust_remote_code)
        else:
            image_processor = cls._new_image_processor(model.config)
        return cls(
            model,
            tokenizer,
            image_processor,
            normalize=recipe.normalize,
            max_length=resolve_max_length(recipe.max_length, tokenizer, model.config.text_config),
            trust_remote_code=recipe.trust_remote_code,
            attn_implementation=recipe.attn_implementation,
        )

    @classmethod
    def on_meta(cls, recipe: "Recipe") -> "ClipAdapter":
        from transformers import AutoModel

        cls.check_recipe(recipe)
        config = cls._config(recipe)
        cls._dim_from_config(config)
        with torch.device("meta"):
            model = AutoModel.from_config(config, **hf_kwargs(recipe.trust_remote_code, recipe.attn_implementation))
        max_length = resolve_max_length(recipe.max_length, None, config.text_config)
        return cls(model, None, None, normalize=recipe.normalize, max_length=max_length)

    def encoder_configs(self) -> "dict[str, PretrainedConfig]":
        return {"text": self.model.config.text_config, "image": self.model.config.vision_config}

    # --- used by the loop ------------------------------------------------------------------------------------------
    @property
    def embedding_dim(self) -> int:
        return self._dim_from_config(self.model.config)

    def preprocess(self, sides: Sequence["Side"]) -> dict[str, torch.Tensor]:
        return make_batch(
            sides,
            self.tokenizer,
            self.image_processor,
            max_length=self.max_length,
            text_keys=self._text_keys,
            padding=self.text_padding,
        )

    def encode(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        text = image = None
        tokens = text_inputs(inputs)
        if tokens is not None:
            text = self.model.get_text_features(**tokens).pooler_output
        if PIXEL_VALUES in inputs:
            pixels = inputs[PIXEL_VALUES].to(self.model.dtype)
            image = self.model.get_image_features(pixel_values=pixels).pooler_output
        return combine(text, image, inputs, self.normalize)

    def forward_flops(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor | int:
        """Each tower's weights per token (text) or per patch (images), its projection or pooling head once per
        row (see `flops_parts` and vembed/models/flops.py)."""
        from vembed.models.flops import text_flops, vision_flops

        flops: torch.Tensor | int = 0
        if text_inputs(inputs) is not None:
            flops = text_flops(inputs, *self._weights("text"))
        if PIXEL_VALUES in inputs:
            config = self.model.config.vision_config
            flops = flops + vision_flops(config, *self._weights("vision"), inputs[PIXEL_VALUES])
        return flops

    # modality: (the tower, the modules applied once per row after pooling); SigLIP's heads live inside its towers.
    flops_parts: ClassVar[dict[str, tuple[str, tuple[str, ...]]]] = {
        "text": ("text_model", ("text_projection",)),
        "vision": ("vision_model", ("visual_projection",)),
    }

    def _weights(self, modality: str) -> tuple[int, int]:
        """(weights applied per token, weights applied per row) of one modality."""
        tower_name, row_names = self.flops_parts[modality]
        tower = self.model.get_submodule(tower_name)
        rows = [self.model.get_submodule(n) for n in row_names if _has_submodule(self.model, n)]
        per_row = sum(self.matmul_weights(m) for m in rows)
        inside = sum(self.matmul_weights(m) for m, n in zip(rows, row_names) if n.startswith(tower_name + "."))
        return self.matmul_weights(tower) - inside, per_row

    def towers(self) -> list[nn.Module]:
        return [self.model]

    def save(self, path: str | Path) -> None:
        save_hf_model(self.model, path)
        self.tokenizer.save_pretrained(path)
        self.image_processor.save_pretrained(path)
        self.write_adapter_file(path)

    @classmethod
    def load(cls, path: str | Path) -> "ClipAdapter":
        settings = saved_settings(path, cls.model_type)
        trust = settings.get("trust_remote_code", False)
        model = load_model(
            str(path),
            None,
            key="model",
            trust_remote_code=trust,
            attn_implementation=settings.get("attn_implementation"),
            model_type=cls.model_type,
        )
        return cls(model, load_tokenizer(str(path), trust), load_image_processor(str(path), trust), **settings)


def _has_submodule(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True
