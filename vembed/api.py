"""The Python entry point for using a trained model: `vembed.load(path).encode(texts=[...], images=[...])`."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import torch
import torch.nn.functional as F

from vembed.data.records import Side
from vembed.models.encoding import encode_sides

if TYPE_CHECKING:
    from PIL import Image

    from vembed.models.base import EmbeddingAdapter

ImageInput = Union[str, os.PathLike, "Image.Image"]


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class Embedder:
    """A saved vembed model ready to embed texts, images, or text+image pairs.

    >>> model = vembed.load("runs/demo/final")
    >>> q = model.encode(texts=["a red square"])           # (1, dim)
    >>> d = model.encode(images=["square.png"])             # paths or PIL images
    >>> scores = q @ d.T                                    # cosine similarities
    """

    def __init__(self, adapter: "EmbeddingAdapter", device: str | torch.device | None = None):
        self.device = torch.device(device or _default_device())
        self.adapter = adapter.to(self.device).eval()

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, device: str | torch.device | None = None, *,
                        trust_remote_code: bool = False) -> "Embedder":
        """Load a folder written by vembed (`output_dir/final` or a checkpoint's model), whatever its adapter.

        `device`: where to run (default: cuda when available, else cpu). `trust_remote_code`: let the folder run
        Python code it ships (models trained with `trust_remote_code: true` may need it); never on the folder's say.
        """
        from vembed.models.base import load_adapter
        from vembed.models.foreign import require_embedder

        if Path(path).is_dir():  # a reranker is refused by what it is, whoever saved it
            require_embedder(path, "model", instead="vembed.load embeds with embedding models vembed saved")
        return cls(load_adapter(Path(path), trust_remote_code=trust_remote_code), device=device)

    @property
    def embedding_dim(self) -> int:
        return self.adapter.embedding_dim

    @property
    def model_type(self) -> str:
        return self.adapter.model_type

    def encode(
        self,
        texts: str | Sequence[str] | None = None,
        images: ImageInput | Sequence[ImageInput | Sequence[ImageInput]] | None = None,
        batch_size: int = 32,
        show_progress: bool = False,
        normalize: bool = True,
        role: str | None = None,
    ) -> torch.Tensor:
        """Embed texts, images, or both; returns a CPU float32 tensor `(n, embedding_dim)`.

        - only `texts` (or only `images`): one row per item;
        - both, of equal length: item i is ONE side with text i and image i (e.g. a composed query "this shirt, in
          red"), fused as the adapter fuses text+image sides; one row per pair. To embed texts and images
          separately, call `encode` twice.

        `role="query"` embeds the items as queries: adapters with per-side instructions (qwen_vl) then use the
        query instruction; otherwise the document one.

        A single string or image is treated as a list of one. Images are file paths or PIL images; with qwen_vl an
        item may itself be a list of them (several images in one side). Rows are
        L2-normalised unless `normalize=False` (then they are whatever the model outputs).
        """
        if self.multi_vector:
            raise ValueError("this is a multi_vector (late-interaction: ColBERT, ColQwen) model: it gives token "
                             "vectors, not one vector per item; use encode_token_vectors(texts, images=..., role=...) "
                             "and score(queries, documents)")
        sides = _sides(texts, images, role, "encode")
        embeddings = encode_sides(self.adapter, sides, batch_size=batch_size, show_progress=show_progress)
        if normalize:
            embeddings = F.normalize(embeddings, dim=-1)
        return embeddings.cpu()

    @property
    def multi_vector(self) -> bool:
        """Whether the model gives token vectors (`embedding: multi_vector`: ColBERT, ColQwen) rather than one per side."""
        return getattr(self.adapter.settings, "embedding", "single") == "multi_vector"

    def encode_token_vectors(self, texts: str | Sequence[str] | None = None, role: str | None = None,
                             batch_size: int = 32, show_progress: bool = False,
                             images: ImageInput | Sequence[ImageInput | Sequence[ImageInput]] | None = None,
                             ) -> torch.Tensor:
        """Token vectors of a multi_vector (ColBERT, ColQwen) model: a CPU float32 tensor `(n, T, dim)`, row i
        holding item i's L2-normalised token vectors and zero vectors where it has no token
        (`vembed.models.token_vectors`). Items are texts, images (ColQwen: page screenshots), or both, as in `encode`.

        `role` (required): "query" or "document", prepared as in training (ColBERT: the query prefix and expansion
        to query_length, or the document prefix and skip-list; ColQwen: the query or the document instruction)."""
        if not self.multi_vector:
            raise ValueError(f"this {self.model_type} model gives one vector per text; use encode")
        if role not in ("query", "document"):
            raise ValueError(f"role must be 'query' or 'document', got {role!r}")
        sides = _sides(texts, images, role, "encode_token_vectors")
        return encode_sides(self.adapter, sides, batch_size=batch_size, show_progress=show_progress).cpu()

    @staticmethod
    def score(queries: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
        """`(n_queries, n_documents)` late-interaction (MaxSim) scores of `encode_token_vectors` outputs."""
        from vembed.models.maxsim import maxsim

        return maxsim(queries, documents)

    def __repr__(self) -> str:
        return f"Embedder(model_type={self.model_type!r}, embedding_dim={self.embedding_dim}, device={self.device})"


def _sides(texts: Any, images: Any, role: str | None, method: str) -> list[Side]:
    """`encode`'s items as sides: texts, images, or (equal numbers of) both, one side per item."""
    texts = [texts] if isinstance(texts, str) else texts
    images = [images] if isinstance(images, (str, os.PathLike)) or _is_pil(images) else images
    if texts is None and images is None:
        raise ValueError(f"{method} needs texts, images, or both")
    if texts is not None and images is not None and len(texts) != len(images):
        raise ValueError(
            f"got {len(texts)} texts and {len(images)} images; pairs need equal lengths "
            f"(to embed them separately, call {method}(texts=...) and {method}(images=...))"
        )
    if images is not None:
        images = [os.fspath(img) if isinstance(img, os.PathLike) else img for img in images]
    n = len(texts if texts is not None else images)
    return [Side(text=texts[i] if texts is not None else None, image=images[i] if images is not None else None,
                 role=role) for i in range(n)]


def _is_pil(obj: object) -> bool:
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - pillow is a dependency
        return False
    return isinstance(obj, Image.Image)
