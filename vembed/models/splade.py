"""`embedding: sparse` on the text adapter (SPLADE): one vocabulary-sized vector per side from the masked-LM head,
as sentence-transformers' SparseEncoder (MLMTransformer -> SpladePooling) computes it, and the files that make a
saved folder load there.

    weights[i, v] = pool over the attended tokens t of side i of log(1 + relu(logits[i, t, v]))   (pool: max or sum)

No L2 normalisation: a sparse vector is scored by dot product, and its size is what the FLOPS regulariser
(vembed/losses/sparse.py) shrinks. `sparse_top_k` keeps each vector's k largest weights at inference only (ST's
`max_active_dims`), never in training, where the pruned weights would get no gradient."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vembed.errors import RecipeError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SPARSE = "sparse"  # the `embedding` value, and the adapter's `embedding_kind`
MASKED_LM = "AutoModelForMaskedLM"  # the transformers Auto class whose logits SPLADE pools
POOLING_FOLDER = "1_SpladePooling"  # where sentence-transformers keeps the SpladePooling module's config
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


def sparse_encoder_config(pooling: str, max_length: int | None) -> dict[str, dict[str, Any] | list[Any]]:
    """The sentence-transformers files (besides the HF model and tokenizer) of a SparseEncoder folder: file name ->
    content, as sentence-transformers 6.2 writes them, with vembed's truncation and dot-product scores."""
    transformer = {"transformer_task": "fill-mask",
                   "modality_config": {"text": {"method": "forward", "method_output_name": "logits"}},
                   "module_output_name": "token_embeddings"}
    if max_length is not None:
        transformer["max_seq_length"] = max_length
    return {
        "modules.json": MODULES,
        "sentence_bert_config.json": transformer,
        "config_sentence_transformers.json": {"model_type": "SparseEncoder", "prompts": {"query": "", "document": ""},
                                              "default_prompt_name": None, "similarity_fn_name": "dot"},
        f"{POOLING_FOLDER}/config.json": {"pooling_strategy": pooling, "activation_function": "relu",
                                          "embedding_dimension": None},
    }


def write_sparse_encoder_files(path: str | Path, pooling: str, max_length: int | None) -> None:
    """Make the saved folder `path` (HF masked-LM model and tokenizer already there) a sentence-transformers
    SparseEncoder folder: `SparseEncoder(path)` then gives this adapter's vectors."""
    for name, content in sparse_encoder_config(pooling, max_length).items():
        file = Path(path, name)
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(json.dumps(content, indent=2))


__all__ = ["MASKED_LM", "SPARSE", "keep_top_k", "require_masked_lm", "sparse_transformers_example", "splade_pool",
           "write_sparse_encoder_files"]
