"""In-batch contrastive loss over late-interaction (MaxSim) scores: ColBERT's and PyLate's `Contrastive`, with mined
hard negatives and documents of every rank as candidates."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator

from vembed.errors import RecipeError
from vembed.losses import LOSSES
from vembed.losses.base import EmbeddingLoss, EmbeddingLossSettings
from vembed.losses.contrastive import (
    InfoNCELoss,
    _full_precision,
    _global_batch,
    _positive_columns,
    _same_label,
    _upcast,
    _value,
)
from vembed.models.token_vectors import cat_tokens, gather_tokens
from vembed.recipe import InvalidKey
from vembed.models.maxsim import maxsim

if TYPE_CHECKING:
    from vembed.recipe import Recipe


class LateInteractionSettings(EmbeddingLossSettings):
    # MaxSim scores are sums over query tokens (up to query_length), not cosines in [-1, 1]: PyLate's default of 1.
    temperature: float = Field(default=1.0, gt=0)

    @model_validator(mode="after")
    def _no_matryoshka(self) -> "LateInteractionSettings":
        if self.mrl_dims is not None:
            raise InvalidKey("mrl_dims", "Matryoshka dimensions apply to one vector per side, not to token vectors; "
                                         "remove mrl_dims (set multi_vector_dim instead)")
        return self


def _check_shapes(query: torch.Tensor, positive: torch.Tensor, negatives: torch.Tensor | None) -> None:
    if query.dim() != 3 or positive.dim() != 3 or positive.shape[0] != query.shape[0] or \
            positive.shape[2] != query.shape[2]:
        raise ValueError(f"late_interaction takes token vectors: query (B, Tq, d) and positive (B, Tp, d); got "
                         f"{tuple(query.shape)} and {tuple(positive.shape)} (set embedding: multi_vector)")
    if negatives is not None and (negatives.dim() != 4 or negatives.shape[0] != query.shape[0]
                                  or negatives.shape[3] != query.shape[2]):
        raise ValueError(f"negatives must be (B, k, Tn, d) with B={query.shape[0]}, d={query.shape[2]}; "
                         f"got {tuple(negatives.shape)}")


@LOSSES.register("late_interaction")
class LateInteractionLoss(EmbeddingLoss):
    """InfoNCE over MaxSim scores. For this rank's B queries::

        D      = [P_all ; N_all]                  # every rank's positives, then every rank's hard negatives, as
                                                  # token vectors padded to the longest (padding is never scored)
        logits = maxsim(q_local, D) / temperature # (B, W*B + W*B*k)
        loss   = cross_entropy(logits, rank * B + arange(B))

    One direction (queries -> documents), as ColBERT and PyLate train. Returns this rank's share of the global-batch
    loss, so DDP's gradient averaging gives the single-process gradient on the whole batch (the argument of
    `InfoNCELoss`). `labels` drop in-batch columns whose record shares the row's label (never the row's positive);
    a learnable temperature is stored and capped as InfoNCE's. Scores are computed in float32 with autocast off.
    """

    Settings: ClassVar[type[LateInteractionSettings]] = LateInteractionSettings
    token_vectors: ClassVar[bool] = True

    def __init__(self, temperature: float = 1.0, learnable_temperature: bool = False):
        super().__init__()
        self._infonce = InfoNCELoss(temperature, learnable_temperature, symmetric=False)  # temperature and its cap
        self.temperature = temperature
        self.learnable_temperature = learnable_temperature

    @classmethod
    def from_recipe(cls, recipe: "Recipe") -> "LateInteractionLoss":
        try:
            return cls(recipe.loss.temperature, recipe.loss.learnable_temperature)
        except ValueError as err:
            raise RecipeError("temperature", str(err)) from None

    def forward(
        self, query: torch.Tensor, positive: torch.Tensor, negatives: torch.Tensor | None = None,
        labels: torch.Tensor | None = None, scores: torch.Tensor | None = None,  # no score column: scores unused
    ) -> torch.Tensor:
        _check_shapes(query, positive, negatives)
        with _full_precision(query.device):
            query, positive = _upcast(query), _upcast(positive)
            documents = [gather_tokens(positive)]
            if negatives is not None:
                documents.append(gather_tokens(_upcast(negatives).flatten(0, 1)))
            similarity = maxsim(query, cat_tokens(documents))  # (B, all documents of every rank)
            columns = _positive_columns(query.shape[0], query.device)
            logits = self._infonce._logits(self._infonce.scale(), similarity, columns, [],
                                           _same_label(labels, _global_batch(query)), [0])
            return F.cross_entropy(logits, columns)

    @property
    def config(self) -> dict[str, Any]:
        config = {"name": type(self).__name__, "loss_type": "late_interaction", "temperature": self.temperature,
                  "learnable_temperature": self.learnable_temperature}
        if self.learnable_temperature:
            config["learned_temperature"] = math.exp(-_value(self._infonce.log_scale))
        return config


__all__ = ["LateInteractionLoss"]
