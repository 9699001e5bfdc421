"""The loss contract: losses take embeddings, never models.

That separation is what lets GradCache sit between encoder and loss, Matryoshka wrap any loss, and cross-device
gathering live in one place (inside the loss, through `vembed.distributed`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from vembed.recipe import Recipe


class EmbeddingLoss(nn.Module):
    """Base class. `forward(query, positive, negatives=None, labels=None) -> scalar loss`.

    Shapes: `query` and `positive` are `(B, d)` for this process's B local pairs; `negatives`, when given, is
    `(B, k, d)` hard negatives; `labels`, when given, `(B,)` int64 class ids: pairs sharing one are not each
    other's in-batch negatives (losses without in-batch negatives ignore them). Under torch.distributed a loss
    gathers what it needs from other ranks itself and returns this rank's share, scaled so that averaging gradients
    over ranks (what DDP does) gives the gradient of the loss on the concatenated global batch.
    """

    @classmethod
    def from_recipe(cls, recipe: "Recipe") -> "EmbeddingLoss":
        raise NotImplementedError

    def forward(
        self, query: torch.Tensor, positive: torch.Tensor, negatives: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError

    @property
    def config(self) -> dict[str, Any]:
        """What the loss was built with, for the saved model card and metrics.json."""
        return {"name": type(self).__name__}
