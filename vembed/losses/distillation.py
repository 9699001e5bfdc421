"""Embedding distillation: the student's embeddings regress onto a teacher's, extracted once beforehand
(`vembed extract --teacher MODEL --recipe RECIPE --out DIR`, vembed/data/teacher_embeddings.py), so the teacher is
never in memory while the student trains. The teacher's vectors arrive with the batch (`teacher=`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F

from vembed.losses import LOSSES
from vembed.losses.base import EmbeddingLoss, EmbeddingLossSettings
from vembed.losses.contrastive import _check_shapes, _full_precision, _upcast

if TYPE_CHECKING:
    from vembed.recipe import Recipe


class EmbeddingMSESettings(EmbeddingLossSettings):
    # The folder `vembed extract --teacher MODEL --recipe RECIPE --out DIR` wrote: the teacher's embedding of each
    # training row's query text, matched to the rows by file and row, refused when the texts changed since.
    teacher_embeddings: str


@LOSSES.register("embedding_mse")
class EmbeddingMSELoss(EmbeddingLoss):
    """Mean squared error between the student's embeddings and the teacher's (sentence-transformers' MSELoss, the
    recipe of Reimers & Gurevych 2020 for model-to-model and multilingual distillation).

    Inputs: ``query`` and ``positive`` (B, d), the student's embeddings of the row's source text and of its
    translation; ``teacher`` (B, d) the teacher's embedding of the source text. Both are regressed onto it::

        loss = mean over the 2 x B x d entries of (cat[query, positive] - cat[teacher, teacher])^2

    For model-to-model distillation on one text column, map data.columns.positive to the query's column: the value
    and gradient are then those of the MSE of the queries alone. Hard negatives are not used. A mean of per-row
    terms: nothing is gathered under DDP (the mean over ranks is the global mean), and GradCache computes it on the
    whole batch's embeddings.

    Example::

        loss = EmbeddingMSELoss()(student_source, student_translation, teacher=teacher_source)
    """

    Settings: ClassVar[type[EmbeddingMSESettings]] = EmbeddingMSESettings
    needs_teacher: ClassVar[bool] = True
    uses_negatives: ClassVar[bool] = False

    def __init__(self, teacher_embeddings: str | None = None):
        super().__init__()
        self.teacher_embeddings = teacher_embeddings

    @classmethod
    def from_recipe(cls, recipe: "Recipe") -> "EmbeddingMSELoss":
        return cls(recipe.loss.teacher_embeddings)

    def forward(
        self, query: torch.Tensor, positive: torch.Tensor, negatives: torch.Tensor | None = None,
        labels: torch.Tensor | None = None, scores: torch.Tensor | None = None, teacher: torch.Tensor | None = None,
    ) -> torch.Tensor:
        _check_shapes(query, positive, None)
        if teacher is None:
            raise ValueError("EmbeddingMSELoss needs the teacher's embeddings of the batch (teacher=)")
        if tuple(teacher.shape) != tuple(query.shape):
            raise ValueError(f"EmbeddingMSELoss: the teacher's embeddings have shape {tuple(teacher.shape)}, the "
                             f"student's {tuple(query.shape)}")
        with _full_precision(query.device):
            student = torch.cat([_upcast(query), _upcast(positive)])
            target = teacher.detach().to(student.dtype).repeat(2, 1)
            return F.mse_loss(student, target)

    @property
    def config(self) -> dict[str, Any]:
        return {"name": type(self).__name__, "loss_type": "embedding_mse",
                "teacher_embeddings": self.teacher_embeddings}


__all__ = ["EmbeddingMSELoss"]
