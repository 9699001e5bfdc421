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
from vembed.models.base import TransformersAdapter
from vembed.models.batch import PIXEL_VALUES, combine, forward_argument_names, make_batch, text_inputs
from vembed.models.hf import clip_image_processor

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

    from vembed.data.records import Side
    from vembed.models.base import PretrainedSettings


@MODELS.register("clip")
class ClipAdapter(TransformersAdapter):
    """A CLIP-style dual encoder. SigLIP subclasses it, changing only the class attributes and hooks below."""

    model_type = "clip"
    hf_model_type = "clip"
    modalities = frozenset({"text", "image"})
    modalities_per_record = modalities  # a dual encoder: a text-only (or image-only) step leaves a tower idle
    default_lora_target_modules = ("q_proj", "k_proj", "v_proj", "out_proj")  # the attention projections, both towers
    text_padding: ClassVar[str] = "longest"  # CLIP pools at the EOS token under a causal mask, so padding is free
    length_chunking: ClassVar[bool] = True
    image_cache: ClassVar[bool] = True
    # The HF model's own contrastive-loss scalars. The vembed loss owns the temperature, so these get no gradient;
    # DDP (without find_unused_parameters) fails on trainable parameters without a gradient, so they are frozen.
    unused_parameters: ClassVar[tuple[str, ...]] = ("logit_scale",)

    def __init__(self, model: "PreTrainedModel", tokenizer: Any, image_processor: Any, settings: "PretrainedSettings"):
        super().__init__(model, tokenizer, image_processor, settings)
        for name in self.unused_parameters:
            getattr(model, name).requires_grad_(False)
        self._text_keys = forward_argument_names(model.get_text_features)

    @classmethod
    def embedding_dim_of(cls, config: "PretrainedConfig") -> int:
        return config.projection_dim

    @classmethod
    def new_image_processor(cls, config: "PretrainedConfig") -> Any:
        return clip_image_processor(config.vision_config.image_size)

    @classmethod
    def sentence_transformers_modules(cls, path: Path, info: dict[str, Any], trust_remote_code: bool) -> list[Any]:
        """Transformer (its CLIP/SigLIP modality config: get_text_features / get_image_features) [-> Normalize], texts
        padded as this adapter pads them. A side with text and image has no sentence-transformers equivalent (it
        fuses the two here); text-only and image-only inputs match."""
        from vembed.models import sentence_transformers as st

        processing = {"text": {"padding": "max_length"}} if cls.text_padding == "max_length" else None
        settings = info["settings"]
        return [st.transformer(path, settings, trust_remote_code, processing_kwargs=processing),
                *st.normalize(settings)]

    @classmethod
    def transformers_example(cls, path: str, settings: dict[str, Any], texts: list[str]) -> str | None:
        """The HF model's own text/image features, tokenised as this adapter tokenises (its padding and max_length);
        only the input_ids and attention_mask reach the text tower."""
        normalize = "\nembeddings = torch.nn.functional.normalize(embeddings, dim=-1)" if settings.get(
            "normalize", True) else ""
        return (
            "import torch\n"
            "from transformers import AutoImageProcessor, AutoModel, AutoTokenizer\n"
            f"model, tokenizer = AutoModel.from_pretrained({path!r}).eval(), AutoTokenizer.from_pretrained({path!r})\n"
            f"tokens = tokenizer({texts!r}, padding={cls.text_padding!r}, truncation=True, "
            f"max_length={settings.get('max_length')}, return_tensors=\"pt\")\n"
            "with torch.no_grad():\n"
            "    embeddings = model.get_text_features(input_ids=tokens[\"input_ids\"], "
            "attention_mask=tokens[\"attention_mask\"]).pooler_output"
            f"{normalize}\n"
            f"# images: pixels = AutoImageProcessor.from_pretrained({path!r})(images, return_tensors=\"pt\")"
            "[\"pixel_values\"]\n"
            "#         model.get_image_features(pixel_values=pixels).pooler_output"
        )

    def encoder_configs(self) -> "dict[str, PretrainedConfig]":
        return {"text": self.model.config.text_config, "image": self.model.config.vision_config}

    # --- used by the loop ------------------------------------------------------------------------------------------
    def preprocess(self, sides: Sequence["Side"]) -> dict[str, torch.Tensor]:
        return make_batch(
            sides,
            self.tokenizer,
            self.image_processor,
            max_length=self.settings.max_length,
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
        return combine(text, image, inputs, self.settings.normalize)

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

    def compiled_modules(self) -> list[nn.Module]:
        """The text and vision transformers: `encode` reaches them through get_text_features / get_image_features,
        never CLIPModel.forward (the projections after them are one matmul each)."""
        return [self.model.get_submodule(tower) for tower, _ in self.flops_parts.values()]

    def _weights(self, modality: str) -> tuple[int, int]:
        """(weights applied per token, weights applied per row) of one modality."""
        tower_name, row_names = self.flops_parts[modality]
        tower = self.model.get_submodule(tower_name)
        rows = [self.model.get_submodule(n) for n in row_names if _has_submodule(self.model, n)]
        per_row = sum(self.matmul_weights(m) for m in rows)
        inside = sum(self.matmul_weights(m) for m, n in zip(rows, row_names) if n.startswith(tower_name + "."))
        return self.matmul_weights(tower) - inside, per_row


def _has_submodule(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True
