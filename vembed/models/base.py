"""The adapter contract: build from a recipe, preprocess sides, encode, save, load.

Everything model-specific (processors, pooling, fusion of text+image, which modules LoRA targets) lives in the
adapter's own file. The training loop only ever calls the methods below.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from vembed.errors import RecipeError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from vembed.data.records import Side
    from vembed.recipe import Recipe

ADAPTER_FILE = "vembed.json"  # written beside the HF files of every saved model; names the adapter and its settings


class EmbeddingAdapter(nn.Module, ABC):
    """An embedding model as the loop sees it.

    Contract:
    - `from_recipe(recipe)` builds it from `model_name` (pretrained) or `model_config` (random init).
    - `preprocess(sides)` turns a list of `Side`s into a dict of CPU tensors (runs in DataLoader workers).
    - `forward(inputs)` / `encode(inputs)` return a `(len(sides), embedding_dim)` float tensor, in the order of the
      sides, L2-normalised when the recipe says `normalize: true`.
    - `save(path)` writes HF files loadable by transformers plus `vembed.json`; `load(path)` reads them back.
    - `slice_batch(inputs, start, stop)` cuts a preprocessed batch into chunks (GradCache); `block_classes()` names
      the blocks FSDP wraps.
    """

    model_type: ClassVar[str]  # the registry name, set by each adapter
    default_lora_target_modules: ClassVar[tuple[str, ...]] = ()
    # One tower per modality; a step that feeds no side of a modality leaves that tower without gradients.
    modalities: ClassVar[frozenset[str]] = frozenset({"text"})
    # Images one side may hold (None: any number); data with more is refused when it is loaded, naming the row.
    max_images_per_side: ClassVar[int | None] = 1

    def __init__(
        self,
        *,
        normalize: bool = True,
        max_length: int | None = None,
        trust_remote_code: bool = False,
        attn_implementation: str | None = None,
    ):
        """The settings every adapter has; `settings()` saves them and `load` passes them back."""
        super().__init__()
        self.normalize = normalize
        self.max_length = max_length
        self.trust_remote_code = trust_remote_code
        self.attn_implementation = attn_implementation

    # --- built from a recipe ---------------------------------------------------------------------------------------
    @classmethod
    def check_recipe(cls, recipe: "Recipe") -> None:
        """Adapter-specific recipe checks, before anything is built. Default: exactly one of model_name/model_config."""
        if (recipe.model_name is None) == (recipe.model_config_dict is None):
            raise RecipeError(
                "model_name",
                f"model_type {cls.model_type!r} needs exactly one of model_name (pretrained) or model_config "
                "(random init)",
            )

    @classmethod
    @abstractmethod
    def embedding_dim_for(cls, recipe: "Recipe") -> int:
        """The embedding size this recipe will produce, read from configs only (no weights)."""

    @classmethod
    @abstractmethod
    def from_recipe(cls, recipe: "Recipe") -> "EmbeddingAdapter":
        ...

    # --- sizes for the memory planner (vembed/planning.py) ---------------------------------------------------------
    @classmethod
    def on_meta(cls, recipe: "Recipe") -> "EmbeddingAdapter":
        """This recipe's adapter built from configs on the meta device: every parameter has its real shape and
        `requires_grad`, but no storage, and no weights or tokenizer are read (tokenizer/processor are None, so it
        cannot encode). `apply_lora(recipe)` works on it, which gives the exact LoRA parameter count."""
        raise NotImplementedError(f"model_type {cls.model_type!r} cannot be planned: it does not implement on_meta")

    def encoder_configs(self) -> "dict[str, PretrainedConfig]":
        """The HF config of the transformer that embeds each modality (`text`, `image`): the planner reads layers,
        widths, heads and tokens (max_length, or patches) per sample from it to estimate activation memory."""
        raise NotImplementedError(f"model_type {self.model_type!r} does not implement encoder_configs")

    def planning_tokens(self, recipe: "Recipe") -> "dict[str, dict[str, int]] | None":
        """For the planner: which encoders (keys of `encoder_configs`) a query side and a document side pass
        through, and their sequence length there, e.g. `{"query": {"text": 512}, "document": {"image": 197}}`.
        None (the default): queries go to the text encoder at max_length, documents to the image encoder (patches of
        its image_size), or to the text encoder when there is none. Adapters whose sides pass through several
        encoders, or whose image sequence depends on the recipe (a pixel budget), say so here."""
        return None

    # --- used by the loop ------------------------------------------------------------------------------------------
    @property
    @abstractmethod
    def embedding_dim(self) -> int:
        ...

    @abstractmethod
    def preprocess(self, sides: Sequence["Side"]) -> dict[str, torch.Tensor]:
        """Tokenise / process a list of sides into CPU tensors. Images may be paths or PIL images."""

    @abstractmethod
    def encode(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Embeddings `(n, embedding_dim)` for a preprocessed batch, on the model's device."""

    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.encode(inputs)

    def num_sides(self, inputs: dict[str, torch.Tensor]) -> int:
        """How many sides a preprocessed batch holds."""
        from vembed.models.batch import TEXT_INDEX

        return int(inputs[TEXT_INDEX].shape[0])

    def slice_batch(self, inputs: dict[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
        """The preprocessed batch of sides `start:stop` (GradCache chunks), as `preprocess` would have made it for
        those sides alone. Default: the flat text/image layout of
        `vembed.models.batch`; adapters with another layout override."""
        from vembed.models.batch import slice_batch

        return slice_batch(inputs, start, stop)

    def block_classes(self) -> set[type[nn.Module]]:
        """The modules FSDP wraps as units: the classes each tower names in transformers' `_no_split_modules`
        (transformer blocks, and for some models their embeddings too), as found among the tower's modules (so a
        name listed for a sub-model this tower lacks is skipped)."""
        classes: set[type[nn.Module]] = set()
        for tower in self.towers():
            names = set(getattr(tower, "_no_split_modules", None) or ())
            base = getattr(tower, "get_base_model", None)  # PEFT-wrapped towers name them on the base model
            if base is not None:
                names |= set(getattr(base(), "_no_split_modules", None) or ())
            classes |= {type(m) for m in tower.modules() if type(m).__name__ in names}
        return classes

    def zero3_unpartitioned_parameters(self) -> list[nn.Parameter]:
        """Parameters DeepSpeed ZeRO-3 must keep whole on every rank. transformers' CLIP-family text embeddings
        compare the sequence length with `position_embedding.weight.shape` in a forward where ZeRO-3 has not gathered
        that weight yet; the default names those."""
        return [m.position_embedding.weight for m in self.modules()
                if type(m).__name__.endswith("TextEmbeddings") and hasattr(m, "position_embedding")]

    # --- cost accounting (throughput and MFU logging; see vembed/models/flops.py for the rule) ------------------
    def forward_flops(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor | int:
        """Model FLOPs of one forward pass of `encode(inputs)`: a 0-d tensor on the batch's device (no host sync),
        or an int when it depends on shapes only. Training counts 3× this.

        Default, valid for any adapter: 2 × (weights of every tower, embedding tables excluded) × real text tokens
        (the attention mask's sum). Right for text encoders and for decoders that put image tokens in the sequence
        (Qwen-VL style); adapters with a separate vision tower override it to count images by their patches."""
        from vembed.models.flops import FORWARD_FLOPS_PER_WEIGHT_TOKEN, text_tokens

        weights = sum(self.matmul_weights(tower) for tower in self.towers())
        return text_tokens(inputs) * (FORWARD_FLOPS_PER_WEIGHT_TOKEN * weights)

    def matmul_weights(self, module: nn.Module) -> int:
        """`vembed.models.flops.matmul_weights(module)`, counted once per module."""
        from vembed.models.flops import WeightCounts

        return self.__dict__.setdefault("_matmul_weight_counts", WeightCounts())(module)

    @abstractmethod
    def towers(self) -> list[nn.Module]:
        """The transformers models inside; checkpointing and LoRA apply to each of them."""

    def enable_gradient_checkpointing(self) -> None:
        """Turn on (non-reentrant) activation checkpointing in every tower."""
        from vembed.models.hf import enable_checkpointing

        enable_checkpointing(*self.towers())

    def lora_target_modules(self, recipe: "Recipe") -> list[str]:
        return list(recipe.lora_target_modules or self.default_lora_target_modules)

    def apply_lora(self, recipe: "Recipe") -> None:
        """Wrap the towers with PEFT LoRA (r/alpha/dropout/targets from the recipe); only LoRA weights stay trainable
        (plus whatever the adapter adds outside its towers, such as composed's new projections)."""
        from vembed.models.lora import inject_lora

        inject_lora(self.towers(), self.lora_target_modules(recipe), r=recipe.lora_r, alpha=recipe.lora_alpha,
                    dropout=recipe.lora_dropout, strict=recipe.lora_target_modules is not None,
                    model_type=self.model_type)

    # --- persistence -----------------------------------------------------------------------------------------------
    @abstractmethod
    def save(self, path: str | Path) -> None:
        """Save HF weights/config/processor under `path` (LoRA merged) and call `write_adapter_file`."""

    @classmethod
    @abstractmethod
    def load(cls, path: str | Path) -> "EmbeddingAdapter":
        ...

    def settings(self) -> dict[str, Any]:
        """Adapter settings needed to rebuild it from a saved folder; adapters add their own (pooling, ...)."""
        return {
            "normalize": self.normalize,
            "max_length": self.max_length,
            "trust_remote_code": self.trust_remote_code,
            "attn_implementation": self.attn_implementation,
        }

    def write_adapter_file(self, path: str | Path) -> None:
        info = {"model_type": self.model_type, "embedding_dim": self.embedding_dim, "settings": self.settings()}
        Path(path, ADAPTER_FILE).write_text(json.dumps(info, indent=2))


def require_tokenizer_name(recipe: "Recipe", config_key: str) -> None:
    """A randomly initialised text tower has no tokenizer of its own."""
    if recipe.tokenizer_name is None:
        raise RecipeError(
            "tokenizer_name",
            f"is required when {config_key} builds a random-init text tower; point it at a tokenizer folder "
            "(e.g. one made by vembed.data.tokenizer.train_tokenizer)",
        )


# Recipe keys only the composed adapter reads; the single-model adapters reject them (see `reject_keys`).
COMPOSED_ONLY_KEYS = (
    "text_model_name", "text_model_config", "vision_model_name", "vision_model_config", "projection_dim",
)  # fmt: skip


def reject_keys(recipe: "Recipe", keys: Sequence[str], model_type: str, used_by: str) -> None:
    """Keys meant for another adapter are errors rather than silently ignored."""
    for key in keys:
        if getattr(recipe, key) is not None:
            raise RecipeError(key, f"is only used by model_type {used_by}, not {model_type}; remove it")


def saved_settings(path: str | Path, model_type: str) -> dict[str, Any]:
    """The settings of a saved adapter folder, after checking that it was saved by `model_type`."""
    info = read_adapter_file(path)
    if info.get("model_type") != model_type:
        raise RecipeError("model", f"{str(path)!r} holds a {info.get('model_type')!r} model, not {model_type!r}")
    return dict(info.get("settings", {}))


def read_adapter_file(path: str | Path) -> dict[str, Any]:
    file = Path(path, ADAPTER_FILE)
    if not file.is_file():
        raise RecipeError(
            "model", f"{str(path)!r} is not a vembed model folder (no {ADAPTER_FILE}); pass output_dir/final"
        )
    return json.loads(file.read_text())


def load_adapter(path: str | Path) -> nn.Module:
    """Load any saved vembed model, whatever its adapter (an embedding adapter, or e.g. a blip3o_dit generator)."""
    from vembed.models import MODELS

    info = read_adapter_file(path)
    return MODELS.get(info["model_type"]).load(path)


def load_embedding_adapter(path: str | Path) -> EmbeddingAdapter:
    """A saved model that encodes text/images; anything else is one clear line naming what to use instead."""
    model = load_adapter(path)
    if not isinstance(model, EmbeddingAdapter):  # blip3o_dit generates embeddings from other embeddings
        cls = type(model)
        raise RecipeError(
            "model", f"{str(path)!r} holds a {read_adapter_file(path)['model_type']} model, which generates "
            f"embeddings instead of encoding text or images; load it with {cls.__module__}.{cls.__name__}.load(path)",
        )
    return model
