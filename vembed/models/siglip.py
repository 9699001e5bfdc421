"""SigLIP as an embedding model: the HF `SiglipModel` towers, handled like CLIP (same batch layout and fusion).

What differs from CLIP: texts are padded to a fixed length, the embedding size is the vision width, and both of
SigLIP's loss scalars (logit_scale, logit_bias) are frozen.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from vembed.errors import RecipeError
from vembed.models import MODELS
from vembed.models.clip import ClipAdapter

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@MODELS.register("siglip")
class SiglipAdapter(ClipAdapter):
    model_type = "siglip"
    hf_model_type = "siglip"
    # SigLIP pools the text at the LAST position and was trained on texts padded to a fixed length; padding to the
    # batch's longest text would make a text's embedding depend on its batch-mates.
    text_padding: ClassVar[str] = "max_length"
    length_chunking: ClassVar[bool] = False  # the last position is pooled: cutting padding would move it
    unused_parameters: ClassVar[tuple[str, ...]] = ("logit_scale", "logit_bias")  # the vembed loss owns these
    # The towers' pooling heads (text: a linear on the last token; vision: attention pooling) run once per row.
    flops_parts: ClassVar[dict[str, tuple[str, tuple[str, ...]]]] = {
        "text": ("text_model", ("text_model.head",)),
        "vision": ("vision_model", ("vision_model.head",)),
    }

    @classmethod
    def embedding_dim_of(cls, config: "PretrainedConfig") -> int:
        return config.vision_config.hidden_size

    @classmethod
    def check_config(cls, config: "PretrainedConfig", key: str) -> None:
        text_dim, vision_dim = config.text_config.projection_size, config.vision_config.hidden_size
        if text_dim != vision_dim:
            raise RecipeError(key, f"text_config.projection_size ({text_dim}) must equal vision_config.hidden_size "
                                   f"({vision_dim}): text and image embeddings share one space")

    @classmethod
    def new_image_processor(cls, config: "PretrainedConfig") -> Any:
        from transformers import SiglipImageProcessorPil

        size = config.vision_config.image_size
        return SiglipImageProcessorPil(size={"height": size, "width": size})  # SigLIP resizes straight to a square
