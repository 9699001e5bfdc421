"""The adapter contract and what every adapter inherits: settings, building from a recipe, on the meta device or
from a saved folder, and saving.

An adapter declares its recipe keys as a `Settings` class beside itself; `settings_to_save()` writes them to
`vembed.json` and `load` passes them back, so persistence follows from the declaration. `TransformersAdapter` adds
everything an adapter around one transformers model (plus its tokenizer and image processor) needs: an adapter on top
of it states only what differs (its config's embedding size, its image processor for a random-init model, its
`encode`). Everything model-specific (processors, pooling, fusion of text+image, which modules LoRA targets) lives in
the adapter's own file; the training loop only ever calls the methods below.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from pydantic import Field
from torch import nn

from vembed.errors import RecipeError
from vembed.models.hf import (
    auto_config,
    hf_kwargs,
    load_image_processor,
    load_model,
    load_tokenizer,
    require_model_type,
    resolve_max_length,
    save_hf_model,
)
from vembed.recipe import Settings

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

    from vembed.data.records import Side
    from vembed.recipe import Recipe

ADAPTER_FILE = "vembed.json"  # written beside the HF files of every saved model; names the adapter and its settings


class AdapterSettings(Settings):
    """The keys every embedding adapter reads."""

    tokenizer_name: str | None = None  # tokenizer/processor path when it is not beside the weights
    normalize: bool = True  # L2-normalise embeddings
    max_length: int | None = Field(default=None, gt=0)  # tokens per text (unset: the model's own limit)
    # Run Python code shipped with the weights (transformers' trust_remote_code) while training. Never saved: a saved
    # model runs such code only when whoever loads it asks (`vembed.load(path, trust_remote_code=True)`).
    trust_remote_code: bool = False
    attn_implementation: str | None = None  # e.g. sdpa, eager, flash_attention_2 (unset: transformers' choice)
    # Each side's texts run as one row of their real tokens, no padding (vembed/models/packing.py): varlen flash
    # attention on CUDA, each text alone elsewhere; adapters that declare `packs_texts` only.
    packing: bool = False

    # Fields not written to vembed.json: where the weights came from, and trust (the loader's to give).
    unsaved: ClassVar[frozenset[str]] = frozenset({"tokenizer_name", "trust_remote_code"})


class PretrainedSettings(AdapterSettings):
    """The keys of an adapter around one transformers model: pretrained weights, or a config for random init."""

    model_name: str | None = None  # hub id or local path of pretrained weights
    # `model_config` in YAML: a config dict to build a randomly initialised model instead. (Renamed in Python only
    # because pydantic reserves `model_config`.)
    model_config_dict: dict[str, Any] | None = Field(default=None, alias="model_config")

    unsaved: ClassVar[frozenset[str]] = AdapterSettings.unsaved | {"model_name", "model_config_dict"}


class EmbeddingAdapter(nn.Module, ABC):
    """An embedding model as the loop sees it.

    Contract:
    - `from_recipe(recipe)` builds it from the recipe's `Settings` (`recipe.model`); `on_meta(recipe)` builds its
      shapes only; `load(path)` reads a saved folder back.
    - `preprocess(sides)` turns a list of `Side`s into a dict of CPU tensors (runs in DataLoader workers).
    - `forward(inputs)` / `encode(inputs)` return a `(len(sides), embedding_dim)` float tensor, in the order of the
      sides, L2-normalised when the recipe says `normalize: true`.
    - `save(path)` writes HF files loadable by transformers plus `vembed.json`.
    - `slice_batch(inputs, start, stop)` cuts a preprocessed batch into chunks (GradCache); `block_classes()` names
      the blocks FSDP wraps.
    """

    model_type: ClassVar[str]  # the registry name, set by each adapter
    Settings: ClassVar[type[AdapterSettings]] = AdapterSettings  # the recipe keys this adapter reads
    default_lora_target_modules: ClassVar[tuple[str, ...]] = ()
    # One tower per modality; a step that feeds no side of a modality leaves that tower without gradients.
    modalities: ClassVar[frozenset[str]] = frozenset({"text"})
    # What every record of a stream must feed, so that every step reaches every trainable tower (a dual encoder's
    # two): a streamed sample without them is skipped and counted, as open_clip drops samples without caption or
    # image, and DDP needs no search for unused parameters (its flag is fixed before the stream is read).
    modalities_per_record: ClassVar[frozenset[str]] = frozenset()
    # Images one side may hold (None: any number); data with more is refused when it is loaded, naming the row.
    max_images_per_side: ClassVar[int | None] = 1
    # Whether padding columns that no row attends change nothing this adapter computes (it pools from the attention
    # mask or at the EOS token), so its texts may be encoded in length-sorted chunks (vembed/models/length_chunks.py).
    length_chunking: ClassVar[bool] = False
    # Whether its texts may run packed (`packing: true`): its encoder's attention goes through transformers'
    # attention interface and its outputs are read per token (vembed/models/packing.py).
    packs_texts: ClassVar[bool] = False
    # Whether its images come out at one fixed size through `vembed.models.batch.make_batch`, so training images may
    # be resized once into the image cache (data.image_cache; vembed/data/image_cache.py). Not qwen_vl: its image
    # sizes follow each image (dynamic resolution).
    image_cache: ClassVar[bool] = False

    def __init__(self, settings: AdapterSettings):
        super().__init__()
        self.settings = settings  # resolved (e.g. max_length filled in from the model); saved by `save`

    # --- built from a recipe ---------------------------------------------------------------------------------------
    @classmethod
    def settings_of(cls, recipe: "Recipe") -> AdapterSettings:
        """This adapter's settings in `recipe` (typed by `vembed.components` when the recipe was read)."""
        if not isinstance(recipe.model, cls.Settings):
            raise RecipeError("model_type", f"this recipe holds {recipe.model_type} settings, not {cls.model_type}'s")
        return recipe.model

    @classmethod
    def check_recipe(cls, recipe: "Recipe") -> None:
        """Adapter-specific recipe checks, before anything is built."""
        cls.settings_of(recipe)

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

    @property
    def embedding_kind(self) -> str:
        """What `encode` gives per side, and so how a corpus is searched (vembed.retrieval.SCORINGS):
        "single", one vector; "multi_vector", token vectors (late interaction, `embedding: multi_vector`)."""
        return getattr(self.settings, "embedding", "single")

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

    def compiled_modules(self) -> list[nn.Module]:
        """The modules `compile: true` compiles (each one's forward, in place). Default: the towers, for adapters that
        call their towers' forward; an adapter that reaches a tower through another method (CLIP's
        `get_text_features`) names the submodules that method runs."""
        return self.towers()

    def compile_towers(self) -> None:
        """torch.compile each of `compiled_modules()` in place (`nn.Module.compile`): parameters, state dict and
        saving are unchanged; the compiled forward replaces the eager one."""
        for module in self.compiled_modules():
            module.compile()

    def enable_gradient_checkpointing(self) -> None:
        """Turn on (non-reentrant) activation checkpointing in every tower."""
        from vembed.models.hf import enable_checkpointing

        enable_checkpointing(*self.towers())

    def lora_target_modules(self, recipe: "Recipe") -> list[str]:
        return list(recipe.lora_target_modules or self.default_lora_target_modules)

    def lora_towers(self) -> list[nn.Module]:
        """The towers LoRA wraps (default: all of them)."""
        return self.towers()

    def apply_lora(self, recipe: "Recipe") -> None:
        """Wrap the LoRA towers with PEFT LoRA (r/alpha/dropout/targets from the recipe); only LoRA weights stay
        trainable there (plus whatever the adapter adds outside its towers, such as composed's new projections)."""
        from vembed.models.lora import inject_lora

        inject_lora(self.lora_towers(), self.lora_target_modules(recipe), r=recipe.lora_r, alpha=recipe.lora_alpha,
                    dropout=recipe.lora_dropout, strict=recipe.lora_target_modules is not None,
                    model_type=self.model_type)

    def learning_rate_scales(self, learning_rate: float) -> dict[nn.Parameter, float]:
        """Parameters trained at their own rate, as multiples of the recipe's `learning_rate` (the optimizer's
        groups, `vembed.training.objective.parameter_groups`); none by default."""
        return {}

    def set_pixel_budget(self, min_pixels: int | None, max_pixels: int | None) -> None:
        """Resize images to hold between min and max pixels (a curriculum stage's image size). Adapters with a fixed
        input resolution (CLIP, SigLIP, ViT towers) keep this refusal; qwen_vl overrides it."""
        raise RecipeError("stages.max_pixels", f"{type(self).__name__} has a fixed image size; only qwen_vl changes it")

    # --- persistence -----------------------------------------------------------------------------------------------
    @abstractmethod
    def save(self, path: str | Path) -> None:
        """Save HF weights/config/processor under `path` (LoRA merged) and call `write_adapter_file`."""

    @classmethod
    @abstractmethod
    def load(cls, path: str | Path, *, trust_remote_code: bool = False) -> "EmbeddingAdapter":
        """The adapter saved in `path`. Python code shipped in the folder runs only with `trust_remote_code`."""

    @classmethod
    def sentence_transformers_modules(cls, path: Path, info: dict[str, Any], trust_remote_code: bool) -> list[Any]:
        """The sentence-transformers modules that embed as this adapter does, over the folder `path` it saved (its
        `vembed.json` is `info`): what `vembed export` writes. Adapters with an equivalent override this."""
        raise NotImplementedError(f"model_type {cls.model_type!r} has no sentence-transformers equivalent")

    @classmethod
    def has_sentence_transformers_equivalent(cls) -> bool:
        """Whether this adapter overrides `sentence_transformers_modules` (what `vembed export` and the card ask)."""
        owner = next(klass for klass in cls.__mro__ if "sentence_transformers_modules" in vars(klass))
        return owner is not EmbeddingAdapter

    @classmethod
    def transformers_example(cls, path: str, settings: dict[str, Any], texts: list[str]) -> str | None:
        """Python that embeds `texts` as this adapter does with plain transformers from the folder `path` (its saved
        `settings`), ending with an `embeddings` tensor: the model card shows it. None (the default): the embedding
        needs vembed (its pooling, prompt format or projections are not one transformers model's own output)."""
        return None

    def settings_to_save(self) -> dict[str, Any]:
        """What `vembed.json` records to rebuild this adapter from its folder: the settings but the unsaved ones."""
        return self.settings.model_dump(mode="json", by_alias=True, exclude=set(self.settings.unsaved))

    def write_adapter_file(self, path: str | Path) -> None:
        info = {"model_type": self.model_type, "embedding_dim": self.embedding_dim, "settings": self.settings_to_save()}
        Path(path, ADAPTER_FILE).write_text(json.dumps(info, indent=2))

    @classmethod
    def saved_settings(cls, path: str | Path, trust_remote_code: bool) -> tuple[dict[str, Any], AdapterSettings]:
        """The folder's `vembed.json` and the settings it records, with the caller's trust (never the file's)."""
        info = read_adapter_file(path)
        if info.get("model_type") != cls.model_type:
            found = info.get("model_type")
            raise RecipeError("model", f"{str(path)!r} holds a {found!r} model, not {cls.model_type!r}")
        fields = {field.alias or name for name, field in cls.Settings.model_fields.items()
                  if name not in cls.Settings.unsaved}
        saved = {key: value for key, value in info.get("settings", {}).items() if key in fields}
        return info, cls.Settings.model_validate({**saved, "trust_remote_code": trust_remote_code})


class TransformersAdapter(EmbeddingAdapter):
    """An adapter around one transformers model (`self.model`), its tokenizer and, when it embeds images, its image
    processor: built from `model_name` (pretrained) or `model_config` (random init), saved as one folder that plain
    transformers loads. Subclasses state what differs: `embedding_dim_of(config)`, `new_image_processor(config)`
    for a random-init model, and the hooks below where needed."""

    Settings: ClassVar[type[PretrainedSettings]] = PretrainedSettings
    # The transformers architecture (config model_type) this adapter drives; None: any (a config dict names it).
    hf_model_type: ClassVar[str | None] = None
    # The transformers Auto class that builds `self.model`: the bare model (embedders read hidden states), or one
    # with a head (the Qwen-VL reranker reads its LM head's "yes"/"no" rows).
    auto_class: ClassVar[str] = "AutoModel"

    def __init__(self, model: "PreTrainedModel", tokenizer: Any, image_processor: Any, settings: PretrainedSettings):
        super().__init__(settings)
        self.model = model
        self.tokenizer = tokenizer
        self.image_processor = image_processor

    # --- what subclasses state -------------------------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def embedding_dim_of(cls, config: "PretrainedConfig") -> int:
        """The embedding size of a model with this config."""

    @classmethod
    def new_image_processor(cls, config: "PretrainedConfig") -> Any:
        """The image processor of a random-init model (image adapters override)."""
        raise NotImplementedError(f"{cls.__name__} embeds no images")

    @classmethod
    def auto_class_for(cls, settings: PretrainedSettings) -> str:
        """The transformers Auto class that builds `self.model` with these settings (default: `auto_class`)."""
        return cls.auto_class

    @classmethod
    def check_config(cls, config: "PretrainedConfig", key: str) -> None:
        """Refuse a config this adapter cannot drive (`key`: the recipe key to blame)."""

    @classmethod
    def config_dict(cls, settings: PretrainedSettings, tokenizer: Any) -> dict[str, Any] | None:
        """The random-init config dict as given to AutoConfig (qwen_vl adds its tokenizer's vision token ids)."""
        return settings.model_config_dict

    @classmethod
    def resolve(cls, settings: PretrainedSettings, tokenizer: Any, config: "PretrainedConfig") -> PretrainedSettings:
        """The settings the adapter runs with: unset values decided from the model (max_length: its own limit)."""
        max_length = resolve_max_length(settings.max_length, tokenizer, getattr(config, "text_config", config))
        return settings.model_copy(update={"max_length": max_length})

    @classmethod
    def image_processor_for(cls, name: str | None, config: "PretrainedConfig", settings: PretrainedSettings) -> Any:
        """The processor of checkpoint `name` (PIL backend), or a new one matching a random-init `config`."""
        if name is None:
            return cls.new_image_processor(config)
        return load_image_processor(name, settings.trust_remote_code)

    # --- built from a recipe, on the meta device, or from a folder -------------------------------------------------
    @classmethod
    def check_recipe(cls, recipe: "Recipe") -> None:
        settings = cls.settings_of(recipe)
        if (settings.model_name is None) == (settings.model_config_dict is None):
            raise RecipeError("model_name", f"model_type {cls.model_type!r} needs exactly one of model_name "
                                            "(pretrained) or model_config (random init)")
        if settings.model_config_dict is not None:
            if cls.hf_model_type is None:
                require_model_type(settings.model_config_dict, "model_config")
            require_tokenizer_name(settings, "model_config")

    @classmethod
    def hf_config(cls, settings: PretrainedSettings, tokenizer: Any = None) -> "PretrainedConfig":
        key = "model_name" if settings.model_name else "model_config"
        config = auto_config(settings.model_name, cls.config_dict(settings, tokenizer), key=key,
                             trust_remote_code=settings.trust_remote_code, model_type=cls.hf_model_type)
        cls.check_config(config, key)
        return config

    @classmethod
    def embedding_dim_for(cls, recipe: "Recipe") -> int:
        return cls.embedding_dim_of(cls.hf_config(cls.settings_of(recipe)))

    @classmethod
    def from_recipe(cls, recipe: "Recipe") -> "TransformersAdapter":
        import transformers

        cls.check_recipe(recipe)
        settings = cls.settings_of(recipe)
        AutoModel = getattr(transformers, cls.auto_class_for(settings))
        tokenizer = load_tokenizer(settings.tokenizer_name or settings.model_name, settings.trust_remote_code)
        config = cls.hf_config(settings, tokenizer)  # config-level checks before any weights are read
        if settings.model_name is not None:
            model = load_model(settings.model_name, None, key="model_name",
                               trust_remote_code=settings.trust_remote_code,
                               attn_implementation=settings.attn_implementation, model_type=cls.hf_model_type,
                               auto_class=cls.auto_class_for(settings))
        else:
            model = AutoModel.from_config(config, **hf_kwargs(settings.trust_remote_code, settings.attn_implementation))
        processor = cls.image_processor_for(settings.model_name, model.config, settings) if cls._images() else None
        return cls(model, tokenizer, processor, cls.resolve(settings, tokenizer, model.config))

    @classmethod
    def on_meta(cls, recipe: "Recipe") -> "TransformersAdapter":
        import transformers

        cls.check_recipe(recipe)
        settings = cls.settings_of(recipe)
        AutoModel = getattr(transformers, cls.auto_class_for(settings))
        config = cls.hf_config(settings)
        with torch.device("meta"):
            model = AutoModel.from_config(config, **hf_kwargs(settings.trust_remote_code, settings.attn_implementation))
        return cls(model, None, None, cls.resolve(settings, None, config))

    @classmethod
    def load(cls, path: str | Path, *, trust_remote_code: bool = False) -> "TransformersAdapter":
        info, settings = cls.saved_settings(path, trust_remote_code)
        model = cls.load_weights(path, info, settings)
        processor = cls.image_processor_for(str(path), model.config, settings) if cls._images() else None
        return cls(model, load_tokenizer(str(path), trust_remote_code), processor, settings)

    @classmethod
    def load_weights(cls, path: str | Path, info: dict[str, Any], settings: PretrainedSettings) -> "PreTrainedModel":
        return load_model(str(path), None, key="model", trust_remote_code=settings.trust_remote_code,
                          attn_implementation=settings.attn_implementation, model_type=cls.hf_model_type,
                          auto_class=cls.auto_class_for(settings))

    def save(self, path: str | Path) -> None:
        save_hf_model(self.model, path)
        self.tokenizer.save_pretrained(path)
        if self.image_processor is not None:
            self.image_processor.save_pretrained(path)
        self.write_adapter_file(path)

    @classmethod
    def _images(cls) -> bool:
        return "image" in cls.modalities

    # --- used by the loop ------------------------------------------------------------------------------------------
    @property
    def embedding_dim(self) -> int:
        return self.embedding_dim_of(self.model.config)

    def towers(self) -> list[nn.Module]:
        return [self.model]


def require_tokenizer_name(settings: AdapterSettings, config_key: str) -> None:
    """A randomly initialised text tower has no tokenizer of its own."""
    if settings.tokenizer_name is None:
        raise RecipeError(
            "tokenizer_name",
            f"is required when {config_key} builds a random-init text tower; point it at a tokenizer folder "
            "(e.g. one made by vembed.data.tokenizer.train_tokenizer)",
        )


def read_adapter_file(path: str | Path) -> dict[str, Any]:
    file = Path(path, ADAPTER_FILE)
    if not file.is_file():
        raise RecipeError(
            "model", f"{str(path)!r} is not a vembed model folder (no {ADAPTER_FILE}); pass output_dir/final"
        )
    return json.loads(file.read_text())


def load_adapter(path: str | Path, *, trust_remote_code: bool = False) -> EmbeddingAdapter:
    """Load a saved vembed embedding model, whatever its adapter. Python code shipped in the folder runs only when
    the caller passes `trust_remote_code=True`, never because the folder says so."""
    from vembed.models import MODELS

    info = read_adapter_file(path)
    model_type = info.get("model_type")
    if model_type not in MODELS:
        # Worded for every kind that embeds nothing, so that this layer need not ask the wings' registries which.
        raise RecipeError("model", f"{str(path)!r} holds a {model_type!r} model, which is not an embedding model: a "
                                   "reranker scores (query, document) pairs and embeds nothing (use an embedding "
                                   "model here, and the reranker on the embedder's candidates); blip3o_dit generates "
                                   "embeddings (load it with vembed.generation.load_generator)")
    try:
        return MODELS.get(model_type).load(path, trust_remote_code=trust_remote_code)
    except RecipeError as err:
        if trust_remote_code or not info.get("settings", {}).get("trust_remote_code"):
            raise
        raise RecipeError(err.key, f"{err.message}; the model was trained with trust_remote_code: it may need Python "
                                   "code shipped in its folder, which runs only when you pass trust_remote_code=True "
                                   "(e.g. vembed.load(path, trust_remote_code=True)) if you trust it") from None
