"""Cross-entropy on class logits, with label smoothing and class weights: the classification task's loss (model_type
vision)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from vembed.classification import CLASSIFICATION_LOSSES
from vembed.errors import RecipeError
from vembed.recipe import Settings

if TYPE_CHECKING:
    from vembed.recipe import Recipe


class CrossEntropySettings(Settings):
    label_smoothing: float = Field(default=0.0, ge=0.0, lt=1.0)  # share of the target spread over all classes
    # Each class's weight in the loss: `balanced` (n_samples / (n_classes * count of the class) over the training
    # labels, as scikit-learn's compute_class_weight('balanced')), or one float per class in label-id order. Computed
    # from the data at every launch, so a resumed run has the same weights (they are not saved). Unset: all 1.
    class_weights: Literal["balanced"] | list[float] | None = None


def class_weight_tensor(weights: str | Sequence[float] | None, labels: Sequence[int],
                        num_classes: int) -> torch.Tensor | None:
    """The `class_weights` setting as a (num_classes,) float64 tensor: `balanced` from the training `labels`, or the
    given list checked against the number of classes; None when unset."""
    if weights is None:
        return None
    if weights == "balanced":
        counts = torch.bincount(torch.as_tensor(list(labels), dtype=torch.long), minlength=num_classes)
        if (counts == 0).any():
            missing = int((counts == 0).nonzero()[0, 0])
            raise RecipeError("class_weights", f"balanced weighs each class by its training images, but class "
                                               f"{missing} has none; give the weights as a list")
        return len(labels) / (num_classes * counts.double())
    if len(weights) != num_classes:
        raise RecipeError("class_weights", f"has {len(weights)} weights but there are {num_classes} classes; give "
                                           "one per class, in label-id order")
    return torch.tensor(weights, dtype=torch.float64)


def global_weight_share(local: torch.Tensor) -> torch.Tensor:
    """The global batch's weight sum over the world size: what each rank divides its weighted sum by, so that DDP's
    mean of the ranks' gradients is the gradient of the global batch's weighted mean (one rank: `local` itself)."""
    from vembed.distributed import is_distributed

    if not is_distributed():
        return local
    import torch.distributed as dist

    total = local.detach().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


@CLASSIFICATION_LOSSES.register("cross_entropy")
class CrossEntropyLoss(nn.Module):
    """`forward(logits (B, C), labels (B,) or soft targets (B, C)) -> cross-entropy`, in float32: the mean over the
    batch; with class weights, as torch's: over class indices the weighted mean (divided by the batch's weight sum),
    over soft (mixed) targets the weighted sum divided by the batch size. Each rank averages its own batch; DDP's
    gradient mean then gives the loss of the global batch (equal batch sizes per rank). With class weights and class
    indices, each rank divides by the global batch's weight sum (one all-reduce of a scalar), so that holds too."""

    task = "classification"  # trains models whose task is classification (vembed.tasks)
    Settings: ClassVar[type[CrossEntropySettings]] = CrossEntropySettings

    def __init__(self, label_smoothing: float = 0.0, class_weights: torch.Tensor | None = None):
        super().__init__()
        self.label_smoothing = float(label_smoothing)
        # A plain tensor, not a buffer: it is derived from the data at each launch (no checkpoint state), and stays
        # float32 where a strategy casts the module's buffers to bf16.
        self.class_weights = None if class_weights is None else class_weights.float()

    @classmethod
    def from_recipe(cls, recipe: "Recipe", labels: Sequence[int] | None = None,
                    num_classes: int | None = None) -> "CrossEntropyLoss":
        """`labels`, `num_classes`: the training labels and classes the class weights come from (the classification
        task passes them; without them, as the memory planner builds it, the loss is unweighted: it has no
        parameters either way)."""
        weights = None
        if labels is not None and num_classes is not None:
            weights = class_weight_tensor(recipe.loss.class_weights, labels, num_classes)
        return cls(label_smoothing=recipe.loss.label_smoothing, class_weights=weights)

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        weight = None if self.class_weights is None else self.class_weights.to(logits.device)
        if weight is None or labels.dim() != 1:  # a mean over rows: ranks of equal batches average to the global one
            return F.cross_entropy(logits.float(), labels, weight=weight, label_smoothing=self.label_smoothing)
        summed = F.cross_entropy(logits.float(), labels, weight=weight, label_smoothing=self.label_smoothing,
                                 reduction="sum")
        return summed / global_weight_share(weight[labels].sum())

    @property
    def config(self) -> dict[str, Any]:
        config: dict[str, Any] = {"name": type(self).__name__, "label_smoothing": self.label_smoothing}
        if self.class_weights is not None:
            config["class_weights"] = [round(w, 6) for w in self.class_weights.tolist()]
        return config
