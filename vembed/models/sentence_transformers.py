"""sentence-transformers modules over a folder vembed saved, for adapters that describe themselves to it
(`sentence_transformers_modules`; `vembed export`). sentence-transformers is optional and imported only here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# vembed pooling name -> sentence-transformers Pooling mode (vembed's cls is the first attended token, which is the
# first token under the right padding text encoders use).
POOLING_MODES = {"cls": "cls", "mean": "mean", "last": "lasttoken"}


def transformer(path: Path, settings: dict[str, Any], trust_remote_code: bool, **kwargs: Any) -> Any:
    """sentence-transformers' Transformer module over the HF files vembed saved, with vembed's truncation."""
    from sentence_transformers.base.modules import Transformer

    trust = {"trust_remote_code": True} if trust_remote_code else {}
    return Transformer(str(path), max_seq_length=settings.get("max_length"), model_kwargs=dict(trust),
                       processor_kwargs=dict(trust), config_kwargs=dict(trust), **kwargs)


def pooling(embedding_dim: int, mode: str) -> Any:
    from sentence_transformers.sentence_transformer.modules import Pooling

    return Pooling(embedding_dim, pooling_mode=POOLING_MODES[mode])


def normalize(settings: dict[str, Any]) -> list[Any]:
    """[Normalize] when the adapter L2-normalises its embeddings, else nothing."""
    from sentence_transformers.base.modules import Normalize

    return [Normalize()] if settings.get("normalize", True) else []
