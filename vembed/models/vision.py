"""Images alone: a Hugging Face vision backbone (ViT, DINOv2 with or without registers, the vision tower of CLIP or
SigLIP, ConvNeXt (v1, v2), ResNet, EfficientNet, Swin (v1, v2)) built through transformers' Auto classes, its tokens
or feature map pooled into one vector (what each family's output is: vembed/models/vision_families.py), optionally
projected, and, when the recipe names classes, a linear classification head on top (the `classification` task,
vembed/classification/task.py). Without a head, its embeddings are what a metric-learning loss trains (the
`metric_learning` task, vembed/classification/metric_task.py).

Given a whole CLIP/SigLIP model, the backbone is its image side (vision tower, pooled and projected as that model
embeds images), and `head_init: class_names` starts the head from its text tower's embeddings of the class names.

Saved as the backbone's HF folder (loadable by `AutoModel` on its own) plus `heads.safetensors` (projection and
classifier, when present); the class names are in vembed.json.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, field_validator
from torch import nn

from vembed.errors import RecipeError
from vembed.models import MODELS
from vembed.models.base import PretrainedSettings, TransformersAdapter, require_tokenizer_name
from vembed.models.batch import IMAGE_INDEX, PIXEL_VALUES, TEXT_INDEX, process_images, split_sides
from vembed.models.hf import clip_image_processor, load_image_processor, load_model, load_tokenizer, save_hf_model
from vembed.models.vision_families import FAMILIES, drop_path_key, family_of
from vembed.recipe import InvalidKey

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

    from vembed.data.records import Side
    from vembed.models.clip import ClipAdapter
    from vembed.recipe import Recipe

HEADS_FILE = "heads.safetensors"
DEFAULT_IMAGE_SIZE = 224  # a random-init backbone whose config names no image size (ResNet) sees ImageNet's
PROMPTS_PER_FORWARD = 256  # class-name prompts embedded per text-tower forward (head_init: class_names)


def dual_encoder_of(config: "PretrainedConfig") -> "type[ClipAdapter] | None":
    """The adapter of a CLIP-style dual encoder with this HF config (clip, siglip: the registered ClipAdapter
    subclasses), whose image side is then the backbone; None for a vision tower."""
    from vembed.models.clip import ClipAdapter

    adapter = MODELS.get(config.model_type) if config.model_type in MODELS else None
    if isinstance(adapter, type) and issubclass(adapter, ClipAdapter) and adapter.hf_model_type == config.model_type:
        return adapter
    return None


class VisionSettings(PretrainedSettings):
    """`model_type: vision`: a vision backbone from `model_name` or `model_config` (e.g. `model_type: vit` or
    `dinov2` inside it), pooled and optionally projected and classified."""

    # CLS token / mean of patch tokens (of a CNN's feature map: over its positions) / generalised mean of those / the
    # backbone's own pooled output (pooler_output: CLIP's layer-normed CLS, SigLIP's attention-pooling head, DINOv2's
    # normed CLS, ViT's dense+tanh; ConvNeXt's layer-normed global average, ResNet's and EfficientNet's global
    # average, Swin's mean of its normed tokens). Unset: the family's own, cls for ViT, DINOv2, CLIP and SigLIP (whose
    # cls is its pooling head: it has no CLS token), pooler for ConvNeXt, ResNet, EfficientNet and Swin, which have
    # no CLS token (cls is refused there).
    pooling: Literal["cls", "mean", "gem", "pooler"] | None = None
    gem_p: float = Field(default=3.0, gt=0)  # GeM's exponent (1: mean; large: towards max)
    # Stochastic depth: the backbone config's drop-path rate (the last block's; earlier blocks drop less), set when the
    # model is built from model_name or model_config: drop_path_rate for DINOv2, ConvNeXt and Swin, drop_connect_rate
    # for EfficientNet (transformers applies it as dropout on each block's output). ViT, CLIP, SigLIP and ResNet have
    # none (refused above 0). Unset: the config's own value (Swin's default is 0.1, EfficientNet's 0.2).
    stochastic_depth: float | None = Field(default=None, ge=0, lt=1)
    projection_dim: int | None = Field(default=None, gt=0)  # a linear projection after pooling (unset: none)
    # Train only what sits on the backbone (projection, classification head): a linear probe, the backbone's weights
    # as loaded. It is still saved whole, so final/ is the same complete model.
    freeze_backbone: bool = False
    # The classification head: classes it predicts (the classification task checks them against its data) and their
    # names, in label-id order (filled from the data when unset).
    num_labels: int | None = Field(default=None, gt=0)
    label_names: list[str] | None = None
    # How the head starts: `random` (nn.Linear's init), or `class_names`: row c is the normalised text embedding of
    # class_name_template filled with class c's name, by the text tower of the CLIP/SigLIP model that model_name (or
    # model_config) names, times its logit scale (bias 0; SigLIP: its logit bias), so step 0 classifies as that
    # model's zero-shot does. Such a head reads the L2-normalised image embedding, in training and once saved.
    head_init: Literal["random", "class_names"] = "random"
    class_name_template: str = "a photo of a {}."  # each class's prompt ({} is its name) for head_init: class_names

    @field_validator("class_name_template")
    @classmethod
    def _one_name_slot(cls, template: str) -> str:
        from string import Formatter

        try:
            fields = [field for _, field, _, _ in Formatter().parse(template) if field is not None]
        except ValueError:  # an unmatched brace
            fields = []
        if fields != [""]:
            raise InvalidKey("class_name_template", f"{template!r} needs one {{}} where the class name goes and no "
                                                    "other braces, e.g. 'a photo of a {}.'")
        return template


@MODELS.register("vision")
class VisionAdapter(TransformersAdapter):
    model_type = "vision"
    task: ClassVar[str] = "classification"  # vembed.tasks: trained by the classification task
    # ... or, without a head, by the metric_learning task (vembed/classification/metric_task.py): the loss picks which.
    tasks: ClassVar[tuple[str, ...]] = ("classification", "metric_learning")
    Settings: ClassVar[type[VisionSettings]] = VisionSettings
    modalities = frozenset({"image"})
    image_cache: ClassVar[bool] = True
    default_lora_target_modules = ("query", "key", "value", "q_proj", "k_proj", "v_proj")

    def __init__(self, model: "PreTrainedModel", tokenizer: Any, image_processor: Any, settings: VisionSettings):
        settings = settings.model_copy(update={"pooling": self.pooling_of(settings, model.config)})
        super().__init__(model, tokenizer, image_processor, settings)
        width = self.hidden_size(model.config)
        self.projection = nn.Linear(width, settings.projection_dim, bias=False) if settings.projection_dim else None
        dim = settings.projection_dim or width
        self.classifier = nn.Linear(dim, settings.num_labels) if settings.num_labels else None
        # Parts of the backbone this pooling never reaches get no gradient; DDP (without find_unused_parameters)
        # fails on those, so they are frozen (still saved: the folder stays a complete HF model).
        for name in self.unreached_parameters(model, settings.pooling):
            model.get_parameter(name).requires_grad_(False)
        if settings.freeze_backbone:
            model.requires_grad_(False)

    # --- what the config says --------------------------------------------------------------------------------------
    @staticmethod
    def hidden_size(config: "PretrainedConfig") -> int:
        return family_of(config).width_of(config)

    @staticmethod
    def pooling_of(settings: VisionSettings, config: "PretrainedConfig") -> str:
        """The recipe's pooling, or, unset, the backbone family's own."""
        return settings.pooling or family_of(config).default_pooling

    @classmethod
    def embedding_dim_of(cls, config: "PretrainedConfig") -> int:
        return cls.hidden_size(config)

    @classmethod
    def embedding_dim_for(cls, recipe: "Recipe") -> int:
        settings = cls.settings_of(recipe)
        config = cls.hf_config(settings)
        dual = dual_encoder_of(config)
        if dual is not None:
            return dual.embedding_dim_of(config)
        return settings.projection_dim or cls.hidden_size(config)

    @property
    def embedding_dim(self) -> int:
        return self.settings.projection_dim or self.hidden_size(self.model.config)

    @staticmethod
    def prefix_tokens(config: "PretrainedConfig") -> int:
        """Tokens before the patches: CLS and DINOv2's registers (none in SigLIP, Swin or a CNN's feature map)."""
        if family_of(config).cls != "token":
            return 0
        return 1 + int(getattr(config, "num_register_tokens", 0) or 0)

    @classmethod
    def unreached_parameters(cls, model: nn.Module, pooling: str) -> list[str]:
        """Parameters no forward of this adapter reaches: DINOv2's mask token (masked-image modelling only), and
        those of modules only the backbone's own pooled output passes through (ViT's dense+tanh pooler, SigLIP's
        pooling head, CLIP's and ConvNeXt's final layer norm) when this pooling does not read it."""
        family = family_of(model.config)
        modules = () if family.reads_pooler(pooling) else family.pooler_only
        return [name for name, _ in model.named_parameters()
                if name in family.masking_only or any(name.startswith(f"{module}.") for module in modules)]

    @classmethod
    def check_config(cls, config: "PretrainedConfig", key: str) -> None:
        if dual_encoder_of(config) is not None:
            return
        if getattr(config, "vision_config", None) is not None or (config.model_type not in FAMILIES
                                                                   and not hasattr(config, "hidden_size")):
            raise RecipeError(key, f"{config.model_type!r} is not a vision backbone; name one ({', '.join(FAMILIES)}, "
                                   "or another ViT-like tower) or a whole clip or siglip model (its image side)")

    @classmethod
    def hf_config(cls, settings: VisionSettings, tokenizer: Any = None) -> "PretrainedConfig":
        """The backbone's config with the recipe's stochastic depth (check_recipe refuses it where there is none)."""
        config = super().hf_config(settings, tokenizer)
        key = drop_path_key(config)
        if settings.stochastic_depth is not None and key is not None:
            setattr(config, key, settings.stochastic_depth)
        return config

    @classmethod
    def new_image_processor(cls, config: "PretrainedConfig") -> Any:
        # A random-init model has no preprocessing of its own to match; ResNet's config has no image size.
        return clip_image_processor(getattr(config, "image_size", None) or DEFAULT_IMAGE_SIZE)

    # --- built from a recipe / a folder ----------------------------------------------------------------------------
    @classmethod
    def check_recipe(cls, recipe: "Recipe") -> None:
        settings = cls.settings_of(recipe)
        if (settings.model_name is None) == (settings.model_config_dict is None):
            raise RecipeError("model_name", "model_type 'vision' needs exactly one of model_name (pretrained) or "
                                            "model_config (random init)")
        if settings.model_config_dict is not None:
            from vembed.models.hf import require_model_type

            require_model_type(settings.model_config_dict, "model_config")
        if settings.label_names is not None and settings.num_labels not in (None, len(settings.label_names)):
            raise RecipeError("label_names", f"names {len(settings.label_names)} classes but num_labels is "
                                             f"{settings.num_labels}; give one name per class")
        if settings.freeze_backbone:
            for wasted, value in (("use_lora", recipe.use_lora), ("gradient_checkpointing",
                                                                   recipe.gradient_checkpointing)):
                if value:
                    raise RecipeError(wasted, "trains or recomputes the backbone, which freeze_backbone keeps as "
                                              "loaded; remove one of them")
        key = "model_name" if settings.model_name is not None else "model_config"
        config = cls.hf_config(settings)
        if settings.stochastic_depth and drop_path_key(config) is None:
            raise RecipeError("stochastic_depth", f"sets a drop-path rate, which {config.model_type!r} models do not "
                                                  "have; remove it (it is for DINOv2, ConvNeXt, EfficientNet, Swin)")
        family = family_of(config)
        if settings.pooling == "cls" and family.cls is None:
            raise RecipeError("pooling", f"cls reads a CLS token, which {config.model_type!r} models do not have; "
                                         f"use pooler ({family.pooler}), mean or gem")
        if dual_encoder_of(config) is None:
            if settings.head_init == "class_names":
                raise RecipeError("head_init", f"class_names embeds the class names with a CLIP/SigLIP text tower, "
                                               f"but {key} builds a {config.model_type!r} model, which has none; point "
                                               f"{key} at a whole clip or siglip model, or use head_init: random")
            return
        # The image side of a dual encoder is its image embedding: pooled and projected as that model does.
        if settings.pooling not in (None, "cls", "pooler") or settings.projection_dim is not None:
            wrong = "projection_dim" if settings.projection_dim is not None else "pooling"
            raise RecipeError(wrong, f"is decided by the {config.model_type} model that {key} names (its image "
                                     "embedding is this backbone's output); remove it")
        if settings.head_init == "class_names" and settings.model_config_dict is not None:
            require_tokenizer_name(settings, "model_config")

    @classmethod
    def from_recipe(cls, recipe: "Recipe") -> "VisionAdapter":
        from transformers import AutoModel

        from vembed.models.hf import hf_kwargs

        cls.check_recipe(recipe)
        settings = cls.settings_of(recipe)
        config = cls.hf_config(settings)
        dual = dual_encoder_of(config)
        if dual is not None:
            return cls.from_dual_encoder(dual, settings)
        if settings.model_name is not None:  # its config with the recipe's stochastic depth
            model = load_model(settings.model_name, None, key="model_name", config=config,
                               trust_remote_code=settings.trust_remote_code,
                               attn_implementation=settings.attn_implementation)
        else:
            model = AutoModel.from_config(config, **hf_kwargs(settings.trust_remote_code, settings.attn_implementation))
        processor = cls.image_processor_for(settings.model_name, model.config, settings)
        return cls(model, None, processor, settings)

    @classmethod
    def from_dual_encoder(cls, dual: "type[ClipAdapter]", settings: VisionSettings) -> "VisionAdapter":
        """The image side of the CLIP/SigLIP model the settings name; its head from the text tower when asked."""
        key = "model_name" if settings.model_name is not None else "model_config"
        model = load_model(settings.model_name, settings.model_config_dict, key=key,
                           trust_remote_code=settings.trust_remote_code,
                           attn_implementation=settings.attn_implementation, model_type=dual.hf_model_type)
        processor = dual.image_processor_for(settings.model_name, model.config, settings)
        adapter = cls.image_side(model, processor, settings)
        if settings.head_init == "class_names":
            tokenizer = load_tokenizer(settings.tokenizer_name or settings.model_name, settings.trust_remote_code)
            text_settings = dual.Settings(max_length=settings.max_length, normalize=True)
            adapter.head_from_class_names(dual(model, tokenizer, None, dual.resolve(text_settings, tokenizer,
                                                                                   model.config)))
        return adapter

    @classmethod
    def image_side(cls, model: "PreTrainedModel", processor: Any, settings: VisionSettings) -> "VisionAdapter":
        """This adapter over a dual encoder's vision tower (itself a complete HF vision model, so the saved folder
        loads with AutoModel), pooled by its own pooling and projected by its projection (CLIP's visual_projection;
        SigLIP's image embedding is the tower's pooled output): its image embedding, as get_image_features gives."""
        projection = getattr(model, "visual_projection", None)
        settings = settings.model_copy(update={
            "pooling": "pooler", "projection_dim": projection.out_features if projection is not None else None})
        adapter = cls(model.vision_model, None, processor, settings)
        if projection is not None:
            adapter.projection = projection
        return adapter

    def head_from_class_names(self, dual: "ClipAdapter") -> None:
        """Row c of the head: the normalised text embedding of class c's prompt times the model's logit scale; the
        bias: SigLIP's logit bias (0 for CLIP). `classify` on the normalised image embedding then gives the dual
        encoder's own zero-shot logits (logits_per_image)."""
        from vembed.data.records import Side

        names = self.settings.label_names
        if self.classifier is None or names is None:
            raise RecipeError("label_names", "head_init: class_names needs the class names (label_names, or the "
                                             "training data's classes as the classification task reads them)")
        if any(hasattr(p, "ds_id") for p in (*dual.parameters(), self.classifier.weight)):
            # Built partitioned (DeepSpeed zero3_init_flag: true): no rank holds a whole text tower or head to write.
            raise RecipeError("head_init", "class_names embeds the class names on each rank, which a model built "
                                           "partitioned cannot; use an accelerate config with zero3_init_flag: false")
        prompts = [self.settings.class_name_template.format(name) for name in names]
        was_training = dual.training
        dual.eval()  # no dropout in the embeddings the head starts from
        with torch.no_grad():
            text = torch.cat([dual.encode(dual.preprocess([Side(text=p) for p in prompts[i:i + PROMPTS_PER_FORWARD]]))
                              for i in range(0, len(prompts), PROMPTS_PER_FORWARD)])
            self.classifier.weight.copy_(text * dual.model.logit_scale.exp())
            bias = getattr(dual.model, "logit_bias", None)
            self.classifier.bias.zero_()
            if bias is not None:
                self.classifier.bias.add_(bias)
        dual.train(was_training)

    @classmethod
    def on_meta(cls, recipe: "Recipe") -> "VisionAdapter":
        from transformers import AutoModel

        from vembed.models.hf import hf_kwargs

        cls.check_recipe(recipe)
        settings = cls.settings_of(recipe)
        config = cls.hf_config(settings)
        if dual_encoder_of(config) is None:
            return super().on_meta(recipe).to("meta")
        with torch.device("meta"):
            model = AutoModel.from_config(config, **hf_kwargs(settings.trust_remote_code, settings.attn_implementation))
        return cls.image_side(model, None, settings).to("meta")

    @classmethod
    def resolve(cls, settings, tokenizer, config):  # no texts, so no max_length to decide
        return settings

    @classmethod
    def load(cls, path: str | Path, *, trust_remote_code: bool = False) -> "VisionAdapter":
        from safetensors.torch import load_file

        info, settings = cls.saved_settings(path, trust_remote_code)
        model = load_model(str(path), None, key="model", trust_remote_code=trust_remote_code,
                           attn_implementation=settings.attn_implementation)
        processor = load_image_processor(str(path), trust_remote_code)
        adapter = cls(model, None, processor, settings)
        heads = Path(path, HEADS_FILE)
        if heads.is_file():
            missing, unexpected = adapter.load_state_dict(load_file(str(heads)), strict=False)
            if unexpected or any(not k.startswith("model.") for k in missing):
                raise RecipeError("model", f"{str(heads)!r} does not fit the model in {str(path)!r}")
        return adapter

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        save_hf_model(self.model, path)
        self.image_processor.save_pretrained(path)
        heads = {f"{name}.{key}": value.detach().cpu().contiguous()
                 for name in ("projection", "classifier") if getattr(self, name) is not None
                 for key, value in getattr(self, name).state_dict().items()}
        if heads:
            save_file(heads, str(Path(path, HEADS_FILE)))
        self.write_adapter_file(path)

    # --- sizes for the memory planner (vembed/planning.py) ---------------------------------------------------------
    def encoder_configs(self) -> "dict[str, PretrainedConfig]":
        return {"image": self.model.config}

    def planning_tokens(self, recipe: "Recipe") -> dict[str, dict[str, int]]:
        """One image per sample through the backbone: its patches plus CLS and registers."""
        from vembed.models.flops import vision_tokens_per_image

        config = self.model.config
        size = getattr(config, "image_size", None) or DEFAULT_IMAGE_SIZE
        patches = vision_tokens_per_image(config, size, size) - 1  # it counts a CLS token
        return {"image": {"image": patches + self.prefix_tokens(config)}}

    # --- used by the loop ------------------------------------------------------------------------------------------
    def preprocess(self, sides: Sequence["Side"]) -> dict[str, torch.Tensor]:
        texts, images, batch = split_sides(sides)
        if texts:
            raise ValueError("model_type vision embeds images only, but the batch has text; use clip, siglip or "
                             "composed for text")
        batch[PIXEL_VALUES] = process_images(images, self.image_processor)
        return batch

    def num_sides(self, inputs: dict[str, torch.Tensor]) -> int:
        return int(inputs[IMAGE_INDEX].shape[0])

    def features(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Pooled (and projected) image vectors, unnormalised: what the classifier reads."""
        pixels = inputs[PIXEL_VALUES].to(self.model.dtype)
        output = self.model(pixel_values=pixels)
        pooled = self.pool(output, self.settings.pooling)
        return self.projection(pooled) if self.projection is not None else pooled

    def pool(self, output: Any, pooling: str) -> torch.Tensor:
        family = family_of(self.model.config)
        if family.reads_pooler(pooling):
            return output.pooler_output.flatten(1)  # ResNet's is (B, C, 1, 1)
        hidden = output.last_hidden_state
        if family.feature_map:  # (B, C, H, W): its positions are the patches
            hidden = hidden.flatten(2).transpose(1, 2)
        prefix = self.prefix_tokens(self.model.config)
        if pooling == "cls":
            return hidden[:, 0]
        patches = hidden[:, prefix:].float()
        if pooling == "mean":
            return patches.mean(1).to(hidden.dtype)
        p = self.settings.gem_p  # GeM: (mean x^p)^(1/p) over patches, on features clamped positive
        return patches.clamp(min=1e-6).pow(p).mean(1).pow(1.0 / p).to(hidden.dtype)

    def encode(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        embeddings = self.features(inputs).float()
        return F.normalize(embeddings, dim=-1) if self.settings.normalize else embeddings

    def classify(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Class logits `(n, num_labels)` in float32."""
        if self.classifier is None:
            raise RecipeError("num_labels", "this vision model has no classification head; set num_labels")
        features = self.features(inputs)
        if self.settings.head_init == "class_names":  # rows of text embeddings score cosines, as zero-shot CLIP does
            features = F.normalize(features.float(), dim=-1)
        return self.classifier(features).float()

    def forward_flops(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor | int:
        from vembed.models.flops import vision_flops

        heads = sum(self.matmul_weights(m) for m in (self.projection, self.classifier) if m is not None)
        return vision_flops(self.model.config, self.matmul_weights(self.model), heads, inputs[PIXEL_VALUES])


__all__ = ["HEADS_FILE", "TEXT_INDEX", "VisionAdapter", "VisionSettings"]
