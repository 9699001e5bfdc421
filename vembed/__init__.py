"""vembed: fine-tune embedding models (CLIP, SigLIP, text encoders, composed towers) from one YAML recipe."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:
    from vembed.api import Embedder


def load(path: str, device: str | None = None) -> "Embedder":
    """Load a model saved by vembed (`output_dir/final`) for encoding: `vembed.load(p).encode(texts=[...])`."""
    from vembed.api import Embedder  # lazy: keeps `import vembed` free of torch/transformers

    return Embedder.from_pretrained(path, device=device)
