"""Cross-entropy on class logits, with label smoothing: the classification task's loss (model_type vision)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from vembed.classification import CLASSIFICATION_LOSSES
from vembed.recipe import Settings

if TYPE_CHECKING:
    from vembed.recipe import Recipe


class CrossEntropySettings(Settings):
    label_smoothing: float = Field(default=0.0, ge=0.0, lt=1.0)  # share of the target spread over all classes


@CLASSIFICATION_LOSSES.register("cross_entropy")
class CrossEntropyLoss(nn.Module):
    """`forward(logits (B, C), labels (B,)) -> mean cross-entropy`, in float32. Each rank averages its own batch;
    DDP's gradient mean then gives the loss of the global batch (equal batch sizes per rank)."""

    task = "classification"  # trains models whose task is classification (vembed.tasks)
    Settings: ClassVar[type[CrossEntropySettings]] = CrossEntropySettings

    def __init__(self, label_smoothing: float = 0.0):
        super().__init__()
        self.label_smoothing = float(label_smoothing)

    @classmethod
    def from_recipe(cls, recipe: "Recipe") -> "CrossEntropyLoss":
        return cls(label_smoothing=recipe.loss.label_smoothing)

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float(), labels, label_smoothing=self.label_smoothing)

    @property
    def config(self) -> dict[str, Any]:
        return {"name": type(self).__name__, "label_smoothing": self.label_smoothing}
