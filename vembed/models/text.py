"""A text-only embedding model: any HF text encoder (`AutoModel`: BERT, BGE, MiniLM, ...) with cls, mean or last-token
pooling, (`embedding: multi_vector`) ColBERT's token vectors, or (`embedding: sparse`) SPLADE's vocabulary-sized
vectors from the masked-LM head (`vembed/models/splade.py`). Sides with images are rejected.

ColBERT, as PyLate and the ColBERT papers build it: a query is `query_prefix + text` padded to exactly `query_length`
tokens with the tokenizer's mask token, every position attended and kept (query expansion); a document is
`document_prefix + text` (each prefix one token added to the vocabulary), its punctuation tokens dropped
(`skip_punctuation`); every last hidden state goes through a bias-free Linear to `multi_vector_dim` and is
L2-normalised. The output follows `vembed.models.token_vectors` (zero vectors where there is no token). A saved
ColBERT is also a PyLate folder (`vembed/models/pylate_folder.py`): `pylate.models.ColBERT(path)` loads it."""

from __future__ import annotations

import string
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator

from vembed.errors import RecipeError
from vembed.models import MODELS
from vembed.models.base import PretrainedSettings, TransformersAdapter
from vembed.models.batch import forward_argument_names, make_batch
from vembed.models.hf import freeze_unused_pooler, resolve_max_length
from vembed.models.lora import ATTENTION_PROJECTIONS
from vembed.models.packing import first_position, packed_forward, use_packed_attention
from vembed.models.pooling import pool
from vembed.models.pylate_folder import PROJECTION_FOLDER, write_pylate_files
from vembed.models.splade import (
    IDF,
    MASKED_LM,
    SPARSE,
    STATIC,
    STATIC_FOLDER,
    idf_weights,
    keep_top_k,
    read_static_query_weight,
    require_masked_lm,
    sparse_transformers_example,
    splade_pool,
    static_query_vectors,
    weights_from_json,
    write_sparse_encoder_files,
    write_static_query_files,
)
from vembed.models.token_projection import TokenVectors, TokenVectorSettings
from vembed.recipe import InvalidKey

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

    from vembed.data.records import Side
    from vembed.recipe import Recipe


# Which tokens of a preprocessed batch become token vectors (multi_vector): all of an expanded query, a document's
# attended tokens but its punctuation. Sliced and trimmed with the other (n, T) token keys; never fed to the model.
VECTOR_MASK = "token_vector_mask"
# Marks a batch of queries for the static query encoder (`query_encoder: static`): their attended tokens, (n, T) like
# the other token keys, so that chunking keeps it; never fed to the model.
STATIC_QUERY_TOKENS = "static_query_tokens"


class TextSettings(PretrainedSettings, TokenVectorSettings):
    # single: one vector per side (`pooling`); multi_vector: ColBERT's token vectors (keys below); sparse: SPLADE, one
    # vocabulary-sized vector per side from the masked-LM head, scored by dot product, never L2-normalised.
    embedding: Literal["single", "multi_vector", "sparse"] = "single"
    pooling: Literal["cls", "mean", "last"] = "mean"  # cls: first token; mean: attended tokens; last: last attended
    # embedding: sparse: how log(1 + relu(MLM logits)) of a side's tokens are pooled into its vector (max: SPLADE v2
    # and later; sum: the first SPLADE).
    sparse_pooling: Literal["max", "sum"] = "max"
    # embedding: sparse: keep each vector's this many largest weights, at inference only (encoding for search, never
    # in training; sentence-transformers' max_active_dims); unset: all.
    sparse_top_k: int | None = Field(default=None, gt=0)
    # embedding: sparse: corpus search (evaluation, `vembed search`/`mine`, `Embedder.search`) keeps only each query's
    # this many largest weights (after sparse_top_k; vembed/retrieval/sparse_index.py); never `encode` or training;
    # unset: every non-zero weight.
    sparse_query_top_k: int | None = Field(default=None, gt=0)
    # embedding: sparse: the same for each document in the search's inverted index (a smaller index, faster search).
    sparse_document_top_k: int | None = Field(default=None, gt=0)
    # embedding: sparse: what encodes queries. transformer: the masked-LM model, as documents; static: no network
    # (inference-free SPLADE, sentence-transformers' SparseStaticEmbedding): one trainable weight per vocabulary token,
    # a query's vector the weights of its tokens (vembed/models/splade.py). Documents always go through the model.
    query_encoder: Literal["transformer", "static"] = "transformer"
    # query_encoder: static: the weights' start. idf: the IDF of the training documents' tokens (1 for every token
    # when there are no training data, e.g. built from Python); ones: 1 for every token; or the path of a JSON object
    # token -> weight (sentence-transformers' idf.json; unlisted tokens 0). A model_name saved with static weights
    # keeps its own.
    static_query_init: str = IDF
    # query_encoder: static: the static weights' learning rate (sentence-transformers' learning_rate_mapping for
    # the SparseStaticEmbedding module); unset: learning_rate. Scaled by the schedule like every other rate.
    static_query_lr: float | None = Field(default=None, gt=0)
    # embedding, multi_vector_dim: vembed/models/token_projection.py; with multi_vector (ColBERT, as described at the
    # top of this file) these keys apply too:
    query_prefix: str = "[Q] "  # put before every query's text
    document_prefix: str = "[D] "  # put before every document's text
    query_length: int = Field(default=32, gt=0)  # every query is this many tokens: truncated, or expanded with [MASK]
    skip_punctuation: bool = True  # documents' punctuation tokens give no vector
    # Corpus search (evaluation, mining) pools each document's token vectors about this many to one (hierarchical
    # clustering, vembed/retrieval/maxsim_search.py); 1: none. Training and `encode_token_vectors` never pool.
    document_pool_factor: int = Field(default=1, ge=1)

    token_vector_keys: ClassVar[tuple[str, ...]] = (
        "multi_vector_dim", "query_prefix", "document_prefix", "query_length", "skip_punctuation",
        "document_pool_factor")
    sparse_keys: ClassVar[tuple[str, ...]] = ("sparse_pooling", "sparse_top_k", "sparse_query_top_k",
                                              "sparse_document_top_k", "query_encoder")
    static_keys: ClassVar[tuple[str, ...]] = ("static_query_init", "static_query_lr")
    # Where the static weights start (a file or the data) and their rate are training's, not the saved model's.
    unsaved: ClassVar[frozenset[str]] = PretrainedSettings.unsaved | set(static_keys)

    @model_validator(mode="after")
    def _sparse_keys(self) -> "TextSettings":
        if self.query_encoder != STATIC:
            for key in self.static_keys:
                if getattr(self, key) != type(self).model_fields[key].default:
                    raise InvalidKey(key, "applies to a static query encoder only; set query_encoder: static (with "
                                          "embedding: sparse) or remove it")
        if self.embedding != SPARSE:
            for key in self.sparse_keys:  # by value, not by presence: a saved recipe must read back
                if getattr(self, key) != type(self).model_fields[key].default:
                    raise InvalidKey(key, "applies to sparse vectors only; set embedding: sparse or remove it")
            return self
        if self.pooling != type(self).model_fields["pooling"].default:
            raise InvalidKey("pooling", "embedding: sparse pools with sparse_pooling (max or sum); remove pooling")
        if self.normalize and self.explicit("normalize"):
            raise InvalidKey("normalize", "sparse vectors are scored by dot product and never L2-normalised; "
                                          "remove normalize: true or use embedding: single")
        self.__dict__["normalize"] = False  # what is saved and read back; set without re-validating
        return self

    @property
    def sparse(self) -> bool:
        return self.embedding == SPARSE

    @property
    def static_query(self) -> bool:
        """Inference-free SPLADE: queries are encoded by static weights, not the model."""
        return self.query_encoder == STATIC


@MODELS.register("text")
class TextAdapter(TokenVectors, TransformersAdapter):
    model_type = "text"
    Settings: ClassVar[type[TextSettings]] = TextSettings
    default_lora_target_modules = ATTENTION_PROJECTIONS
    length_chunking: ClassVar[bool] = True  # every pooling reads the attention mask
    packs_texts: ClassVar[bool] = True  # its outputs are read per token, then pooled from the mask
    modalities_per_record = frozenset({"text"})  # its one tower: a streamed record without text cannot be embedded
    late_interaction_name = "ColBERT"
    card_tags = ("ColBERT", "PyLate")  # what the Hub lists late-interaction models under; final/ loads in PyLate
    pylate_folder = True

    def __init__(self, model: "PreTrainedModel", tokenizer: Any, image_processor: None, settings: TextSettings):
        super().__init__(model, tokenizer, None, settings)
        freeze_unused_pooler(model)
        self._text_keys = forward_argument_names(model.forward)
        if settings.packing:
            use_packed_attention(model)
            self._first_position = first_position(model)  # read once: it walks the model's modules
        if settings.multi_vector:
            self.add_projection(model.config.hidden_size, next(model.parameters()).device)
            self._skipped = ([tokenizer.convert_tokens_to_ids(t) for t in punctuation_tokens(tokenizer)]
                             if tokenizer is not None and settings.skip_punctuation else [])
            if tokenizer is not None and tokenizer.mask_token_id is None:
                raise RecipeError("embedding", "multi_vector expands queries with the tokenizer's mask token, and "
                                               "this tokenizer has none; use one with a mask token (BERT-style)")
        if settings.static_query:
            self._add_static_query_weight(model, tokenizer)

    def _add_static_query_weight(self, model: "PreTrainedModel", tokenizer: Any) -> None:
        """One weight per vocabulary token, 1 until initialised (`initialise_static_query`) or loaded. Trained fully,
        beside the model (outside what LoRA wraps), as the ColBERT projection."""
        vocab_size = model.config.vocab_size
        # sentence-transformers sizes its SparseStaticEmbedding by the tokenizer: the saved folder loads there only
        # when the tokenizer and the MLM head agree.
        if tokenizer is not None and len(tokenizer.get_vocab()) != vocab_size:
            raise RecipeError("query_encoder", f"query_encoder: static needs one weight per token of both the "
                                               f"tokenizer ({len(tokenizer.get_vocab())} tokens) and the masked-LM "
                                               f"head ({vocab_size}); use a model whose vocab_size matches its "
                                               "tokenizer")
        self.static_query_weight = torch.nn.Parameter(torch.ones(vocab_size, device=next(model.parameters()).device))
        self.static_query_from = "ones"  # where the weights came from: ones, idf, a JSON path, or a saved model

    def initialise_static_query(self, documents: "Iterable[str] | None") -> None:
        """Set the static query weights as `static_query_init` says: IDF over `documents` (the training documents;
        None: unknown, the weights stay 1), ones, or a JSON file. A model continued from a saved static one keeps
        its weights."""
        init = self.settings.static_query_init
        if self.static_query_from == "saved" or init == "ones" or (init == IDF and documents is None):
            return
        vocab_size = self.static_query_weight.shape[0]
        if init == IDF:
            weight = idf_weights(documents, self.tokenizer, vocab_size, self.settings.max_length)
        else:
            weight = weights_from_json(init, self.tokenizer, vocab_size, "static_query_init")
        with torch.no_grad():
            self.static_query_weight.copy_(weight)
        self.static_query_from = init

    @classmethod
    def embedding_dim_of(cls, config: "PretrainedConfig") -> int:
        return config.hidden_size

    @classmethod
    def auto_class_for(cls, settings: TextSettings) -> str:
        return MASKED_LM if settings.sparse else cls.auto_class

    @classmethod
    def hf_config(cls, settings: TextSettings, tokenizer: Any = None) -> "PretrainedConfig":
        config = super().hf_config(settings, tokenizer)
        if settings.sparse:  # before any weight is read
            pretrained = settings.model_name is not None
            require_masked_lm(config, "model_name" if pretrained else "model_config", pretrained)
        return config

    @classmethod
    def embedding_dim_for(cls, recipe: "Recipe") -> int:
        settings = cls.settings_of(recipe)
        return cls.hf_config(settings).vocab_size if settings.sparse else super().embedding_dim_for(recipe)

    @property
    def embedding_dim(self) -> int:
        """The size of one vector: the vocabulary's (sparse), a token's (multi_vector) or a side's (single)."""
        return self.model.config.vocab_size if self.settings.sparse else super().embedding_dim

    @classmethod
    def resolve(cls, settings: PretrainedSettings, tokenizer: Any, config: "PretrainedConfig") -> PretrainedSettings:
        resolved = super().resolve(settings, tokenizer, config)
        if resolved.multi_vector:
            resolve_max_length(resolved.query_length, tokenizer, config, key="query_length")  # within the positions
        return resolved

    @classmethod
    def from_recipe(cls, recipe: "Recipe") -> "TextAdapter":
        adapter = super().from_recipe(recipe)
        if adapter.settings.multi_vector:
            adapter._add_prefix_tokens()
        name = adapter.settings.model_name
        if adapter.settings.multi_vector and name is not None and Path(name, PROJECTION_FOLDER).is_dir():
            adapter.load_projection(name)  # continuing from a saved ColBERT (ours or PyLate's): keep its projection
        if adapter.settings.static_query:
            if name is not None and Path(name, STATIC_FOLDER).is_dir():  # continuing from a saved static model
                adapter.load_static_query_weight(name)
            elif adapter.settings.static_query_init != IDF:  # IDF needs the training documents: the task's
                adapter.initialise_static_query(None)
        return adapter

    @classmethod
    def load(cls, path: str | Path, *, trust_remote_code: bool = False) -> "TextAdapter":
        adapter = super().load(path, trust_remote_code=trust_remote_code)
        if adapter.settings.static_query:
            adapter.load_static_query_weight(path)
        return adapter

    def learning_rate_scales(self, learning_rate: float) -> dict[torch.nn.Parameter, float]:
        rate = self.settings.static_query_lr if self.settings.static_query else None
        return {} if rate is None else {self.static_query_weight: rate / learning_rate}

    def load_static_query_weight(self, path: str | Path) -> None:
        try:
            weight = read_static_query_weight(path)
        except FileNotFoundError as missing:
            raise RecipeError("model", f"{str(path)!r} holds a static query encoder without its weights "
                                       f"({missing})") from None
        if weight.shape != self.static_query_weight.shape:
            raise RecipeError("model", f"{Path(path, STATIC_FOLDER)} holds {weight.shape[0]} static query weights, "
                                       f"this model's vocabulary {self.static_query_weight.shape[0]} tokens")
        with torch.no_grad():
            self.static_query_weight.copy_(weight)
        self.static_query_from = "saved"

    def save(self, path: str | Path) -> None:
        super().save(path)
        if self.settings.sparse:
            settings = self.settings
            write_sparse_encoder_files(path, settings.sparse_pooling, settings.max_length, settings.static_query)
            if settings.static_query:
                write_static_query_files(path, self.static_query_weight, self.tokenizer, settings.max_length)
        if self.settings.multi_vector:
            skipped = punctuation_tokens(self.tokenizer) if self.settings.skip_punctuation else []
            write_pylate_files(path, self.settings, self.projection.weight, skipped)

    def _add_prefix_tokens(self) -> None:
        """The query and document prefixes as one new token each (as PyLate adds them), so that a prefix is one
        position, never split into pieces (nor into punctuation the skip-list would drop); the embedding table grows
        to hold them. A tokenizer that has them already (a saved ColBERT) is left as it is."""
        prefixes = [p for p in (self.settings.query_prefix, self.settings.document_prefix) if p]
        rows = self.model.get_input_embeddings().num_embeddings
        if self.tokenizer.add_tokens(prefixes) and len(self.tokenizer) > rows:
            self.model.resize_token_embeddings(len(self.tokenizer))

    @classmethod
    def card_rows(cls, settings: dict[str, Any]) -> list[list[Any]]:
        skip = settings.get("skip_punctuation")
        return [
            *([f"{role} prefix", f"`{prefix!r}` (one token)" if prefix else "none"]
              for role, prefix in (("query", settings.get("query_prefix")),
                                   ("document", settings.get("document_prefix")))),
            ["query length", f"{settings.get('query_length')} tokens: longer queries truncated, shorter ones expanded "
                             "with the mask token (attended, scored)"],
            ["document length", f"at most {settings.get('max_length')} tokens"],
            ["punctuation skip-list", "documents' punctuation tokens give no vector" if skip else "off"],
        ]

    @classmethod
    def sentence_transformers_modules(cls, path: Path, info: dict[str, Any], trust_remote_code: bool) -> list[Any]:
        """Transformer -> Pooling (this adapter's pooling) [-> Normalize]."""
        from vembed.models import sentence_transformers as st

        settings = info["settings"]
        if settings.get("embedding") == "multi_vector":
            raise RecipeError("model", f"{str(path)!r} is a multi_vector (ColBERT) model: it gives token vectors, "
                                       "which a sentence-transformers model does not; load it with vembed.load")
        return [st.transformer(path, settings, trust_remote_code),
                st.pooling(info["embedding_dim"], settings.get("pooling", "mean")), *st.normalize(settings)]

    @classmethod
    def transformers_example(cls, path: str, settings: dict[str, Any], texts: list[str]) -> str | None:
        """The encoder's last hidden states, pooled as this adapter pools them (`vembed/models/pooling.py`), or the
        masked-LM head's logits SPLADE-pooled (sparse); None for token vectors (prefix tokens, query expansion,
        skip-list and projection are vembed's)."""
        if settings.get("embedding") == "multi_vector":
            return None
        if settings.get("embedding") == SPARSE:  # a static query encoder's queries are vembed's (or ST's) own
            return None if settings.get("query_encoder") == STATIC else sparse_transformers_example(path, settings,
                                                                                                    texts)
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
        if self.settings.static_query and any(side.role == "query" for side in sides):
            return self._static_query_batch(sides)
        if not self.settings.multi_vector:
            return make_batch(sides, self.tokenizer, None, max_length=self.settings.max_length,
                              text_keys=self._text_keys)
        roles = {side.role == "query" for side in sides}
        if len(roles) > 1:
            raise ValueError("a multi_vector batch holds queries or documents, not both: preprocess them apart")
        settings = self.settings
        if roles == {True}:
            sides = [replace(side, text=settings.query_prefix + (side.text or "")) for side in sides]
            batch = make_batch(sides, self.tokenizer, None, max_length=settings.query_length,
                               text_keys=self._text_keys, padding="max_length")
            # Query expansion: the padding becomes mask tokens, attended and scored like the query's own tokens.
            expansion = batch["attention_mask"] == 0
            batch["input_ids"] = batch["input_ids"].masked_fill(expansion, self.tokenizer.mask_token_id)
            batch["attention_mask"] = torch.ones_like(batch["attention_mask"])
            batch[VECTOR_MASK] = torch.ones_like(batch["attention_mask"], dtype=torch.bool)
            return batch
        sides = [replace(side, text=settings.document_prefix + (side.text or "")) for side in sides]
        batch = make_batch(sides, self.tokenizer, None, max_length=settings.max_length, text_keys=self._text_keys)
        kept = batch["attention_mask"].bool()
        if self._skipped:
            kept &= ~torch.isin(batch["input_ids"], torch.tensor(self._skipped))
        batch[VECTOR_MASK] = kept
        return batch

    def forward_flops(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor | int:
        """No model FLOPs for static queries (a lookup of their tokens' weights); the default otherwise."""
        return 0 if STATIC_QUERY_TOKENS in inputs else super().forward_flops(inputs)

    def _static_query_batch(self, sides: Sequence["Side"]) -> dict[str, torch.Tensor]:
        """Queries for the static encoder, tokenised as sentence-transformers' SparseStaticEmbedding does: no special
        tokens, cut at max_length. Documents (role "document" or unknown: ST's default route) go through the model."""
        if any(side.role != "query" for side in sides):
            raise ValueError("a batch for a static query encoder holds queries or documents, not both: preprocess "
                             "them apart")
        batch = make_batch(sides, self.tokenizer, None, max_length=self.settings.max_length,
                           text_keys=self._text_keys, add_special_tokens=False)
        batch[STATIC_QUERY_TOKENS] = batch["attention_mask"].bool()
        return batch

    def encode(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        tokens = {key: value for key, value in inputs.items() if key in self._text_keys}
        if STATIC_QUERY_TOKENS in inputs:
            weights = static_query_vectors(inputs["input_ids"], inputs[STATIC_QUERY_TOKENS], self.static_query_weight)
            return self._pruned(weights)
        if self.settings.sparse:
            return self._sparse_vectors(tokens)
        hidden = self._per_token(tokens, lambda output: output.last_hidden_state)
        if self.settings.multi_vector:
            return self.token_vectors(hidden, inputs[VECTOR_MASK])
        # Every side has text, so TEXT_INDEX is 0..n-1 and rows are already in side order.
        embeddings = pool(hidden, tokens.get("attention_mask"), self.settings.pooling).float()
        return F.normalize(embeddings, dim=-1) if self.settings.normalize else embeddings

    def _sparse_vectors(self, tokens: dict[str, torch.Tensor]) -> torch.Tensor:
        """`(n, vocab_size)` SPLADE weights (`vembed.models.splade`); pruned to sparse_top_k only outside training."""
        logits = self._per_token(tokens, lambda output: output.logits)
        return self._pruned(splade_pool(logits, tokens["attention_mask"], self.settings.sparse_pooling))

    def _pruned(self, weights: torch.Tensor) -> torch.Tensor:
        """Sparse `weights` pruned to sparse_top_k, outside training only."""
        top_k = self.settings.sparse_top_k
        return keep_top_k(weights, top_k) if top_k is not None and not self.training else weights

    def _per_token(self, tokens: dict[str, torch.Tensor], read: Callable[[Any], torch.Tensor]) -> torch.Tensor:
        """`read(model output)`, a (rows, positions, ...) per-token tensor, computed packed when `packing` is on."""
        if self.settings.packing:
            return packed_forward(self.model, tokens, read, self._text_keys, self._first_position)
        return read(self.model(**tokens))


def punctuation_tokens(tokenizer: Any) -> list[str]:
    """The punctuation characters that are tokens of `tokenizer` (ColBERT's document skip-list); the others would
    map to the unknown token, which is kept."""
    known = [(char, tokenizer.convert_tokens_to_ids(char)) for char in string.punctuation]
    return [char for char, token_id in known if token_id is not None and token_id != tokenizer.unk_token_id]
