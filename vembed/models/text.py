"""A text-only embedding model: any HF text encoder (`AutoModel`: BERT, BGE, MiniLM, ...) with cls, mean or last-token
pooling. Sides with images are rejected."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from vembed.models import MODELS
from vembed.models.base import COMPOSED_ONLY_KEYS, EmbeddingAdapter, reject_keys, require_tokenizer_name, saved_settings
from vembed.models.batch import forward_argument_names, make_batch
from vembed.models.hf import (
    auto_config,
    freeze_unused_pooler,
    hf_kwargs,
    load_model,
    load_tokenizer,
    require_model_type,
    resolve_max_length,
    save_hf_model,
)
from vembed.models.lora import ATTENTION_PROJECTIONS
from vembed.models.pooling import pool

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

    from vembed.data.records import Side
    from vembed.recipe import Recipe

@MODELS.register("text")
class TextAdapter(EmbeddingAdapter):
    model_type = "text"
    default_lora_target_modules = ATTENTION_PROJECTIONS

    def __init__(
        self,
        model: "PreTrainedModel",
        tokenizer: Any,
        *,
        pooling: str = "mean",
        normalize: bool = True,
        max_length: int | None = None,
        trust_remote_code: bool = False,
        attn_implementation: str | None = None,
    ):
        super().__init__(normalize=normalize, max_length=max_length, trust_remote_code=trust_remote_code,
                         attn_implementation=attn_implementation)
        self.model = model
        self.tokenizer = tokenizer
        self.pooling = pooling
        freeze_unused_pooler(model)
        self._text_keys = forward_argument_names(model.forward)

    # --- built from a recipe ---------------------------------------------------------------------------------------
    @classmethod
    def check_recipe(cls, recipe: "Recipe") -> None:
        super().check_recipe(recipe)
        reject_keys(recipe, COMPOSED_ONLY_KEYS, cls.model_type, "composed")
        if recipe.model_config_dict is not None:
            require_model_type(recipe.model_config_dict, "model_config")
            require_tokenizer_name(recipe, "model_config")

    @classmethod
    def embedding_dim_for(cls, recipe: "Recipe") -> int:
        key = "model_name" if recipe.model_name else "model_config"
        config = auto_config(
            recipe.model_name, recipe.model_config_dict, key=key, trust_remote_code=recipe.trust_remote_code
        )
        return config.hidden_size

    @classmethod
    def from_recipe(cls, recipe: "Recipe") -> "TextAdapter":
        cls.check_recipe(recipe)
        model = load_model(
            recipe.model_name,
            recipe.model_config_dict,
            key="model_name" if recipe.model_name else "model_config",
            trust_remote_code=recipe.trust_remote_code,
            attn_implementation=recipe.attn_implementation,
        )
        tokenizer = load_tokenizer(recipe.tokenizer_name or recipe.model_name, recipe.trust_remote_code)
        return cls(
            model,
            tokenizer,
            pooling=recipe.pooling,
            normalize=recipe.normalize,
            max_length=resolve_max_length(recipe.max_length, tokenizer, model.config),
            trust_remote_code=recipe.trust_remote_code,
            attn_implementation=recipe.attn_implementation,
        )

    @classmethod
    def on_meta(cls, recipe: "Recipe") -> "TextAdapter":
        from transformers import AutoModel

        cls.check_recipe(recipe)
        key = "model_name" if recipe.model_name else "model_config"
        config = auto_config(
            recipe.model_name, recipe.model_config_dict, key=key, trust_remote_code=recipe.trust_remote_code
        )
        with torch.device("meta"):
            model = AutoModel.from_config(config, **hf_kwargs(recipe.trust_remote_code, recipe.attn_implementation))
        max_length = resolve_max_length(recipe.max_length, None, config)
        return cls(model, None, pooling=recipe.pooling, normalize=recipe.normalize, max_length=max_length)

    def encoder_configs(self) -> "dict[str, PretrainedConfig]":
        return {"text": self.model.config}

    # --- used by the loop ------------------------------------------------------------------------------------------
    @property
    def embedding_dim(self) -> int:
        return self.model.config.hidden_size

    def preprocess(self, sides: Sequence["Side"]) -> dict[str, torch.Tensor]:
        # No image processor: a side with an image is a ValueError naming the adapters that take images.
        return make_batch(sides, self.tokenizer, None, max_length=self.max_length, text_keys=self._text_keys)

    def encode(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        tokens = {key: value for key, value in inputs.items() if key in self._text_keys}
        hidden = self.model(**tokens).last_hidden_state
        # Every side has text, so TEXT_INDEX is 0..n-1 and rows are already in side order.
        embeddings = pool(hidden, tokens.get("attention_mask"), self.pooling).float()
        return F.normalize(embeddings, dim=-1) if self.normalize else embeddings

    def towers(self) -> list[nn.Module]:
        return [self.model]

    # --- persistence -----------------------------------------------------------------------------------------------
    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "pooling": self.pooling}

    def save(self, path: str | Path) -> None:
        save_hf_model(self.model, path)
        self.tokenizer.save_pretrained(path)
        self.write_adapter_file(path)

    @classmethod
    def load(cls, path: str | Path) -> "TextAdapter":
        settings = saved_settings(path, cls.model_type)
        trust = settings.get("trust_remote_code", False)
        attention = settings.get("attn_implementation")
        model = load_model(str(path), None, key="model", trust_remote_code=trust, attn_implementation=attention)
        return cls(model, load_tokenizer(str(path), trust), **settings)
