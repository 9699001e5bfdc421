"""`embedding: sparse` on the text adapter (SPLADE): one vocabulary-sized vector per side from the masked-LM head,
as sentence-transformers' SparseEncoder (MLMTransformer -> SpladePooling) computes it, and the files that make a
saved folder load there.

    weights[i, v] = pool over the attended tokens t of side i of log(1 + relu(logits[i, t, v]))   (pool: max or sum)

No L2 normalisation: a sparse vector is scored by dot product, and its size is what the FLOPS regulariser
(vembed/losses/sparse.py) shrinks. `sparse_top_k` keeps each vector's k largest weights at inference only (ST's
`max_active_dims`), never in training, where the pruned weights would get no gradient.

Inference-free SPLADE (`query_encoder: static`, sentence-transformers' Router with a SparseStaticEmbedding query
route): a query runs through no network. Its vector is one trainable weight per vocabulary token, kept where the
query has the token (its text tokenised without special tokens, each token counted once, no activation):

    query[i, v] = weight[v] if token v is among the attended tokens of query i else 0

Documents keep the MLM route above. The weights start from the IDF of the training documents' tokens
(`idf_weights`), from a sentence-transformers idf.json (token -> weight), or at 1."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vembed.errors import RecipeError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SPARSE = "sparse"  # the `embedding` value, and the adapter's `embedding_kind`
MASKED_LM = "AutoModelForMaskedLM"  # the transformers Auto class whose logits SPLADE pools
POOLING_FOLDER = "1_SpladePooling"  # where sentence-transformers keeps the SpladePooling module's config
STATIC = "static"  # the `query_encoder` value of inference-free SPLADE
# Where a static query encoder's weights (model.safetensors, key "weight") and tokenizer live, ST's Router's name.
STATIC_FOLDER = "query_0_SparseStaticEmbedding"
IDF = "idf"  # `static_query_init`: the IDF of the training documents' tokens
# sentence-transformers' module classes of a SparseEncoder folder (its modules.json), read from sentence-transformers
# 6.2's own save.
MODULES = [
    {"idx": 0, "name": "0", "path": "",
     "type": "sentence_transformers.sparse_encoder.modules.mlm_transformer.MLMTransformer"},
    {"idx": 1, "name": "1", "path": POOLING_FOLDER,
     "type": "sentence_transformers.sparse_encoder.modules.splade_pooling.SpladePooling"},
]


def splade_pool(logits: torch.Tensor, attention_mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """`(n, V)` float32 SPLADE weights of MLM `logits` `(n, T, V)`: log(1 + relu) of each attended token's logits,
    max- or sum-pooled over tokens. Masked first (as sentence-transformers does): padding gives 0, which neither
    pooling lets through, since every weight is >= 0."""
    weights = torch.log1p(torch.relu(logits.float() * attention_mask.unsqueeze(-1).float()))
    return weights.max(dim=1).values if pooling == "max" else weights.sum(dim=1)


def keep_top_k(weights: torch.Tensor, k: int) -> torch.Tensor:
    """`weights` `(n, V)` with all but each row's k largest set to 0 (the k kept as they are)."""
    if k >= weights.shape[-1]:
        return weights
    top = weights.topk(k, dim=-1)
    return torch.zeros_like(weights).scatter(-1, top.indices, top.values)


def static_query_vectors(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         weight: torch.Tensor) -> torch.Tensor:
    """`(n, V)` float32 inference-free query vectors: `weight[v]` for each token v attended in the row (once, however
    often it occurs), 0 elsewhere; as sentence-transformers' SparseStaticEmbedding."""
    present = torch.zeros(input_ids.shape[0], weight.shape[0], device=input_ids.device)
    present = present.scatter_reduce(1, input_ids, attention_mask.float(), reduce="amax")
    return present * weight.float()


def document_frequencies(documents: Iterable[str], tokenizer: Any, vocab_size: int,
                         max_length: int | None) -> tuple[torch.Tensor, int]:
    """(`(V,)` how many distinct documents hold each token, how many distinct documents): each tokenised as a query
    is (no special tokens), cut at `max_length` tokens as the document side is."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    distinct = sorted(set(documents))
    for start in range(0, len(distinct), 1024):  # bounded memory on a large corpus
        encoded = tokenizer(distinct[start:start + 1024], add_special_tokens=False, truncation=max_length is not None,
                            max_length=max_length)["input_ids"]
        for ids in encoded:
            counts[torch.tensor(sorted(set(ids)), dtype=torch.long)] += 1
    return counts, len(distinct)


def idf_weights(documents: Iterable[str], tokenizer: Any, vocab_size: int, max_length: int | None) -> torch.Tensor:
    """`(V,)` float32 IDF of each token over the distinct `documents`, as BM25 (Lucene) weighs a term:
    log(1 + (N - df + 0.5) / (df + 0.5)), positive for every token; a token no document holds gets the largest.
    (sentence-transformers reads IDF from a file and computes none; this is the standard sparse-retrieval IDF.)"""
    df, n = document_frequencies(documents, tokenizer, vocab_size, max_length)
    return torch.log1p((n - df + 0.5) / (df + 0.5)).float()


def weights_from_json(path: str | Path, tokenizer: Any, vocab_size: int, key: str) -> torch.Tensor:
    """`(V,)` float32 weights of a sentence-transformers idf.json (token -> weight; SparseStaticEmbedding.from_json):
    0 for every token it does not list."""
    try:
        table = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise RecipeError(key, f"cannot read {str(path)!r} as a JSON object of token -> weight: {err}") from None
    if not isinstance(table, dict) or not all(isinstance(w, (int, float)) for w in table.values()):
        raise RecipeError(key, f"{str(path)!r} is not a JSON object of token -> weight (a number)")
    weight = torch.zeros(vocab_size)
    ids = tokenizer.convert_tokens_to_ids(list(table))
    unknown = [token for token, token_id in zip(table, ids) if token_id is None or token_id >= vocab_size]
    if unknown:
        raise RecipeError(key, f"{str(path)!r} lists tokens this tokenizer does not have: {unknown[:5]}")
    weight[torch.tensor(ids, dtype=torch.long)] = torch.tensor([float(w) for w in table.values()])
    return weight


def require_masked_lm(config: "PretrainedConfig", key: str, pretrained: bool) -> None:
    """Refuse, before any weight is read, a model transformers has no masked-LM head for, or (`pretrained`) a
    checkpoint saved without one (its `architectures` name no *ForMaskedLM class): its head would start random."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING

    if type(config) not in MODEL_FOR_MASKED_LM_MAPPING:
        raise RecipeError(key, f"embedding: sparse pools a masked-LM head's logits, and transformers has none for "
                               f"model_type {config.model_type!r}; use a BERT-style encoder with an MLM head "
                               "(bert, distilbert, roberta, ...) or embedding: single")
    architectures = getattr(config, "architectures", None) or []
    if pretrained and architectures and not any(name.endswith("ForMaskedLM") for name in architectures):
        raise RecipeError(key, f"embedding: sparse pools a masked-LM head's logits, and this checkpoint was saved "
                               f"without one ({', '.join(architectures)}): its head would start random; use a "
                               "checkpoint saved with its MLM head (e.g. bert-base-uncased, a SPLADE model) or "
                               "embedding: single")


def sparse_transformers_example(path: str, settings: dict[str, Any], texts: list[str]) -> str:
    """Python that computes a saved sparse model's vectors of `texts` with plain transformers (the model card's)."""
    pooled = ("weights.max(dim=1).values" if settings.get("sparse_pooling", "max") == "max"
              else "weights.sum(dim=1)")
    return (
        "import torch\n"
        "from transformers import AutoModelForMaskedLM, AutoTokenizer\n"
        f"model = AutoModelForMaskedLM.from_pretrained({path!r}).eval()\n"
        f"tokenizer = AutoTokenizer.from_pretrained({path!r})\n"
        f"tokens = tokenizer({texts!r}, padding=True, truncation=True, max_length={settings.get('max_length')}, "
        "return_tensors=\"pt\")\n"
        "with torch.no_grad():\n"
        "    logits = model(**tokens).logits\n"
        "weights = torch.log1p(torch.relu(logits * tokens[\"attention_mask\"].unsqueeze(-1)))\n"
        f"embeddings = {pooled}  # (texts, vocabulary), scored by dot product"
    )


# The Router of an inference-free folder (its router_config.json, as sentence-transformers 6.2 writes it): the query
# route the static weights, the document route the MLM transformer (the HF model at the folder's root, module id ".",
# so that one copy of the weights serves vembed, transformers and sentence-transformers) and its SpladePooling.
ROUTER = "sentence_transformers.base.modules.router.Router"
STATIC_MODULE = "sentence_transformers.sparse_encoder.modules.sparse_static_embedding.SparseStaticEmbedding"


def router_config() -> dict[str, Any]:
    types = {STATIC_FOLDER: STATIC_MODULE, ".": MODULES[0]["type"], POOLING_FOLDER: MODULES[1]["type"]}
    return {"types": types, "structure": {"query": [STATIC_FOLDER], "document": [".", POOLING_FOLDER]},
            "parameters": {"default_route": "document", "allow_empty_key": True, "route_mappings": {}}}


def sparse_encoder_config(pooling: str, max_length: int | None,
                          static_query: bool = False) -> dict[str, dict[str, Any] | list[Any]]:
    """The sentence-transformers files (besides the HF model and tokenizer) of a SparseEncoder folder: file name ->
    content, as sentence-transformers 6.2 writes them, with vembed's truncation and dot-product scores;
    `static_query`: a Router whose query route is the static weights (their files: `write_static_query_files`)."""
    transformer = {"transformer_task": "fill-mask",
                   "modality_config": {"text": {"method": "forward", "method_output_name": "logits"}},
                   "module_output_name": "token_embeddings"}
    if max_length is not None:
        transformer["max_seq_length"] = max_length
    modules = [{"idx": 0, "name": "0", "path": "", "type": ROUTER}] if static_query else MODULES
    files = {
        "modules.json": modules,
        "sentence_bert_config.json": transformer,
        "config_sentence_transformers.json": {"model_type": "SparseEncoder", "prompts": {"query": "", "document": ""},
                                              "default_prompt_name": None, "similarity_fn_name": "dot"},
        f"{POOLING_FOLDER}/config.json": {"pooling_strategy": pooling, "activation_function": "relu",
                                          "embedding_dimension": None},
    }
    if static_query:
        files["router_config.json"] = router_config()
        files[f"{STATIC_FOLDER}/config.json"] = {"frozen": False}
    return files


def write_sparse_encoder_files(path: str | Path, pooling: str, max_length: int | None,
                               static_query: bool = False) -> None:
    """Make the saved folder `path` (HF masked-LM model and tokenizer already there) a sentence-transformers
    SparseEncoder folder: `SparseEncoder(path)` then gives this adapter's vectors."""
    for name, content in sparse_encoder_config(pooling, max_length, static_query).items():
        file = Path(path, name)
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(json.dumps(content, indent=2))


def write_static_query_files(path: str | Path, weight: torch.Tensor, tokenizer: Any, max_length: int | None) -> None:
    """The static query weights and the tokenizer that splits queries, in `path/STATIC_FOLDER`. sentence-transformers
    truncates static queries at the tokenizer's model_max_length, so it is written as vembed's max_length."""
    from safetensors.torch import save_file

    folder = Path(path, STATIC_FOLDER)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({"weight": weight.detach().float().cpu().contiguous()}, str(folder / "model.safetensors"))
    tokenizer.save_pretrained(folder)
    if max_length is not None:
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text())
        config_file.write_text(json.dumps({**config, "model_max_length": max_length}, indent=2))


def read_static_query_weight(path: str | Path) -> torch.Tensor:
    """The static query weights saved in `path` (`write_static_query_files`)."""
    from safetensors.torch import load_file

    return load_file(str(Path(path, STATIC_FOLDER, "model.safetensors")))["weight"]


__all__ = ["IDF", "MASKED_LM", "SPARSE", "STATIC", "STATIC_FOLDER", "idf_weights", "keep_top_k",
           "read_static_query_weight", "require_masked_lm", "sparse_transformers_example", "splade_pool",
           "static_query_vectors", "weights_from_json", "write_sparse_encoder_files", "write_static_query_files"]
