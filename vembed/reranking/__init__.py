"""The second stage: rerankers that read a (query, document) pair jointly and give it one score.

- `cross_encoder.py` the text cross-encoder and `qwen_vl_reranker.py` the Qwen-VL reranker (text and image documents,
  scored by the LM head's "yes" and "no" rows; built on the Qwen-VL family of vembed/models/qwen_vl.py), chosen by
  `model_type` through RERANKERS;
- `losses.py` losses on a batch of score lists, chosen by `loss_type` through RANKING_LOSSES;
- `data.py` the lists (a query, its documents, their labels) from corpus folders and list/pair files;
- `evaluation.py` reranking a first-stage run and judging both; `metric_names.py` its metric names and before/after
  rows (what the CLI's table and the model card show);
- `task.py` how it is trained (the `rerank` task).

Separate registries, as for the generative path: a reranker embeds nothing, so `vembed.load`, `vembed mine` and the
embedding evaluation (which look in MODELS) refuse it instead of treating its scores as embeddings.
"""

from __future__ import annotations

import os
from typing import Any

from vembed.registry import Registry

RERANKERS: Registry[Any] = Registry("model_type", modules=("vembed.reranking.cross_encoder",
                                                                  "vembed.reranking.qwen_vl_reranker"))
RANKING_LOSSES: Registry[Any] = Registry("loss_type", modules=("vembed.reranking.losses",))



def saved_reranker_type(path: str | os.PathLike) -> str | None:
    """The reranker `model_type` a folder saved by vembed holds, or None (not a folder, not vembed's, an embedder)."""
    import json
    from pathlib import Path

    from vembed.models.base import ADAPTER_FILE

    file = Path(path, ADAPTER_FILE)
    try:
        model_type = json.loads(file.read_text()).get("model_type") if file.is_file() else None
    except (OSError, ValueError, AttributeError):
        return None
    return model_type if model_type in RERANKERS else None


def load_reranker(path: str | os.PathLike, *, trust_remote_code: bool = False, key: str = "model_dir") -> Any:
    """The reranker saved by vembed at `path`, on the CPU. A folder that holds anything else (an embedder, a
    transformers or sentence-transformers folder) is a RecipeError naming `key`."""
    from vembed.errors import RecipeError

    model_type = saved_reranker_type(path)
    if model_type is None:
        raise RecipeError(key, f"{str(path)!r} is not a reranker saved by vembed (its vembed.json names no "
                               f"reranker model_type: {', '.join(RERANKERS.names())}); name the reranker's folder, "
                               "e.g. runs/reranker/final")
    return RERANKERS.get(model_type).load(path, trust_remote_code=trust_remote_code)


__all__ = ["RANKING_LOSSES", "RERANKERS", "load_reranker", "saved_reranker_type"]
