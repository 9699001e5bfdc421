"""What model_type vision needs to know of each transformers vision family, in one table: its output's shape, what
its pooled output is, whether it has a CLS token, where its width and its stochastic-depth rate sit in the config,
and which modules only its own pooled output reaches. The adapter (vembed/models/vision.py) reads these facts and
branches on no model names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class VisionFamily:
    pooler: str  # what its pooler_output is, in words (said when `pooling: cls` is refused)
    width: str = "hidden_size"  # config key of the pooled width (a list: its last stage's)
    # What `pooling: cls` reads: the CLS token, the model's own pooling head standing in for a CLS token it lacks
    # (SigLIP), or nothing (refused: CNNs and Swin have no CLS token).
    cls: Literal["token", "pooler"] | None = "token"
    feature_map: bool = False  # last_hidden_state is a (B, C, H, W) feature map, not (B, N, C) tokens
    default_pooling: Literal["cls", "mean", "gem", "pooler"] = "cls"  # when the recipe sets no pooling
    drop_path: str | None = None  # config key of its stochastic-depth (drop-path) rate; None: it has none
    # Modules (paths in the model) only pooler_output passes through: frozen under the other poolings (DDP fails on
    # trainable parameters that get no gradient).
    pooler_only: tuple[str, ...] = ()
    # Parameters only masked-image modelling reads (DINOv2 builds its mask token always): frozen likewise.
    masking_only: tuple[str, ...] = ()

    def reads_pooler(self, pooling: str) -> bool:
        return pooling == "pooler" or (pooling == "cls" and self.cls == "pooler")

    def width_of(self, config: "PretrainedConfig") -> int:
        width = getattr(config, self.width)
        return int(width[-1] if isinstance(width, (list, tuple)) else width)


_CONVNEXT = VisionFamily(pooler="the layer-normed global average", width="hidden_sizes", cls=None, feature_map=True,
                         default_pooling="pooler", drop_path="drop_path_rate", pooler_only=("layernorm",))
_SWIN = VisionFamily(pooler="the mean of its layer-normed tokens", cls=None, default_pooling="pooler",
                     drop_path="drop_path_rate")
_DINOV2 = VisionFamily(pooler="the layer-normed CLS token", drop_path="drop_path_rate",
                       masking_only=("embeddings.mask_token",))
_SIGLIP = VisionFamily(pooler="its attention-pooling head", cls="pooler", pooler_only=("head", "vision_model.head"))

FAMILIES: dict[str, VisionFamily] = {  # by the HF config's model_type
    "vit": VisionFamily(pooler="a dense+tanh layer on the CLS token", pooler_only=("pooler",)),
    "dinov2": _DINOV2,
    "dinov2_with_registers": _DINOV2,
    "clip_vision_model": VisionFamily(pooler="the layer-normed CLS token",
                                      pooler_only=("post_layernorm", "vision_model.post_layernorm")),
    "siglip_vision_model": _SIGLIP,
    "siglip2_vision_model": _SIGLIP,
    "convnext": _CONVNEXT,
    "convnextv2": _CONVNEXT,
    "resnet": VisionFamily(pooler="the global average", width="hidden_sizes", cls=None, feature_map=True,
                           default_pooling="pooler"),
    "efficientnet": VisionFamily(pooler="the global average (max with pooling_type: max)", width="hidden_dim",
                                 cls=None, feature_map=True, default_pooling="pooler", drop_path="drop_connect_rate"),
    "swin": _SWIN,
    "swinv2": _SWIN,
}
# A ViT-like tower not listed (deit, beit, ...): CLS, then DINOv2-style registers when its config has some, then
# patches; a drop-path rate when its config has drop_path_rate.
TOKENS = VisionFamily(pooler="its own pooled output", drop_path="drop_path_rate")


def family_of(config: "PretrainedConfig") -> VisionFamily:
    """The family of a vision backbone's config (a dual encoder's: its vision tower's)."""
    config = getattr(config, "vision_config", None) or config
    return FAMILIES.get(config.model_type, TOKENS)


def drop_path_key(config: "PretrainedConfig") -> str | None:
    """The config key of this backbone's stochastic-depth rate, None when it has none."""
    key = family_of(config).drop_path
    return key if key is not None and hasattr(config, key) else None


__all__ = ["FAMILIES", "TOKENS", "VisionFamily", "drop_path_key", "family_of"]
