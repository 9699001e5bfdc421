"""The second stage: rerankers that read a (query, document) pair jointly and give it one score.

- `cross_encoder.py` the text cross-encoder, chosen by `model_type` through RERANKERS;
- `losses.py` losses on a batch of score lists, chosen by `loss_type` through RANKING_LOSSES;
- `data.py` the lists (a query, its documents, their labels) from corpus folders and list/pair files;
- `task.py` how it is trained (the `rerank` task).

Separate registries, as for the generative path: a reranker embeds nothing, so `vembed.load`, `vembed mine` and the
embedding evaluation (which look in MODELS) refuse it instead of treating its scores as embeddings.
"""

from __future__ import annotations

from typing import Any

from vembed.registry import Registry

RERANKERS: Registry[Any] = Registry("model_type", modules=("vembed.reranking.cross_encoder",))
RANKING_LOSSES: Registry[Any] = Registry("loss_type", modules=("vembed.reranking.losses",))

__all__ = ["RANKING_LOSSES", "RERANKERS"]
