"""Loading a model for scoring or mining whoever saved it: a vembed folder (`vembed.json`), a sentence-transformers
folder (`modules.json`), a plain transformers folder (`config.json`), or a hub id of either (online, or in the local
cache). `vembed eval` and `vembed mine` call `load_embedding_model`, so the base model is scored and mined with as its
fine-tuned successor is.

A foreign folder becomes a `text` adapter that embeds as sentence-transformers does: its Pooling module's mode (mean
for a plain transformers folder, sentence-transformers' default), L2-normalised only when the folder has a Normalize
module, and its truncation length. The folder's configuration is read as JSON, so sentence-transformers need not be
installed; a module vembed cannot reproduce (Dense, max pooling, a default prompt) is refused by name.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vembed.errors import RecipeError

if TYPE_CHECKING:
    from vembed.models.base import EmbeddingAdapter

ST_MODULES = "modules.json"
HF_CONFIG = "config.json"
# sentence-transformers pooling modes (its v6 `pooling_mode`, or the older per-mode flags) -> vembed's pooling.
POOLING = {"mean": "mean", "cls": "cls", "lasttoken": "last"}
_OLD_POOLING_FLAGS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
                      "pooling_mode_lasttoken": "lasttoken", "pooling_mode_max_tokens": "max",
                      "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                      "pooling_mode_weightedmean_tokens": "weightedmean"}


def model_folder(name: str | os.PathLike, key: str = "model_dir") -> Path:
    """The local folder of `name`: itself when it is a folder, else a hub id's snapshot (downloaded when online;
    offline, only one already in the local cache). A RecipeError naming `key` otherwise."""
    path = Path(name)
    if path.is_dir():
        return path
    text = str(name)
    if path.exists():
        raise RecipeError(key, f"{text} is a file; give a model folder (vembed, sentence-transformers or transformers)")
    parts = text.split("/")
    if text.startswith((".", "/", "~")) or len(parts) > 2 or not all(parts):
        raise RecipeError(key, f"{text} is not a folder (nor a hub id, org/name); give a model folder")
    from huggingface_hub import snapshot_download

    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    try:
        return Path(snapshot_download(text, local_files_only=offline))
    except Exception as err:  # hub errors are many types; one line names the id either way
        if offline:
            raise RecipeError(key, f"{text} is neither a local folder nor in the hub cache, and HF_HUB_OFFLINE is set; "
                                   "download it while online or pass a local folder") from None
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RecipeError(key, f"{text} is not a local folder, and the hub cannot give it as a model id: "
                               f"{first}") from None


ST_CONFIG = "config_sentence_transformers.json"
EMBEDS_NOTHING = "it scores (query, document) pairs and embeds nothing"


def reranker_kind(folder: Path) -> str | None:
    """What `folder` holds, in words, when it is a reranker (a cross-encoder) whoever saved it; None otherwise. Judged
    by what the model is, from its config files alone (no weight read): vembed's marker names a reranker model_type;
    sentence-transformers' config says CrossEncoder; or transformers' config.json names a *ForSequenceClassification
    architecture (a cross-encoder such as cross-encoder/ms-marco-MiniLM-L6-v2, or a classifier: scores, never
    embeddings)."""
    from vembed.models.base import ADAPTER_FILE
    from vembed.reranking import saved_reranker_type

    saved = saved_reranker_type(folder)
    if saved:
        return f"a {saved!r} reranker"  # vembed.json says so
    if (folder / ADAPTER_FILE).is_file():  # vembed's own folder says what it holds
        return None
    if _read_json_quietly(folder / ST_CONFIG).get("model_type") == "CrossEncoder":
        return "a sentence-transformers CrossEncoder"
    architectures = _read_json_quietly(folder / HF_CONFIG).get("architectures") or []
    heads = [name for name in architectures if isinstance(name, str) and name.endswith("ForSequenceClassification")]
    if heads:
        return f"a transformers {heads[0]} (a cross-encoder reranker or a classifier)"
    return None


def require_embedder(name: str | os.PathLike, key: str = "model_dir", instead: str = "") -> Path:
    """The local folder of `name` (as `model_folder`) when it may hold an embedding model; a RecipeError naming `key`
    when it holds a reranker (`reranker_kind`), with `instead`: what the caller's command does with one. What every
    command that embeds with a model it is handed (eval, mine, export, search) calls before it reads or writes
    anything else."""
    folder = model_folder(name, key)
    kind = reranker_kind(folder)
    if kind is not None:
        raise RecipeError(key, f"{name} is {kind}: {EMBEDS_NOTHING}; "
                               f"{instead or 'use an embedding model here, and the reranker on its candidates'}")
    return folder


def _read_json_quietly(path: Path) -> dict[str, Any]:
    """A config file's JSON object, or {} when there is none to read (the loaders say why when they need it)."""
    try:
        data = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def load_embedding_model(name: str | os.PathLike, *, trust_remote_code: bool = False,
                         key: str = "model_dir") -> "EmbeddingAdapter":
    """The embedding model at `name` (see the module docstring for what is accepted), on the CPU in eval mode; a
    reranker, whoever saved it, is refused (`require_embedder`)."""
    from vembed.models.base import ADAPTER_FILE, load_adapter

    folder = require_embedder(name, key)
    if (folder / ADAPTER_FILE).is_file():
        return load_adapter(folder, trust_remote_code=trust_remote_code)
    if (folder / ST_MODULES).is_file():
        return _sentence_transformers_folder(folder, trust_remote_code, key)
    if (folder / HF_CONFIG).is_file():
        return _text_adapter(folder, "mean", normalize=False, max_length=None, trust_remote_code=trust_remote_code,
                             key=key)
    raise RecipeError(key, f"{name} is not a model folder: it has no {ADAPTER_FILE} (vembed), {ST_MODULES} "
                           f"(sentence-transformers) or {HF_CONFIG} (transformers)")


def _read_json(path: Path, key: str) -> dict[str, Any]:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError) as err:
        raise RecipeError(key, f"{path} cannot be read as JSON: {err}") from None


def _sentence_transformers_folder(folder: Path, trust_remote_code: bool, key: str) -> "EmbeddingAdapter":
    """Transformer -> Pooling [-> Normalize], the sentence-transformers pipelines a text adapter reproduces."""
    modules = json.loads((folder / ST_MODULES).read_text())
    kinds = [(str(m.get("type", "")).rsplit(".", 1)[-1], folder / m.get("path", "")) for m in modules]
    names = [kind for kind, _ in kinds]
    if names[:2] != ["Transformer", "Pooling"] or names[2:] not in ([], ["Normalize"]):
        raise RecipeError(key, f"{folder} is a sentence-transformers model of modules {' -> '.join(names)}; vembed "
                               "reads Transformer -> Pooling [-> Normalize] only")
    transformer, pooling_dir = kinds[0][1], kinds[1][1]
    pooling = _pooling_mode(_read_json(pooling_dir / "config.json", key))
    if pooling not in POOLING:
        raise RecipeError(key, f"{folder} pools with {pooling!r}; vembed pools with {', '.join(POOLING)} only")
    st_config = _read_json(folder / ST_CONFIG, key)
    if st_config.get("default_prompt_name"):
        raise RecipeError(key, f"{folder} prepends its prompt {st_config['default_prompt_name']!r} to every text; "
                               "vembed does not apply sentence-transformers prompts")
    bert_config = _read_json(transformer / "sentence_bert_config.json", key)
    if bert_config.get("do_lower_case"):
        raise RecipeError(key, f"{folder} lowercases texts in sentence-transformers (do_lower_case); vembed does not")
    return _text_adapter(transformer, POOLING[pooling], normalize=names[2:] == ["Normalize"],
                         max_length=bert_config.get("max_seq_length"), trust_remote_code=trust_remote_code, key=key)


def _pooling_mode(config: dict[str, Any]) -> str:
    if "pooling_mode" in config:
        return str(config["pooling_mode"])
    on = [mode for flag, mode in _OLD_POOLING_FLAGS.items() if config.get(flag)]
    return on[0] if len(on) == 1 else "+".join(on) or "mean"


def _text_adapter(folder: Path, pooling: str, *, normalize: bool, max_length: int | None, trust_remote_code: bool,
                  key: str) -> "EmbeddingAdapter":
    from vembed.models.hf import auto_config, load_model, load_tokenizer
    from vembed.models.text import TextAdapter, TextSettings

    config = auto_config(str(folder), None, key=key, trust_remote_code=trust_remote_code)
    if hasattr(config, "vision_config") or not hasattr(config, "hidden_size"):
        raise RecipeError(key, f"{folder} holds a {config.model_type!r} transformers model; vembed reads a folder "
                               "without vembed.json as a text encoder only (save image models with vembed)")
    model = load_model(str(folder), None, key=key, trust_remote_code=trust_remote_code)
    tokenizer = load_tokenizer(str(folder), trust_remote_code, key=key)
    settings = TextSettings(pooling=pooling, normalize=normalize, max_length=max_length,
                            trust_remote_code=trust_remote_code)
    return TextAdapter(model, tokenizer, None, TextAdapter.resolve(settings, tokenizer, model.config)).eval()
