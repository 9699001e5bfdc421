"""Losses on graded pairs and teacher scores: CoSENT and AnglE (rank pairs by a gold score), cosine-similarity MSE,
MarginMSE and KL distillation (match a teacher's scores of a positive and hard negatives).

Each reads the batch's `scores` (the data's score column, vembed/data/reader.py). CoSENT and AnglE compare every
pair of the batch with every other, so under torch.distributed they gather the pairs' similarities (with
gradients) and gold scores of every rank and each rank returns the loss of the whole global batch; the others are
means of per-pair terms, for which the mean over ranks that DDP's averaging takes is already the global mean.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from pydantic import Field

from vembed.distributed import gather_no_grad, gather_with_grad
from vembed.losses import LOSSES
from vembed.losses.base import EmbeddingLoss, EmbeddingLossSettings
from vembed.losses.contrastive import _check_shapes, _full_precision, _upcast

if TYPE_CHECKING:
    from vembed.recipe import Recipe


def _need_scores(loss: EmbeddingLoss, scores: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
    if scores is None:
        raise ValueError(f"{type(loss).__name__} needs a score per pair (data.columns.score); the batch has none")
    if tuple(scores.shape) != shape:
        raise ValueError(f"{type(loss).__name__} needs scores of shape {shape}, got {tuple(scores.shape)}")
    return scores.detach()


def angle_similarity(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """AnglE's similarity (Li & Li, 2023) of each pair: |cos + sin| of the angle between the unit vectors read as
    complex numbers, dimension i paired with i + d/2 (an odd size is padded with one zero)."""
    if x.shape[-1] % 2:
        x, y = F.pad(x, (0, 1)), F.pad(y, (0, 1))
    x, y = F.normalize(x, dim=-1), F.normalize(y, dim=-1)
    x_re, x_im = x.chunk(2, dim=-1)
    y_re, y_im = y.chunk(2, dim=-1)
    return ((x * y).sum(-1) + (x_im * y_re - x_re * y_im).sum(-1)).abs()


def cosine_similarity(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (F.normalize(x, dim=-1) * F.normalize(y, dim=-1)).sum(-1)


class CoSENTSettings(EmbeddingLossSettings):
    cosent_scale: float = Field(default=20.0, gt=0)  # multiplies the similarities (1 / temperature); CoSENT's 20


@LOSSES.register("cosent")
class CoSENTLoss(EmbeddingLoss):
    """CoSENT (Su, 2022): every two pairs of the batch whose gold scores differ are ranked by their similarity.

    Inputs: ``query`` and ``positive`` (B, d), the two texts of each pair (data: text1 -> query, text2 -> positive);
    ``scores`` (B,) their gold similarity (any scale: only the order matters). Hard negatives are not used. ::

        s      = scale * similarity(query_i, positive_i)         # (N,) over the global batch of N pairs
        loss   = log(1 + sum over (i, j) with score_i > score_j of exp(s_j - s_i))

    Under DDP each rank gathers every rank's similarities (gradients flowing back) and gold scores and returns the
    loss of the whole global batch; DDP's averaging of the ranks' gradients then gives the gradient of that loss.

    Example::

        loss_fn = CoSENTLoss(scale=20.0)
        loss = loss_fn(F.normalize(torch.randn(8, 64), dim=-1), F.normalize(torch.randn(8, 64), dim=-1),
                       scores=torch.rand(8))
    """

    Settings: ClassVar[type[CoSENTSettings]] = CoSENTSettings
    needs_scores: ClassVar[str | None] = "pair"
    uses_negatives: ClassVar[bool] = False
    name: ClassVar[str] = "cosent"

    def __init__(self, scale: float = 20.0):
        super().__init__()
        self.scale = scale

    @classmethod
    def from_recipe(cls, recipe: "Recipe") -> "CoSENTLoss":
        return cls(recipe.loss.cosent_scale)

    def similarity(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return cosine_similarity(x, y)

    def forward(
        self, query: torch.Tensor, positive: torch.Tensor, negatives: torch.Tensor | None = None,
        labels: torch.Tensor | None = None, scores: torch.Tensor | None = None,
    ) -> torch.Tensor:
        _check_shapes(query, positive, None)
        gold = _need_scores(self, scores, (query.shape[0],))
        with _full_precision(query.device):
            similarity = self.scale * self.similarity(_upcast(query), _upcast(positive))
            similarity, gold = gather_with_grad(similarity), gather_no_grad(gold.to(similarity.dtype))
            # (i, j) is a term where pair i should rank above pair j: exp(s_j - s_i) under the mask
            differences = similarity.unsqueeze(0) - similarity.unsqueeze(1)
            ranked = gold.unsqueeze(1) > gold.unsqueeze(0)
            terms = differences.masked_fill(~ranked, float("-inf")).flatten()
            return torch.logsumexp(torch.cat([terms.new_zeros(1), terms]), dim=0)

    @property
    def config(self) -> dict[str, Any]:
        return {"name": type(self).__name__, "loss_type": self.name, "scale": self.scale}


@LOSSES.register("angle")
class AnglELoss(CoSENTLoss):
    """AnglE (Li & Li, 2023): CoSENT with the angle similarity (`angle_similarity`) instead of the cosine, which keeps
    a gradient where the cosine saturates. Same inputs, scale and cross-rank behaviour as `CoSENTLoss`."""

    name: ClassVar[str] = "angle"

    def similarity(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return angle_similarity(x, y)


@LOSSES.register("cosine_mse")
class CosineSimilarityLoss(EmbeddingLoss):
    """Mean squared error between the cosine similarity of each pair and its gold score (sentence-transformers'
    CosineSimilarityLoss). Inputs: ``query``, ``positive`` (B, d), ``scores`` (B,) on the cosine's scale (declare it
    with data.score_range, e.g. [0, 1]). ``loss = mean_i (cos(q_i, p_i) - score_i)^2``; per pair, so DDP's mean over
    ranks is the global mean and nothing is gathered.

    Example::

        loss = CosineSimilarityLoss()(q, p, scores=torch.tensor([0.9, 0.1, ...]))
    """

    needs_scores: ClassVar[str | None] = "pair"
    uses_negatives: ClassVar[bool] = False

    @classmethod
    def from_recipe(cls, recipe: "Recipe") -> "CosineSimilarityLoss":
        return cls()

    def forward(
        self, query: torch.Tensor, positive: torch.Tensor, negatives: torch.Tensor | None = None,
        labels: torch.Tensor | None = None, scores: torch.Tensor | None = None,
    ) -> torch.Tensor:
        _check_shapes(query, positive, None)
        gold = _need_scores(self, scores, (query.shape[0],))
        with _full_precision(query.device):
            predicted = cosine_similarity(_upcast(query), _upcast(positive))
            return F.mse_loss(predicted, gold.to(predicted.dtype))

    @property
    def config(self) -> dict[str, Any]:
        return {"name": type(self).__name__, "loss_type": "cosine_mse"}


def _candidate_scores(query: torch.Tensor, positive: torch.Tensor, negatives: torch.Tensor) -> torch.Tensor:
    """(B, 1 + k) dot products of each query with its positive and its k hard negatives."""
    return torch.cat([(query * positive).sum(-1, keepdim=True), torch.einsum("bd,bkd->bk", query, negatives)], dim=1)


def _need_negatives(loss: EmbeddingLoss, negatives: torch.Tensor | None) -> torch.Tensor:
    if negatives is None or negatives.shape[1] == 0:
        raise ValueError(f"{type(loss).__name__} needs hard negatives (data.columns.negatives, "
                         "data.num_hard_negatives >= 1); the batch has none")
    return negatives


@LOSSES.register("margin_mse")
class MarginMSELoss(EmbeddingLoss):
    """MarginMSE (Hofstätter et al., 2020): the student's margin between the positive and each hard negative
    matches the teacher's. Inputs: ``query``, ``positive`` (B, d), ``negatives`` (B, k, d), and ``scores`` either
    (B, 1 + k) teacher scores of [positive, negatives...] or, with k = 1, (B,) the teacher's margin itself::

        margin_student[i, j] = q_i . p_i - q_i . n_ij
        margin_teacher[i, j] = t_i0 - t_ij          # or the given margin
        loss = mean_ij (margin_student - margin_teacher)^2

    Dot products, as sentence-transformers (the embeddings are unit vectors here, so they are cosines: give teacher
    scores on a comparable scale). Per pair: nothing is gathered under DDP.
    """

    needs_scores: ClassVar[str | None] = "candidates_or_margin"
    min_negatives: ClassVar[int] = 1

    @classmethod
    def from_recipe(cls, recipe: "Recipe") -> "MarginMSELoss":
        return cls()

    def forward(
        self, query: torch.Tensor, positive: torch.Tensor, negatives: torch.Tensor | None = None,
        labels: torch.Tensor | None = None, scores: torch.Tensor | None = None,
    ) -> torch.Tensor:
        _check_shapes(query, positive, negatives)
        negatives = _need_negatives(self, negatives)
        batch, k = negatives.shape[:2]
        if scores is not None and scores.dim() == 1 and k == 1:
            teacher = scores.detach().unsqueeze(1)
        else:
            gold = _need_scores(self, scores, (batch, 1 + k))
            teacher = gold[:, :1] - gold[:, 1:]
        with _full_precision(query.device):
            student = _candidate_scores(_upcast(query), _upcast(positive), _upcast(negatives))
            return F.mse_loss(student[:, :1] - student[:, 1:], teacher.to(student.dtype))

    @property
    def config(self) -> dict[str, Any]:
        return {"name": type(self).__name__, "loss_type": "margin_mse"}


def distill_kl(student: torch.Tensor, teacher: torch.Tensor, temperature: float,
               teacher_temperature: float) -> torch.Tensor:
    """temperature^2 * mean over queries of KL(softmax(teacher / teacher_temperature) || softmax(student /
    temperature)), for (B, 1 + k) scores of each query's candidates: the one formula of every distill_kl loss."""
    log_student = torch.log_softmax(student / temperature, dim=1)
    target = torch.softmax(teacher.detach().to(student.dtype) / teacher_temperature, dim=1)
    return F.kl_div(log_student, target, reduction="batchmean") * temperature**2


class DistillKLSettings(EmbeddingLossSettings):
    # The student's scores are divided by `temperature`; the teacher's by this (unset: `temperature` too).
    teacher_temperature: float | None = Field(default=None, gt=0)


@LOSSES.register("distill_kl")
class DistillKLDivLoss(EmbeddingLoss):
    """KL distillation over a candidate list: the student's softmax over [positive, hard negatives] of each query
    follows the teacher's (sentence-transformers' DistillKLDivLoss). Inputs: ``query``, ``positive`` (B, d),
    ``negatives`` (B, k, d), ``scores`` (B, 1 + k) the teacher's scores of the same candidates, in order::

        p_teacher = softmax(scores / teacher_temperature)
        loss = temperature^2 * sum_i KL(p_teacher_i || softmax(q_i . [p_i, n_i1..n_ik] / temperature)) / B

    (the temperature^2 keeps the gradient's size independent of the temperature, as in Hinton et al.). Per query:
    nothing is gathered under DDP; the mean over ranks is the global mean.
    """

    Settings: ClassVar[type[DistillKLSettings]] = DistillKLSettings
    needs_scores: ClassVar[str | None] = "candidates"
    min_negatives: ClassVar[int] = 1

    def __init__(self, temperature: float = 1.0, teacher_temperature: float | None = None):
        super().__init__()
        self.temperature = temperature
        self.teacher_temperature = teacher_temperature if teacher_temperature is not None else temperature

    @classmethod
    def from_recipe(cls, recipe: "Recipe") -> "DistillKLDivLoss":
        return cls(recipe.loss.temperature, recipe.loss.teacher_temperature)

    def forward(
        self, query: torch.Tensor, positive: torch.Tensor, negatives: torch.Tensor | None = None,
        labels: torch.Tensor | None = None, scores: torch.Tensor | None = None,
    ) -> torch.Tensor:
        _check_shapes(query, positive, negatives)
        negatives = _need_negatives(self, negatives)
        gold = _need_scores(self, scores, (query.shape[0], 1 + negatives.shape[1]))
        with _full_precision(query.device):
            student = _candidate_scores(_upcast(query), _upcast(positive), _upcast(negatives))
            return distill_kl(student, gold, self.temperature, self.teacher_temperature)

    @property
    def config(self) -> dict[str, Any]:
        return {"name": type(self).__name__, "loss_type": "distill_kl", "temperature": self.temperature,
                "teacher_temperature": self.teacher_temperature}


__all__ = ["AnglELoss", "CoSENTLoss", "CosineSimilarityLoss", "DistillKLDivLoss", "MarginMSELoss",
           "angle_similarity", "distill_kl"]
