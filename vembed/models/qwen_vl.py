"""Qwen-VL as an embedding model: Qwen2-VL, Qwen2.5-VL and Qwen3-VL (Qwen3-VL-Embedding 2B/8B are Qwen3-VL).

Every side becomes one chat-formatted sequence, as in the Qwen3-VL-Embedding technical report::

    <|im_start|>system\\n{instruction}<|im_end|>\\n<|im_start|>user\\n{images}{text}<|im_end|>\\n<|endoftext|>

(`{images}` is `<|vision_start|><|image_pad|>…<|vision_end|>` per image, the pad repeated once per merged patch;
a side with neither text nor image says "NULL"). The embedding is the last layer's state at the final
`<|endoftext|>` -- the last attended token, whatever the padding side -- L2-normalised. The released inference
code ends with `<|im_start|>assistant` and a newline instead (`prompt_ending: generation_prompt`; see ENDINGS), and
so does this adapter for Qwen3-VL-Embedding checkpoints unless the recipe says otherwise (see `default_ending`).
The embedding size is the language model's hidden size (2048 for 2B, 4096 for 8B).

With `embedding: multi_vector` (ColQwen, as colpali-engine's ColQwen2) a side gives token vectors instead: every
attended position of the same sequence -- template, instruction, text and image tokens alike -- projected to
`multi_vector_dim` by a bias-free Linear outside the LoRA'd language model and L2-normalised, padding the zero vector
(`vembed/models/token_projection.py`), for loss_type late_interaction and MaxSim search. Queries and documents keep
their instructions and chat format; a page screenshot's document is its image tokens plus that frame.

Images go through the PIL image processor (no torchvision needed), and the image tokens are expanded here, the
same way the transformers processor does (tests compare the two when torchvision is installed).

The Qwen-VL family: `QwenVLModel` holds what every model on a Qwen-VL backbone shares (checks of the checkpoint and
its tokenizer, images, padding, the language model's forward, packing, LoRA, pixel budgets, save and load);
`QwenVLAdapter` here is its embedder and `QwenVLReranker` (vembed/reranking/qwen_vl_reranker.py) its reranker.
"""

from __future__ import annotations

import importlib.util
import json
import unicodedata
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from vembed.data.images import load_image
from vembed.errors import RecipeError
from vembed.models import MODELS
from vembed.models.base import ADAPTER_FILE, PretrainedSettings, TransformersAdapter
from vembed.models.batch import forward_argument_names
from vembed.models.hf import load_model, save_hf_model
from vembed.models.lora import LORA_WEIGHTS, load_lora_weights, save_lora_weights
from vembed.models.pooling import pool
from vembed.models.pylate_folder import PROJECTION_FOLDER, write_projection
from vembed.models.token_projection import TokenVectors, TokenVectorSettings

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

    from vembed.data.records import Side
    from vembed.recipe import Recipe

# The transformers architectures this adapter drives, by the checkpoint config's model_type (never by name).
BACKBONES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")

EMPTY_INSTANCE = "NULL"  # what a side with neither text nor image says, as in the official embedder
SYSTEM_START = "<|im_start|>system\n"
USER_START = "<|im_end|>\n<|im_start|>user\n"
# How a sequence ends; the embedding is the state at its last token. "endoftext" is the technical report's format;
# "generation_prompt" is what the released inference code feeds (it applies the chat template with
# add_generation_prompt=True, so it pools at the newline after "assistant"; QwenLM/Qwen3-VL-Embedding issue #4).
ENDINGS = {"endoftext": "<|im_end|>\n<|endoftext|>", "generation_prompt": "<|im_end|>\n<|im_start|>assistant\n"}
# In the model_name of the released embedders (hub ids Qwen/Qwen3-VL-Embedding-2B/-8B, or a local copy keeping the
# name): their weights are served by code ending with the generation prompt, so fine-tunes of them end so by default.
EMBEDDING_CHECKPOINT = "qwen3-vl-embedding"
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
# Config attributes that must hold the tokenizer's ids of these tokens (a random-init config takes them from it).
VISION_TOKEN_IDS = {
    "image_token_id": IMAGE_PAD, "video_token_id": "<|video_pad|>",
    "vision_start_token_id": VISION_START, "vision_end_token_id": VISION_END,
}  # fmt: skip

# Batch keys. One sequence per side; images of all sides stacked in side order.
SEQUENCE_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids")  # (n, seq): sliced by row
PIXEL_VALUES, IMAGE_GRID_THW = "pixel_values", "image_grid_thw"  # (patches, C*T*P*P) and (images, 3)
IMAGES_PER_SIDE = "images_per_side"  # (n,): how many images each side holds; not a model input
# The memory planner's text length per side when the recipe sets no max_length (Qwen's own limit, 256K positions,
# would be meaningless): instruction + template + a long passage. Set max_length to plan for a real bound.
PLANNED_TEXT_TOKENS = 512


def image_placeholders(side: "Side") -> str:
    """One `<|vision_start|><|image_pad|><|vision_end|>` per image of the side (each pad expanded later)."""
    return (VISION_START + IMAGE_PAD + VISION_END) * len(side.images)


def side_text(side: "Side") -> str:
    """The side's text as the released templates write it after its images: "" when it has images only, "NULL" when
    it has neither."""
    if side.text and side.text.strip():
        return side.text
    return "" if side.images else EMPTY_INSTANCE


def normalize_instruction(instruction: str) -> str:
    """As the official embedder does: stripped, and ended with a full stop unless it ends with punctuation."""
    instruction = instruction.strip()
    if instruction and not unicodedata.category(instruction[-1]).startswith("P"):
        instruction += "."
    return instruction


class QwenVLModelSettings(PretrainedSettings):
    """The keys of every model on a Qwen-VL backbone (the embedder here, the reranker in vembed/reranking)."""

    min_pixels: int | None = Field(default=None, gt=0)  # images are resized to hold at least this many pixels ...
    max_pixels: int | None = Field(default=None, gt=0)  # ... and at most this many (unset: the checkpoint's values)
    train_vision_tower: bool = False  # false: the vision tower is frozen (with or without LoRA)
    # With use_lora, what the saved model holds: "merged" (LoRA folded in; a plain transformers folder) or "adapter"
    # (only the LoRA weights, PEFT file names; loading reads model_name again).
    lora_save: Literal["merged", "adapter"] = "merged"

    # The released Qwen3-VL-Embedding LoRA is r=32, alpha=32.
    recipe_defaults: ClassVar[dict[str, Any]] = {"lora_r": 32, "lora_alpha": 32}
    # The pixel bounds live in the saved image processor; vision tower training is a training matter.
    unsaved: ClassVar[frozenset[str]] = PretrainedSettings.unsaved | {"min_pixels", "max_pixels", "train_vision_tower"}


class QwenVLSettings(QwenVLModelSettings, TokenVectorSettings):
    # embedding, multi_vector_dim: token vectors (ColQwen), vembed/models/token_projection.py

    # The system-turn instruction of query sides; unset: document_instruction.
    query_instruction: str | None = None
    # The system-turn instruction of documents (positives, hard negatives) and of sides of unknown role.
    document_instruction: str = "Represent the user's input."
    # How each sequence ends (the embedding is the state at its last token): "endoftext", the technical report's
    # "<|im_end|>, newline, <|endoftext|>"; or "generation_prompt", "<|im_end|>, newline, <|im_start|>assistant,
    # newline", what the released Qwen3-VL-Embedding inference code (and vLLM) feeds. Unset: decided per checkpoint
    # (`default_ending`): generation_prompt for Qwen3-VL-Embedding checkpoints, endoftext for any other.
    prompt_ending: Literal["endoftext", "generation_prompt"] | None = None


def default_ending(model_name: str | None) -> str:
    """The prompt ending of a checkpoint whose recipe leaves `prompt_ending` unset: the one a folder saved by vembed
    recorded; generation_prompt for a Qwen3-VL-Embedding checkpoint (its model_name says so: the hub id, or a local
    folder keeping the name); endoftext for any other (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, random init)."""
    if model_name is None:
        return "endoftext"
    saved = Path(model_name, ADAPTER_FILE)
    if saved.is_file():
        ending = json.loads(saved.read_text()).get("settings", {}).get("prompt_ending")
        if ending in ENDINGS:
            return ending
    return "generation_prompt" if EMBEDDING_CHECKPOINT in model_name.lower() else "endoftext"


class QwenVLModel(TransformersAdapter):
    """What the embedder and the reranker on a Qwen-VL backbone share; each adds its prompt format and output."""

    Settings: ClassVar[type[QwenVLModelSettings]] = QwenVLModelSettings
    modalities = frozenset({"text", "image"})
    max_images_per_side = None  # every image of a side goes into its user turn
    packs_texts = True  # the language model runs the sides as one row; the vision tower packs its images itself
    # The released Qwen3-VL-Embedding LoRA's targets (its README's table): the attention projections but o_proj, and
    # the MLP's. LoRA goes into the language model only (Qwen2.5-VL's vision MLP reuses these names).
    default_lora_target_modules = ("q_proj", "v_proj", "k_proj", "up_proj", "down_proj", "gate_proj")

    def __init__(self, model: "PreTrainedModel", tokenizer: Any, image_processor: Any, settings: QwenVLModelSettings):
        super().__init__(model, tokenizer, image_processor, settings)
        if model.config.model_type not in BACKBONES:
            raise RecipeError("model_name", f"is a {model.config.model_type!r} model; qwen_vl drives {BACKBONES}")
        self.backbone.visual.requires_grad_(settings.train_vision_tower)
        if settings.packing:
            from vembed.models.packing import use_packed_attention

            use_packed_attention(model, "text_config")
            self._rope_arguments = forward_argument_names(self.backbone.get_rope_index)
        if tokenizer is None:  # on_meta: nothing to tokenise, so nothing to check
            self._token_ids = {name: getattr(model.config, name) for name in VISION_TOKEN_IDS}
            return
        self._token_ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in VISION_TOKEN_IDS.items()}
        self._check_token_ids(model.config)

    @staticmethod
    def backbone_of(model: "PreTrainedModel") -> nn.Module:
        """The Qwen-VL model holding `visual` and `language_model`: `model` itself here (the bare model); the reranker
        holds it under its ForConditionalGeneration's `.model`."""
        return model

    @property
    def backbone(self) -> nn.Module:
        return self.backbone_of(self.model)

    def _check_token_ids(self, config: "PretrainedConfig") -> None:
        for name, token_id in self._token_ids.items():
            if getattr(config, name) != token_id:
                raise RecipeError(
                    "tokenizer_name",
                    f"gives {VISION_TOKEN_IDS[name]} id {token_id} but the model's {name} is {getattr(config, name)};"
                    " use the checkpoint's own tokenizer",
                )

    # --- built from a recipe ---------------------------------------------------------------------------------------
    @classmethod
    def check_recipe(cls, recipe: "Recipe") -> None:
        super().check_recipe(recipe)
        settings = cls.settings_of(recipe)
        if recipe.use_lora and settings.lora_save == "adapter" and settings.model_name is None:
            raise RecipeError("lora_save", "adapter saves LoRA weights over a pretrained model_name; a random-init "
                              "model_config has none to load them onto: use merged")
        if settings.attn_implementation == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
            raise RecipeError("attn_implementation", "flash_attention_2 needs the flash-attn package; install it or "
                              "use sdpa")

    @classmethod
    def config_dict(cls, settings: QwenVLModelSettings, tokenizer: Any) -> dict[str, Any] | None:
        raw = settings.model_config_dict
        if raw is not None and tokenizer is not None:
            # A random-init model must agree with its tokenizer on the vision token ids; unless given, take them.
            ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in VISION_TOKEN_IDS.items()}
            raw = {**ids, **raw}
        return raw

    @classmethod
    def check_config(cls, config: "PretrainedConfig", key: str) -> None:
        if config.model_type not in BACKBONES:
            raise RecipeError(key, f"is a {config.model_type!r} model; model_type qwen_vl takes {', '.join(BACKBONES)}")

    @classmethod
    def embedding_dim_of(cls, config: "PretrainedConfig") -> int:
        return config.text_config.hidden_size

    @classmethod
    def new_image_processor(cls, config: "PretrainedConfig") -> Any:
        """A processor matching a random-init model's vision config (patch, temporal patch and merge sizes)."""
        from transformers import Qwen2VLImageProcessorPil

        vision = config.vision_config
        return Qwen2VLImageProcessorPil(
            patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
            merge_size=vision.spatial_merge_size,
        )

    @classmethod
    def image_processor_for(cls, name: str | None, config: "PretrainedConfig", settings: QwenVLModelSettings) -> Any:
        processor = super().image_processor_for(name, config, settings)
        set_pixel_budget(processor, settings.min_pixels, settings.max_pixels)
        return processor

    def encoder_configs(self) -> "dict[str, PretrainedConfig]":
        return {"text": self.model.config.text_config, "image": self.model.config.vision_config}

    def planned_document(self, recipe: "Recipe") -> dict[str, int]:
        """For the planner: a document sequence, in tokens, for the language model ("text") and the vision tower
        ("image"). Assumed: one image, at the pixel cap (max_pixels). The vision tower sees its patches,
        max_pixels / patch²; the language model sees them merged, / merge² more, inside the sequence. Text takes
        max_length (which bounds the whole sequence, images included) or, unset, PLANNED_TEXT_TOKENS on top of the
        image."""
        settings = self.settings_of(recipe)  # the recipe's own max_length, not the model's limit resolved from it
        max_pixels, max_length = settings.max_pixels, settings.max_length
        if max_pixels is None:
            raise RecipeError("max_pixels", "is needed by the planner to count image tokens (it plans for images at "
                              "the cap); set it, e.g. 1843200 as in configs/qwen3_vl_embedding_2b.yaml")
        vision = self.model.config.vision_config
        merge = vision.spatial_merge_size**2
        image_tokens = max_pixels // (vision.patch_size**2 * merge)  # one per merged patch
        text = max(max_length, image_tokens) if max_length is not None else PLANNED_TEXT_TOKENS + image_tokens
        return {"text": text, "image": image_tokens * merge}

    # --- sequences -------------------------------------------------------------------------------------------------
    def _encode_text(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _expand_images(self, ids: list[int], tokens_per_image: list[int]) -> list[int]:
        """`ids` with each `<|image_pad|>` repeated once per merged patch of its image (the processor's expansion)."""
        pad_id = self._token_ids["image_token_id"]
        expanded: list[int] = []
        counts = iter(tokens_per_image)
        for token in ids:
            expanded.extend([pad_id] * next(counts) if token == pad_id else [token])
        return expanded

    def _image_batch(self, images: list[Any]) -> tuple[dict[str, torch.Tensor], list[int]]:
        """The pixel values and grids of `images` (paths or PIL images, in sequence order), each one's token count."""
        if not images:
            return {}, []
        processed = self.image_processor(images=[load_image(image) for image in images], return_tensors="pt")
        merge = self.image_processor.merge_size**2
        tokens_per_image = [int(grid.prod()) // merge for grid in processed["image_grid_thw"]]
        return {PIXEL_VALUES: processed["pixel_values"], IMAGE_GRID_THW: processed["image_grid_thw"]}, tokens_per_image

    def _sequence_batch(self, row_images: Sequence[list[Any]],
                        row_ids: Callable[[int, list[int]], list[int]]) -> dict[str, torch.Tensor]:
        """One padded sequence per row, with the pixels of every row's images stacked in row order: `row_images[i]`
        are row i's images, and `row_ids(i, tokens_per_image)` its token ids given each of its images' token count."""
        batch, tokens_per_image = self._image_batch([image for images in row_images for image in images])
        rows, start = [], 0
        for i, images in enumerate(row_images):
            rows.append(row_ids(i, tokens_per_image[start : start + len(images)]))
            start += len(images)
        batch.update(self._pad(rows))
        batch[IMAGES_PER_SIDE] = torch.tensor([len(images) for images in row_images], dtype=torch.long)
        return batch

    def _pad(self, rows: list[list[int]]) -> dict[str, torch.Tensor]:
        width = max(len(row) for row in rows)
        pad_id = self.tokenizer.pad_token_id
        input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        left = self.tokenizer.padding_side == "left"
        for i, row in enumerate(rows):
            span = slice(width - len(row), width) if left else slice(0, len(row))
            input_ids[i, span] = torch.tensor(row)
            attention_mask[i, span] = 1
        # Without mm_token_type_ids Qwen2.5-VL silently builds text positions for image tokens, and Qwen2-VL/Qwen3-VL
        # refuse: 1 marks image tokens (2 would mark video), 0 text.
        mm_token_type_ids = (input_ids == self._token_ids["image_token_id"]).long() * attention_mask
        return {"input_ids": input_ids, "attention_mask": attention_mask, "mm_token_type_ids": mm_token_type_ids}

    # --- used by the loop ------------------------------------------------------------------------------------------
    def last_hidden_state(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The language model's last layer over the preprocessed sequences (batch keys that are no model input, such
        as images_per_side, left out)."""
        model_inputs = {key: inputs[key] for key in (*SEQUENCE_KEYS, IMAGE_GRID_THW) if key in inputs}
        if PIXEL_VALUES in inputs:
            model_inputs[PIXEL_VALUES] = inputs[PIXEL_VALUES].to(self.backbone.visual.dtype)
        if self.settings.packing:
            return self._packed_last_hidden_state(model_inputs)
        return self.backbone(**model_inputs, use_cache=False).last_hidden_state

    def _packed_last_hidden_state(self, model_inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The language model over the sides packed into one row (vembed/models/packing.py): the multimodal rope
        positions are the model's own for the padded batch (`get_rope_index`), then packed with the tokens; images
        go in as they are (their tokens are placed by id, in order)."""
        from vembed.models.packing import Packing

        backbone = self.backbone
        positions, _ = backbone.get_rope_index(**{key: value for key, value in model_inputs.items()
                                                  if key in self._rope_arguments and key != PIXEL_VALUES})
        packing = Packing.of(model_inputs["attention_mask"])
        packed = {key: value for key, value in model_inputs.items() if key in (IMAGE_GRID_THW, PIXEL_VALUES)}
        packed.update({key: packing.pack(value) for key, value in model_inputs.items()
                       if key in SEQUENCE_KEYS and key != "attention_mask"})
        packed["position_ids"] = positions[:, model_inputs["attention_mask"].bool()].unsqueeze(1)
        hidden = backbone(**packed, **packing.attention_arguments(), use_cache=False).last_hidden_state
        return packing.unpack(hidden)

    def last_token_states(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """`(n, hidden)`: the last layer's state at each sequence's last attended token, whatever the padding side."""
        return pool(self.last_hidden_state(inputs), inputs["attention_mask"], "last")

    def num_sides(self, inputs: dict[str, torch.Tensor]) -> int:
        return int(inputs["attention_mask"].shape[0])  # one sequence row per side (images are inside it)

    def slice_batch(self, inputs: dict[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
        """Sides `start:stop`: their sequence rows (with columns that are padding in every kept row dropped), their
        images' `image_grid_thw` rows, and the `pixel_values` rows of those images (grid t*h*w rows per image)."""
        mask = inputs["attention_mask"][start:stop]
        used = mask.any(0).nonzero().flatten()
        columns = slice(int(used.min()), int(used.max()) + 1)
        out = {key: inputs[key][start:stop, columns] for key in SEQUENCE_KEYS}
        counts = inputs[IMAGES_PER_SIDE]
        out[IMAGES_PER_SIDE] = counts[start:stop]
        first, last = int(counts[:start].sum()), int(counts[:stop].sum())
        if last > first:
            patches = inputs[IMAGE_GRID_THW].prod(-1)
            out[IMAGE_GRID_THW] = inputs[IMAGE_GRID_THW][first:last]
            out[PIXEL_VALUES] = inputs[PIXEL_VALUES][int(patches[:first].sum()) : int(patches[:last].sum())]
        return out

    def lora_towers(self) -> list[nn.Module]:
        return [self.backbone.language_model]  # the released Qwen3-VL-Embedding LoRA's place

    def apply_lora(self, recipe: "Recipe") -> None:
        """LoRA on the language model; the vision tower stays frozen, or fully trainable with `train_vision_tower`."""
        super().apply_lora(recipe)
        self.backbone.visual.requires_grad_(self.settings.train_vision_tower)

    # --- persistence -----------------------------------------------------------------------------------------------
    def set_pixel_budget(self, min_pixels: int | None, max_pixels: int | None) -> None:
        """A curriculum stage's image size; None keeps the bound the model was built with."""
        if getattr(self, "_built_size", None) is None:
            self._built_size = dict(self.image_processor.size)
        self.image_processor.size = dict(self._built_size)
        set_pixel_budget(self.image_processor, min_pixels, max_pixels)

    def settings_to_save(self) -> dict[str, Any]:
        # A folder of LoRA weights alone is loaded onto the pretrained checkpoint it was trained from.
        return {**super().settings_to_save(), "base_model": self.settings.model_name}

    def _saves_lora_only(self) -> bool:
        return self.settings.lora_save == "adapter" and any("lora_" in name for name, _ in self.named_parameters())

    def save(self, path: str | Path) -> None:
        """The merged model (a plain transformers folder), or with `lora_save: adapter` and LoRA applied only the
        LoRA weights of the language model (PEFT file names), which `load` puts back on `base_model`; then what the
        model adds (`save_extra_files`) and vembed.json."""
        if self._saves_lora_only():
            save_lora_weights(self.backbone.language_model, path)
        else:
            save_hf_model(self.model, path)
        self.tokenizer.save_pretrained(path)
        self.image_processor.save_pretrained(path)
        self.save_extra_files(path)
        self.write_adapter_file(path)

    def save_extra_files(self, path: str | Path) -> None:
        """Files a family member saves beside the model (the embedder: its token projection)."""

    @classmethod
    def saved_settings(cls, path: str | Path, trust_remote_code: bool) -> tuple[dict[str, Any], QwenVLModelSettings]:
        info, settings = super().saved_settings(path, trust_remote_code)
        return info, settings.model_copy(update={"model_name": info.get("settings", {}).get("base_model")})

    @classmethod
    def load_weights(cls, path: str | Path, info: dict[str, Any], settings: QwenVLModelSettings
                     ) -> "PreTrainedModel":
        if not Path(path, LORA_WEIGHTS).is_file():
            return super().load_weights(path, info, settings)
        model = load_model(settings.model_name, None, key="model", trust_remote_code=settings.trust_remote_code,
                           attn_implementation=settings.attn_implementation, auto_class=cls.auto_class)
        load_lora_weights(cls.backbone_of(model).language_model, path)
        return model


@MODELS.register("qwen_vl")
class QwenVLAdapter(TokenVectors, QwenVLModel):
    """The Qwen-VL embedder: one chat-formatted sequence per side, embedded at its last token (or, multi_vector,
    every token's vector)."""

    model_type = "qwen_vl"
    Settings: ClassVar[type[QwenVLSettings]] = QwenVLSettings
    late_interaction_name = "ColQwen"
    card_tags = ("ColPali", "ColQwen")  # what the Hub lists page-retrieval late-interaction models under

    def __init__(self, model: "PreTrainedModel", tokenizer: Any, image_processor: Any, settings: QwenVLSettings):
        super().__init__(model, tokenizer, image_processor, settings)
        if settings.multi_vector:
            self.add_projection(model.config.text_config.hidden_size, next(model.parameters()).device)

    # --- built from a recipe ---------------------------------------------------------------------------------------
    @classmethod
    def from_recipe(cls, recipe: "Recipe") -> "QwenVLAdapter":
        adapter = super().from_recipe(recipe)
        name = adapter.settings.model_name
        if adapter.settings.multi_vector and name is not None and Path(name, PROJECTION_FOLDER).is_dir():
            adapter.load_projection(name)  # continuing from a saved ColQwen: keep its projection
        return adapter

    @classmethod
    def resolve(cls, settings: QwenVLSettings, tokenizer: Any, config: "PretrainedConfig") -> QwenVLSettings:
        settings = super().resolve(settings, tokenizer, config)
        if settings.prompt_ending is None:
            settings = settings.model_copy(update={"prompt_ending": default_ending(settings.model_name)})
        return settings

    def planning_tokens(self, recipe: "Recipe") -> dict[str, dict[str, int]]:
        """Every side is one language-model sequence; a document side's image also passes through the vision tower
        (`planned_document`). Queries are assumed text only: max_length, or PLANNED_TEXT_TOKENS when unset."""
        max_length = self.settings_of(recipe).max_length
        query = max_length if max_length is not None else PLANNED_TEXT_TOKENS
        return {"query": {"text": query}, "document": self.planned_document(recipe)}

    @classmethod
    def card_rows(cls, settings: dict[str, Any]) -> list[list[Any]]:
        """Token vectors are every attended token of the side's chat-formatted sequence: they depend on its frame."""
        query = settings.get("query_instruction") or settings.get("document_instruction")
        return [
            ["tokens", "every token of a side's chat-formatted sequence: instruction, text and image tokens (one per "
                       "merged patch; the pixel bounds are in the saved image processor)"],
            ["query instruction", f"`{query}`"],
            ["document instruction", f"`{settings.get('document_instruction')}`"],
            ["prompt ending", f"`{settings.get('prompt_ending')}`"],
            ["sequence length", f"at most {settings.get('max_length')} tokens"],
        ]

    # --- the input format ------------------------------------------------------------------------------------------
    def instruction_for(self, side: "Side") -> str:
        if side.instruction is not None:  # a named source's own (data.train.<name>.query_instruction)
            return normalize_instruction(side.instruction)
        if side.role == "query" and self.settings.query_instruction is not None:
            return normalize_instruction(self.settings.query_instruction)
        return normalize_instruction(self.settings.document_instruction)

    def prompt(self, side: "Side") -> str:
        """The side's sequence as text, with one `<|image_pad|>` per image (before expansion)."""
        head, body = self._prompt_parts(side)
        return head + body + ENDINGS[self.settings.prompt_ending]

    def _prompt_parts(self, side: "Side") -> tuple[str, str]:
        head = SYSTEM_START + self.instruction_for(side) + USER_START + image_placeholders(side)
        return head, side_text(side)

    def _side_ids(self, side: "Side", tokens_per_image: list[int]) -> list[int]:
        """Token ids of one side with every image pad expanded; only the instance text is truncated to max_length.

        The three pieces are tokenised apart so that truncation never cuts the template or an image; this equals
        tokenising the whole string (tested) because each boundary is a special token or a newline -- except for a
        text that itself starts with newlines, which Qwen's pre-tokeniser would merge with the one before it."""
        head, body = self._prompt_parts(side)
        encode = self._encode_text
        head_ids = self._expand_images(encode(head), tokens_per_image)
        body_ids, end_ids = encode(body), encode(ENDINGS[self.settings.prompt_ending])
        if self.settings.max_length is not None:
            room = self.settings.max_length - len(head_ids) - len(end_ids)
            if room < 0:
                raise ValueError(
                    f"a side's images alone take {len(head_ids)} tokens, over max_length {self.settings.max_length}; "
                    "raise max_length or lower max_pixels"
                )
            body_ids = body_ids[:room]
        return head_ids + body_ids + end_ids

    def preprocess(self, sides: Sequence["Side"]) -> dict[str, torch.Tensor]:
        return self._sequence_batch([side.images for side in sides],
                                    lambda i, tokens_per_image: self._side_ids(sides[i], tokens_per_image))

    # --- used by the loop ------------------------------------------------------------------------------------------
    def encode(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.settings.multi_vector:  # every attended token, images' too
            return self.token_vectors(self.last_hidden_state(inputs), inputs["attention_mask"].bool())
        embeddings = self.last_token_states(inputs).float()
        return F.normalize(embeddings, dim=-1) if self.settings.normalize else embeddings

    # --- persistence -----------------------------------------------------------------------------------------------
    def save_extra_files(self, path: str | Path) -> None:
        if self.settings.multi_vector:
            write_projection(path, self.projection.weight)


def set_pixel_budget(image_processor: Any, min_pixels: int | None, max_pixels: int | None) -> None:
    """Images are resized (aspect kept, sides multiples of patch x merge) to hold between min and max pixels."""
    size = dict(image_processor.size)
    if min_pixels is not None:
        size["shortest_edge"] = min_pixels
    if max_pixels is not None:
        size["longest_edge"] = max_pixels
    if size["shortest_edge"] > size["longest_edge"]:
        raise RecipeError("min_pixels", f"{size['shortest_edge']} exceeds max_pixels {size['longest_edge']}")
    image_processor.size = size
