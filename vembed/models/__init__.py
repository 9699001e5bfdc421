"""Model adapters, chosen by `model_type` through the MODELS registry (one file per adapter)."""

from vembed.models.base import EmbeddingAdapter, load_adapter
from vembed.registry import Registry

MODELS: Registry[type[EmbeddingAdapter]] = Registry(
    "model_type",
    modules=("vembed.models.clip", "vembed.models.siglip", "vembed.models.text", "vembed.models.composed",
             "vembed.models.qwen_vl", "vembed.models.vision"),
)

__all__ = ["MODELS", "EmbeddingAdapter", "load_adapter"]
