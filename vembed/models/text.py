"""A text-only embedding model: any HF text encoder (`AutoModel`: BERT, BGE, MiniLM, ...) with cls, mean or last-token
pooling. Sides with images are rejected."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
import torch.nn.functional as F

from vembed.models import MODELS
from vembed.models.base import PretrainedSettings, TransformersAdapter
from vembed.models.batch import forward_argument_names, make_batch
from vembed.models.hf import freeze_unused_pooler
from vembed.models.lora import ATTENTION_PROJECTIONS
from vembed.models.pooling import pool

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

    from vembed.data.records import Side


class TextSettings(PretrainedSettings):
    pooling: Literal["cls", "mean", "last"] = "mean"  # cls: first token; mean: attended tokens; last: last attended


@MODELS.register("text")
class TextAdapter(TransformersAdapter):
    model_type = "text"
    Settings: ClassVar[type[TextSettings]] = TextSettings
    default_lora_target_modules = ATTENTION_PROJECTIONS
    length_chunking: ClassVar[bool] = True  # every pooling reads the attention mask
    modalities_per_record = frozenset({"text"})  # its one tower: a streamed record without text cannot be embedded

    def __init__(self, model: "PreTrainedModel", tokenizer: Any, image_processor: None, settings: TextSettings):
        super().__init__(model, tokenizer, None, settings)
        freeze_unused_pooler(model)
        self._text_keys = forward_argument_names(model.forward)

    @classmethod
    def embedding_dim_of(cls, config: "PretrainedConfig") -> int:
        return config.hidden_size

    @classmethod
    def sentence_transformers_modules(cls, path: Path, info: dict[str, Any], trust_remote_code: bool) -> list[Any]:
        """Transformer -> Pooling (this adapter's pooling) [-> Normalize]."""
        from vembed.models import sentence_transformers as st

        settings = info["settings"]
        return [st.transformer(path, settings, trust_remote_code),
                st.pooling(info["embedding_dim"], settings.get("pooling", "mean")), *st.normalize(settings)]

    @classmethod
    def transformers_example(cls, path: str, settings: dict[str, Any], texts: list[str]) -> str | None:
        """The encoder's last hidden states, pooled as this adapter pools them (`vembed/models/pooling.py`)."""
        pooling = settings.get("pooling", "mean")
        pooled = {
            "mean": "mask = tokens[\"attention_mask\"].unsqueeze(-1).float()\n"
                    "embeddings = (hidden * mask).sum(1) / mask.sum(1)  # mean over attended tokens",
            "cls": "embeddings = hidden[:, 0]  # the first token (right padding)",
            "last": "last = tokens[\"attention_mask\"].sum(1) - 1  # the last attended token (right padding)\n"
                    "embeddings = hidden[torch.arange(len(hidden)), last]",
        }[pooling]
        normalize = "\nembeddings = torch.nn.functional.normalize(embeddings, dim=-1)" if settings.get(
            "normalize", True) else ""
        return (
            "import torch\n"
            "from transformers import AutoModel, AutoTokenizer\n"
            f"model, tokenizer = AutoModel.from_pretrained({path!r}).eval(), AutoTokenizer.from_pretrained({path!r})\n"
            f"tokens = tokenizer({texts!r}, padding=True, truncation=True, max_length={settings.get('max_length')}, "
            "return_tensors=\"pt\")\n"
            "with torch.no_grad():\n"
            "    hidden = model(**tokens).last_hidden_state\n"
            f"{pooled}{normalize}"
        )

    def encoder_configs(self) -> "dict[str, PretrainedConfig]":
        return {"text": self.model.config}

    def preprocess(self, sides: Sequence["Side"]) -> dict[str, torch.Tensor]:
        # No image processor: a side with an image is a ValueError naming the adapters that take images.
        return make_batch(sides, self.tokenizer, None, max_length=self.settings.max_length, text_keys=self._text_keys)

    def encode(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        tokens = {key: value for key, value in inputs.items() if key in self._text_keys}
        hidden = self.model(**tokens).last_hidden_state
        # Every side has text, so TEXT_INDEX is 0..n-1 and rows are already in side order.
        embeddings = pool(hidden, tokens.get("attention_mask"), self.settings.pooling).float()
        return F.normalize(embeddings, dim=-1) if self.settings.normalize else embeddings
