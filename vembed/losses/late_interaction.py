"""Losses over late-interaction (MaxSim) scores of token vectors: the in-batch contrastive loss (ColBERT's and PyLate's
`Contrastive`) and colpali-engine's pairwise loss, both with mined hard negatives and documents of every rank as
candidates, and KL distillation of teacher scores over each query's own candidate list (ColBERTv2, PyLate's
`Distillation`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar, Literal

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
from vembed.losses.scored import _need_negatives, _need_scores, distill_kl
from vembed.models.maxsim import maxsim, maxsim_candidates
from vembed.models.token_vectors import cat_tokens, gather_tokens, pad_tokens, token_mask
from vembed.recipe import InvalidKey

if TYPE_CHECKING:
    from vembed.recipe import Recipe


def _every_ranks_documents(query: torch.Tensor, positive: torch.Tensor,
                           negatives: torch.Tensor | None) -> torch.Tensor:
    """(B, W*B + W*B*k) MaxSim of this rank's queries with every rank's positives, then every rank's hard negatives
    (token vectors padded to the longest; gradients flow back to each rank's own rows). Call under _full_precision."""
    documents = [gather_tokens(_upcast(positive))]
    if negatives is not None:
        documents.append(gather_tokens(_upcast(negatives).flatten(0, 1)))
    return maxsim(_upcast(query), cat_tokens(documents))


class LateInteractionSettings(EmbeddingLossSettings):
    # MaxSim scores are sums over query tokens (up to query_length), not cosines in [-1, 1]: PyLate's default of 1.
    temperature: float = Field(default=1.0, gt=0)

    @model_validator(mode="after")
    def _no_matryoshka(self) -> "LateInteractionSettings":
        if self.mrl_dims is not None:
            raise InvalidKey("mrl_dims", "Matryoshka dimensions apply to one vector per side, not to token vectors; "
                                         "remove mrl_dims (set multi_vector_dim instead)")
        return self


def _check_shapes(query: torch.Tensor, positive: torch.Tensor, negatives: torch.Tensor | None,
                  name: str = "late_interaction") -> None:
    if query.dim() != 3 or positive.dim() != 3 or positive.shape[0] != query.shape[0] or \
            positive.shape[2] != query.shape[2]:
        raise ValueError(f"{name} takes token vectors: query (B, Tq, d) and positive (B, Tp, d); got "
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
            similarity = _every_ranks_documents(query, positive, negatives)
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


class FixedTemperatureSettings(LateInteractionSettings):
    @model_validator(mode="after")
    def _fixed_temperature(self) -> "FixedTemperatureSettings":
        if self.learnable_temperature:
            raise InvalidKey("learnable_temperature", "this loss_type keeps its temperature fixed; remove the key")
        return self


class LateInteractionPairwiseSettings(FixedTemperatureSettings):
    # colpali-engine's normalize_scores (its default): each MaxSim divided by the query's token count, so scores are
    # mean cosines in [-1, 1]; "none": raw sums over query tokens.
    maxsim_normalization: Literal["query_length", "none"] = "query_length"


@LOSSES.register("late_interaction_pairwise")
class LateInteractionPairwiseLoss(EmbeddingLoss):
    """colpali-engine's pairwise loss (ColbertPairwiseCELoss, with hard negatives as further candidates): each query's
    positive against its hardest negative. For this rank's B queries::

        S        = maxsim(q_local, [P_all ; N_all])   # as late_interaction: every rank's positives and hard negatives
        S        = S / query token count              # maxsim_normalization: query_length (colpali's default)
        positive = S[i, rank * B + i]
        hardest  = max of S[i, j] over every other column (in-batch columns sharing the row's label left out)
        loss     = mean_i softplus((hardest_i - positive_i) / temperature)

    Returns this rank's mean, so DDP's gradient averaging gives the single-process gradient on the whole batch (the
    gathered documents carry their gradients back, as in `LateInteractionLoss`). Temperature: colpali's 1, fixed.
    A row without any other candidate (a global batch of one, no negatives) adds 0.
    """

    Settings: ClassVar[type[LateInteractionPairwiseSettings]] = LateInteractionPairwiseSettings
    token_vectors: ClassVar[bool] = True

    def __init__(self, temperature: float = 1.0, maxsim_normalization: str = "query_length"):
        super().__init__()
        self.temperature = temperature
        self.maxsim_normalization = maxsim_normalization

    @classmethod
    def from_recipe(cls, recipe: "Recipe") -> "LateInteractionPairwiseLoss":
        return cls(recipe.loss.temperature, recipe.loss.maxsim_normalization)

    def forward(
        self, query: torch.Tensor, positive: torch.Tensor, negatives: torch.Tensor | None = None,
        labels: torch.Tensor | None = None, scores: torch.Tensor | None = None,  # no score column: scores unused
    ) -> torch.Tensor:
        _check_shapes(query, positive, negatives, "late_interaction_pairwise")
        with _full_precision(query.device):
            similarity = _every_ranks_documents(query, positive, negatives)
            if self.maxsim_normalization == "query_length":
                similarity = similarity / token_mask(query).sum(dim=1, keepdim=True).clamp(min=1)
            rows, columns = torch.arange(query.shape[0], device=query.device), _positive_columns(query.shape[0],
                                                                                                 query.device)
            with torch.no_grad():
                dropped = torch.zeros_like(similarity, dtype=torch.bool)
                same_label = _same_label(labels, _global_batch(query))
                if same_label is not None:
                    dropped[:, : same_label.shape[1]] = same_label
                dropped[rows, columns] = True
            hardest = similarity.masked_fill(dropped, float("-inf")).amax(dim=1)
            return F.softplus((hardest - similarity[rows, columns]) / self.temperature).mean()

    @property
    def config(self) -> dict[str, Any]:
        return {"name": type(self).__name__, "loss_type": "late_interaction_pairwise", "temperature": self.temperature,
                "maxsim_normalization": self.maxsim_normalization}


class LateInteractionDistillKLSettings(FixedTemperatureSettings):
    # temperature: late_interaction's 1 (PyLate's and ColBERTv2's scale for MaxSim sums); the teacher's scores are
    # divided by this (unset: `temperature` too), as distill_kl's.
    teacher_temperature: float | None = Field(default=None, gt=0)
    # "min_max": each query's student scores scaled to [0, 1] before the softmax (PyLate's Distillation default,
    # normalize_scores=True); "none": raw MaxSim (ColBERTv2).
    maxsim_normalization: Literal["none", "min_max"] = "none"


@LOSSES.register("late_interaction_distill_kl")
class LateInteractionDistillKLLoss(EmbeddingLoss):
    """KL distillation over each query's own candidate list [positive, hard negatives], scored by MaxSim (ColBERTv2's
    and PyLate's `Distillation` with cross-encoder scores). Inputs: token vectors ``query`` (B, Tq, d), ``positive``
    (B, Tp, d), ``negatives`` (B, k, Tn, d); ``scores`` (B, 1 + k) the teacher's scores of the same candidates::

        s    = maxsim(q_i, [p_i, n_i1..n_ik])           # (B, 1 + k); maxsim_normalization: min_max scales each row
        loss = temperature^2 * mean_i KL(softmax(scores_i / teacher_temperature) || softmax(s_i / temperature))

    the formula of `distill_kl` (vembed/losses/scored.py). Per query: nothing is gathered under DDP; the mean over
    ranks is the global mean.
    """

    Settings: ClassVar[type[LateInteractionDistillKLSettings]] = LateInteractionDistillKLSettings
    token_vectors: ClassVar[bool] = True
    needs_scores: ClassVar[str | None] = "candidates"
    min_negatives: ClassVar[int] = 1

    def __init__(self, temperature: float = 1.0, teacher_temperature: float | None = None,
                 maxsim_normalization: str = "none"):
        super().__init__()
        self.temperature = temperature
        self.teacher_temperature = teacher_temperature if teacher_temperature is not None else temperature
        self.maxsim_normalization = maxsim_normalization

    @classmethod
    def from_recipe(cls, recipe: "Recipe") -> "LateInteractionDistillKLLoss":
        loss = recipe.loss
        return cls(loss.temperature, loss.teacher_temperature, loss.maxsim_normalization)

    def forward(
        self, query: torch.Tensor, positive: torch.Tensor, negatives: torch.Tensor | None = None,
        labels: torch.Tensor | None = None, scores: torch.Tensor | None = None,
    ) -> torch.Tensor:
        _check_shapes(query, positive, negatives, "late_interaction_distill_kl")
        negatives = _need_negatives(self, negatives)
        gold = _need_scores(self, scores, (query.shape[0], 1 + negatives.shape[1]))
        with _full_precision(query.device):
            width = max(positive.shape[1], negatives.shape[2])
            candidates = torch.cat([pad_tokens(_upcast(positive), width).unsqueeze(1),
                                    pad_tokens(_upcast(negatives).flatten(0, 1), width).view(
                                        *negatives.shape[:2], width, negatives.shape[3])], dim=1)
            student = maxsim_candidates(_upcast(query), candidates)  # (B, 1 + k)
            if self.maxsim_normalization == "min_max":
                low, high = student.amin(dim=1, keepdim=True), student.amax(dim=1, keepdim=True)
                student = (student - low) / (high - low + 1e-8)  # PyLate's epsilon
            return distill_kl(student, gold, self.temperature, self.teacher_temperature)

    @property
    def config(self) -> dict[str, Any]:
        return {"name": type(self).__name__, "loss_type": "late_interaction_distill_kl",
                "temperature": self.temperature, "teacher_temperature": self.teacher_temperature,
                "maxsim_normalization": self.maxsim_normalization}


__all__ = ["LateInteractionDistillKLLoss", "LateInteractionLoss", "LateInteractionPairwiseLoss"]
