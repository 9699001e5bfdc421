"""vembed: fine-tune embedding models (CLIP, SigLIP, text encoders, composed towers) from one YAML recipe."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:
    from vembed.api import Classifier, Embedder, Reranker


def load(path: str, device: str | None = None, *, trust_remote_code: bool = False
         ) -> "Embedder | Classifier | Reranker":
    """Load a model saved by vembed (`output_dir/final`) as what it is for: an embedder
    (`vembed.load(p).encode(texts=[...])`, `.search(queries, corpus)`), an image classifier (`.predict(images)`) or a
    reranker (`.rank(query, documents)`).

    Python code shipped inside the folder runs only with `trust_remote_code=True` (for folders you trust), never
    because the folder's own files ask for it."""
    from vembed.api import load_model  # lazy: keeps `import vembed` free of torch/transformers

    return load_model(path, device=device, trust_remote_code=trust_remote_code)
