"""Token vectors (late interaction, ColBERT): how a multi-vector side is represented between adapter, loss and search.

A batch of n sides is ONE float tensor `(n, T, d)`: row i holds side i's token vectors, L2-normalised, and every
position that is not a token of side i (padding, a skipped punctuation token) is the zero vector. The mask is read
back from the values (`token_mask`: a real token has norm 1, never 0), so the representation is a plain tensor: the
loop, GradCache (`cat_tokens`, row selection), the cross-rank gather (`gather_tokens`) and the loss carry it as they
carry `(n, d)` embeddings, and padding can never be scored by mistake.

Sides of one batch differ in length; tensors of different T meet only here: `pad_tokens` / `cat_tokens` pad with
zero vectors (which are, by the rule above, no tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from vembed.distributed import gather_with_grad, is_distributed

if TYPE_CHECKING:
    from vembed.models.base import EmbeddingAdapter


def token_mask(vectors: torch.Tensor) -> torch.Tensor:
    """`(n, T)` bool: True where `vectors` `(n, T, d)` holds a token (a non-zero vector)."""
    return vectors.detach().ne(0).any(dim=-1)


def pad_tokens(vectors: torch.Tensor, length: int) -> torch.Tensor:
    """`vectors` `(n, T, d)` padded with zero vectors to `(n, length, d)` (length >= T); gradients flow back."""
    if vectors.shape[1] == length:
        return vectors
    if vectors.shape[1] > length:
        raise ValueError(f"cannot pad {vectors.shape[1]} token vectors to {length}")
    return F.pad(vectors, (0, 0, 0, length - vectors.shape[1]))


def cat_tokens(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate along rows; 3-d parts (token vectors) of different lengths are padded to the longest first.
    2-d parts (one vector per side) are concatenated as they are."""
    if parts and parts[0].dim() == 3:
        length = max(part.shape[1] for part in parts)
        parts = [pad_tokens(part, length) for part in parts]
    return torch.cat(list(parts), dim=0)


def gather_tokens(vectors: torch.Tensor) -> torch.Tensor:
    """Every rank's `(n, T_r, d)` token vectors, padded to the longest T over ranks and concatenated in rank order,
    with gradients flowing back to each rank's own rows (`vembed.distributed.gather_with_grad`)."""
    if not is_distributed():
        return vectors
    length = torch.tensor([vectors.shape[1]], device=vectors.device)
    dist.all_reduce(length, op=dist.ReduceOp.MAX)
    return gather_with_grad(pad_tokens(vectors, int(length.item())))


def require_single_vector(adapter: "EmbeddingAdapter", what: str, instead: str, key: str = "model_dir") -> None:
    """A command that scores one vector per side (`what`) refuses a multi_vector model in one line, saying what to
    do `instead`."""
    from vembed.errors import RecipeError

    if adapter.embedding_kind != "single":
        raise RecipeError(key, f"{what} scores one vector per side, and this model gives token vectors "
                               f"({adapter.embedding_kind}): {instead}")


__all__ = ["cat_tokens", "gather_tokens", "pad_tokens", "require_single_vector", "token_mask"]
