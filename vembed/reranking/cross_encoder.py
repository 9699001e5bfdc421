"""A text cross-encoder: any transformers sequence-classification encoder with one output logit reads the query and
the document as one input (`tokenizer(query, document)`: [CLS] query [SEP] document [SEP] for BERT) and its logit is
the pair's score.

The saved folder is a plain transformers sequence-classification folder plus `vembed.json`; sentence-transformers'
`CrossEncoder(path).predict(pairs)` gives the same scores (the raw logit: its default for one label is a sigmoid, so
config.json names the identity activation explicitly)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from pydantic import Field
from torch import nn

from vembed.errors import RecipeError
from vembed.models.base import ADAPTER_FILE, PretrainedSettings, read_adapter_file, require_tokenizer_name
from vembed.models.hf import (
    _loading,
    auto_config,
    enable_checkpointing,
    hf_kwargs,
    load_tokenizer,
    require_model_type,
    resolve_max_length,
    save_hf_model,
)
from vembed.models.lora import ATTENTION_PROJECTIONS
from vembed.reranking import RERANKERS
from vembed.reranking.pairs import PairPart, PairScorer

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from vembed.recipe import Recipe

# What sentence-transformers' CrossEncoder applies to the logit in `predict` (read from config.json): none, so its
# scores are ours. Without it a one-label model gets a sigmoid.
IDENTITY_ACTIVATION = "torch.nn.modules.linear.Identity"


class CrossEncoderSettings(PretrainedSettings):
    # Pairs encoded per forward chunk: a batch of B lists of L documents is B x L pairs; chunks are activation-
    # checkpointed, so memory follows the chunk, not B x L (unset: all pairs in one forward).
    pairs_per_chunk: int | None = Field(default=None, gt=0)

    unsaved: ClassVar[frozenset[str]] = PretrainedSettings.unsaved | {"pairs_per_chunk", "normalize"}


@RERANKERS.register("cross_encoder")
class CrossEncoderAdapter(PairScorer, nn.Module):
    """A reranker as the rerank task sees it: `preprocess(queries, documents)` -> CPU tensors,
    `forward(inputs)` -> (n,) float logits, `score(queries, documents)`, `save`/`load`."""

    model_type: ClassVar[str] = "cross_encoder"
    task: ClassVar[str] = "rerank"  # vembed.tasks: how this model is trained
    Settings: ClassVar[type[CrossEncoderSettings]] = CrossEncoderSettings
    default_lora_target_modules = ATTENTION_PROJECTIONS
    modalities: ClassVar[frozenset[str]] = frozenset({"text"})  # an image document is refused, naming its row
    length_chunking: ClassVar[bool] = True  # pairs are rows of tokens scored at the first: padding can be cut
    packs_texts: ClassVar[bool] = True  # its layer stack runs packed, the head reads it unpacked (models/packing.py)
    card_library: ClassVar[str] = "sentence-transformers"  # final/ loads as CrossEncoder(path), vembed's scores
    card_tags: ClassVar[tuple[str, ...]] = ("sentence-transformers", "cross-encoder")

    def __init__(self, model: "PreTrainedModel", tokenizer: Any, settings: CrossEncoderSettings):
        super().__init__()
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self._stack = None
        if settings.packing:
            from vembed.models.batch import forward_argument_names
            from vembed.models.packing import first_position, layer_stack, use_packed_attention

            self._stack = layer_stack(model)  # a name: the module itself would be registered (state dict) twice
            if self._stack is None:
                raise RecipeError("packing", f"{type(model).__name__} has no layer stack (encoder) that vembed can "
                                             "run packed below its head; remove packing")
            use_packed_attention(model)
            self._packed_arguments = (forward_argument_names(model.forward), first_position(model))

    @classmethod
    def card_usage(cls, path: str) -> list[str]:
        """vembed's lines, then sentence-transformers' `CrossEncoder`, which reads final/ as it is (its config names
        the identity activation, so `predict` gives the raw logit vembed gives)."""
        from vembed.reranking.pairs import EXAMPLE_DOCUMENTS, EXAMPLE_QUERY

        pairs = [(EXAMPLE_QUERY, document) for document in EXAMPLE_DOCUMENTS]
        return [*super().card_usage(path), "", "With sentence-transformers (the same scores):", "", "```python",
                "from sentence_transformers import CrossEncoder", f"model = CrossEncoder({path!r})",
                f"scores = model.predict({pairs!r})",
                f"ranked = model.rank({EXAMPLE_QUERY!r}, {EXAMPLE_DOCUMENTS!r})  # [{{'corpus_id', 'score'}}, ...]",
                "```"]

    # --- built from a recipe or a folder ---------------------------------------------------------------------------
    @classmethod
    def settings_of(cls, recipe: "Recipe") -> CrossEncoderSettings:
        if not isinstance(recipe.model, cls.Settings):
            raise RecipeError("model_type", f"this recipe holds {recipe.model_type} settings, not {cls.model_type}'s")
        return recipe.model

    @classmethod
    def check_recipe(cls, recipe: "Recipe") -> None:
        settings = cls.settings_of(recipe)
        if (settings.model_name is None) == (settings.model_config_dict is None):
            raise RecipeError("model_name", "model_type 'cross_encoder' needs exactly one of model_name (pretrained) "
                                            "or model_config (random init)")
        if settings.model_config_dict is not None:
            require_model_type(settings.model_config_dict, "model_config")
            require_tokenizer_name(settings, "model_config")
        cls.hf_config(settings)  # reads the config only: a bad name or a many-label classifier fails here

    @classmethod
    def hf_config(cls, settings: CrossEncoderSettings):
        key = "model_name" if settings.model_name else "model_config"
        config = auto_config(settings.model_name, settings.model_config_dict, key=key,
                             trust_remote_code=settings.trust_remote_code)
        from transformers import AutoModelForSequenceClassification

        mapping = AutoModelForSequenceClassification._model_mapping
        if type(config) not in mapping:
            raise RecipeError(key, f"{config.model_type} has no sequence-classification head in transformers; use an "
                                   "encoder such as bert, xlm-roberta, electra or modernbert")
        # A base encoder (or a one-logit reranker) gets one output; a classifier with several labels is not a reranker.
        architectures = getattr(config, "architectures", None) or []
        trained_head = any(name.endswith("ForSequenceClassification") for name in architectures)
        if trained_head and config.num_labels != 1:
            raise RecipeError(key, f"is a classifier with {config.num_labels} labels; a cross-encoder reranker has "
                                   "one output logit (start from the base encoder or a one-label reranker)")
        config.num_labels = 1
        return config

    @classmethod
    def from_recipe(cls, recipe: "Recipe") -> "CrossEncoderAdapter":
        from transformers import AutoModelForSequenceClassification

        cls.check_recipe(recipe)
        settings = cls.settings_of(recipe)
        tokenizer = load_tokenizer(settings.tokenizer_name or settings.model_name, settings.trust_remote_code)
        config = cls.hf_config(settings)
        kwargs = hf_kwargs(settings.trust_remote_code, settings.attn_implementation)
        if settings.model_name is not None:
            with _loading("model_name", settings.model_name):
                model = AutoModelForSequenceClassification.from_pretrained(settings.model_name, config=config,
                                                                           **kwargs)
        else:
            model = AutoModelForSequenceClassification.from_config(config, **kwargs)
        max_length = resolve_max_length(settings.max_length, tokenizer, model.config)
        return cls(model, tokenizer, settings.model_copy(update={"max_length": max_length}))

    @classmethod
    def on_meta(cls, recipe: "Recipe") -> "CrossEncoderAdapter":
        """For `vembed plan`: the model built from its config on the meta device (real shapes, no storage, no
        weights or tokenizer read; it cannot score)."""
        from transformers import AutoModelForSequenceClassification

        cls.check_recipe(recipe)
        settings = cls.settings_of(recipe)
        config = cls.hf_config(settings)
        with torch.device("meta"):
            model = AutoModelForSequenceClassification.from_config(
                config, **hf_kwargs(settings.trust_remote_code, settings.attn_implementation))
        max_length = resolve_max_length(settings.max_length, None, model.config)
        return cls(model, None, settings.model_copy(update={"max_length": max_length}))

    def encoder_configs(self) -> dict[str, Any]:
        """For the planner: the one transformer, which reads every pair."""
        return {"text": self.model.config}

    def planning_tokens(self, recipe: "Recipe") -> dict[str, dict[str, int]]:
        """For the planner: an example is a list of pairs ("pair": 1 + data.num_hard_negatives of them), each query
        and document read jointly, at most max_length tokens."""
        return {"pair": {"text": self.settings.max_length or 512}}

    @classmethod
    def load(cls, path: str | Path, *, trust_remote_code: bool = False) -> "CrossEncoderAdapter":
        from transformers import AutoModelForSequenceClassification

        info = read_adapter_file(path)
        if info.get("model_type") != cls.model_type:
            raise RecipeError("model", f"{str(path)!r} holds a {info.get('model_type')!r} model, not a reranker")
        fields = {f.alias or n for n, f in cls.Settings.model_fields.items() if n not in cls.Settings.unsaved}
        saved = {k: v for k, v in info.get("settings", {}).items() if k in fields}
        settings = cls.Settings.model_validate({**saved, "trust_remote_code": trust_remote_code})
        with _loading("model", str(path)):
            model = AutoModelForSequenceClassification.from_pretrained(
                str(path), **hf_kwargs(trust_remote_code, settings.attn_implementation))
        return cls(model, load_tokenizer(str(path), trust_remote_code), settings)

    def save(self, path: str | Path) -> None:
        """A transformers sequence-classification folder that sentence-transformers' CrossEncoder loads as is: its
        activation named (identity: `predict` gives these scores) and the tokenizer's limit set to max_length (the
        truncation CrossEncoder applies)."""
        save_hf_model(self.model, path)
        config_file = Path(path, "config.json")
        config = json.loads(config_file.read_text())
        config["sentence_transformers"] = {**config.get("sentence_transformers", {}),
                                           "activation_fn": IDENTITY_ACTIVATION}
        config_file.write_text(json.dumps(config, indent=2))
        if self.settings.max_length is not None:
            self.tokenizer.model_max_length = self.settings.max_length
        self.tokenizer.save_pretrained(path)
        info = {"model_type": self.model_type, "settings": self.settings.model_dump(
            mode="json", by_alias=True, exclude=set(self.settings.unsaved))}
        Path(path, ADAPTER_FILE).write_text(json.dumps(info, indent=2))

    # --- used by the task ------------------------------------------------------------------------------------------
    def preprocess(self, queries: list[PairPart], documents: list[PairPart]) -> dict[str, torch.Tensor]:
        """Pairs tokenized jointly (only the longest is cut, as sentence-transformers' CrossEncoder cuts them)."""
        return dict(self.tokenizer([_text(query) for query in queries], [_text(document) for document in documents],
                                   padding=True, truncation="longest_first", max_length=self.settings.max_length,
                                   return_tensors="pt"))

    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """(n,) float32 logits of n preprocessed pairs."""
        if self._stack is not None:
            from vembed.models.packing import packed_below_head

            stack = self.model.get_submodule(self._stack)
            return packed_below_head(self.model, stack, inputs, *self._packed_arguments).logits.view(-1).float()
        return self.model(**inputs).logits.view(-1).float()

    def num_sides(self, inputs: dict[str, torch.Tensor]) -> int:
        return int(inputs["input_ids"].shape[0])  # one row per pair

    def slice_batch(self, inputs: dict[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
        return {key: value[start:stop] for key, value in inputs.items()}

    # --- what the loop asks of every trained model -----------------------------------------------------------------
    def towers(self) -> list[nn.Module]:
        return [self.model]

    def forward_flops(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor | int:
        """Model FLOPs of one forward of `inputs` (vembed/models/flops.py's rule, for the loop's MFU): the encoder's
        weights see every real token; the pooler and score head one position per pair."""
        from vembed.models.flops import WeightCounts, text_flops

        counts = self.__dict__.setdefault("_matmul_weight_counts", WeightCounts())
        encoder = self.model.base_model
        pooler = getattr(encoder, "pooler", None)  # BERT's dense+tanh on the first token: once per pair
        per_row = counts(pooler) if isinstance(pooler, nn.Module) else 0
        per_token = counts(encoder) - per_row
        return text_flops(inputs, per_token, counts(self.model) - per_token)

    def compile_towers(self) -> None:
        self.model.compile()

    def enable_gradient_checkpointing(self) -> None:
        enable_checkpointing(self.model)

    def lora_target_modules(self, recipe: "Recipe") -> list[str]:
        return list(recipe.lora_target_modules or self.default_lora_target_modules)

    def apply_lora(self, recipe: "Recipe") -> None:
        from vembed.models.lora import inject_lora

        inject_lora([self.model], self.lora_target_modules(recipe), r=recipe.lora_r, alpha=recipe.lora_alpha,
                    dropout=recipe.lora_dropout, strict=recipe.lora_target_modules is not None,
                    model_type=self.model_type)
        # The score head (outside the encoder: `classifier`, `score`, ...) is trained in full: it is new on a base
        # encoder, and frozen it would leave LoRA fitting the encoder to a random projection.
        encoder = getattr(self.model, self.model.base_model_prefix, None)
        inside = {id(p) for p in encoder.parameters()} if isinstance(encoder, nn.Module) else set()
        for parameter in self.model.parameters():
            if id(parameter) not in inside:
                parameter.requires_grad_(True)

    def block_classes(self) -> set[type[nn.Module]]:
        names = set(getattr(self.model, "_no_split_modules", None) or ())
        return {type(m) for m in self.model.modules() if type(m).__name__ in names}


def _text(part: PairPart) -> str:
    """A pair's part as the text cross-encoder reads it; an image is refused in one line."""
    from vembed.data.records import Side
    from vembed.errors import DataError

    if not isinstance(part, Side):
        return part
    if part.images:
        raise DataError(f"a document holds an image ({part.images[0]}), which the text cross-encoder cannot read; "
                        "use model_type qwen_vl_reranker for image documents, or give text documents")
    return part.text or ""
