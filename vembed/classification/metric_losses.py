"""Metric-learning losses on labelled embeddings (the `metric_learning` task): supervised contrastive (SupCon), InfoNCE
with positives from labels (NT-Xent) and sub-center ArcFace, computed by `pytorch-metric-learning` (PML), which the
`metric-learning` extra installs.

Positives are the other images of the same class. Under torch.distributed each loss sees every rank's embeddings and
labels: the global batch is gathered in rank order with gradients (`vembed.distributed.gather_with_grad`) and the loss
is the one of one process on that whole batch, on every rank. PML's own `DistributedLossWrapper` is not used: it puts
the local rank's rows first and multiplies the loss by the world size, so the logged loss is not the global batch's,
and a loss with its own parameters (ArcFace's class centres) would get world-size times their gradient once DDP
averages it. With the gather, DDP's average gives every parameter, the loss's included, the one-process gradient.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import nn

from vembed.classification import METRIC_LOSSES
from vembed.distributed import gather_no_grad, gather_with_grad
from vembed.errors import EnvironmentProblem, RecipeError
from vembed.recipe import Settings

if TYPE_CHECKING:
    from vembed.recipe import Recipe

EXTRA = "metric-learning"  # setup.cfg's extra that installs pytorch-metric-learning


def pml_losses(loss_type: str) -> Any:
    try:
        from pytorch_metric_learning import losses
    except ImportError:
        raise EnvironmentProblem("loss_type", f"{loss_type} is computed by pytorch-metric-learning, which is not "
                                              f"installed; pip install 'vembed[{EXTRA}]'") from None
    return losses


def require_library(loss_type: str) -> None:
    """pytorch-metric-learning, which computes every loss here, checked with the recipe: the loss is built after the
    model, so a missing extra was found only once the weights were read."""
    pml_losses(loss_type)


class MetricLossSettings(Settings):
    """The keys every metric-learning loss shares."""

    # The metric that picks the best checkpoint, when the recipe names none (metric_evaluation.py).
    recipe_defaults: ClassVar[dict[str, Any]] = {"metric_for_best_model": "mean_average_precision_at_r"}


class MetricLoss(nn.Module):
    """Base class. `forward(embeddings (B, d), labels (B,) int64 class ids) -> scalar`, in float32: the PML loss of the
    global batch (every rank's rows, gathered). Subclasses build `self.loss` (a PML loss) in `__init__`."""

    task = "metric_learning"  # trains models through the metric_learning task (vembed.tasks)
    Settings: ClassVar[type[MetricLossSettings]] = MetricLossSettings
    # Every anchor needs another image of its class in the data (pair-based losses); proxy losses (ArcFace) do not.
    needs_positives: ClassVar[bool] = True
    loss: nn.Module
    settings: dict[str, Any]  # what it was built with (config)
    class_names: list[str] | None = None  # the training classes by id, when a task sets them (saved with the state)

    @classmethod
    def from_recipe(cls, recipe: "Recipe", *, num_classes: int | None = None,
                    embedding_dim: int | None = None) -> "MetricLoss":
        """`num_classes`: classes of the training data; `embedding_dim`: the adapter's output size (the task passes
        both; the memory planner, which reads no data, neither)."""
        raise NotImplementedError

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        embeddings = gather_with_grad(embeddings.float())
        labels = gather_no_grad(labels)
        # PML computes in the embeddings' dtype; autocast would run its matmuls in half precision.
        with torch.autocast(device_type=embeddings.device.type, enabled=False):
            return self.global_loss(embeddings, labels)

    def global_loss(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The library's loss of the global batch (every rank's rows), in float32."""
        return self.loss(embeddings, labels)

    @classmethod
    def check_recipe(cls, recipe: "Recipe") -> None:
        """The loss's own rules beyond its Settings' (names it resolves in the library); none by default."""

    @classmethod
    def proxies_of(cls, settings: MetricLossSettings) -> bool:
        """Whether the loss trains a state of its own (class centres, proxies) besides the model."""
        return not cls.needs_positives

    @classmethod
    def positives_needed(cls, settings: MetricLossSettings) -> bool:
        """Whether every anchor needs another image of its class (`needs_positives`, which settings may decide)."""
        return cls.needs_positives

    @classmethod
    def views_per_image(cls, settings: MetricLossSettings) -> int:
        """How many views of each image a batch holds: 1, positives from labels; 2, each view's positive is the other
        view of its image (the batch's labels are then row ids, so no class needs two images)."""
        return 1

    @property
    def config(self) -> dict[str, Any]:
        return {"name": type(self).__name__, **self.settings}

    def class_scores(self, embeddings: torch.Tensor) -> torch.Tensor:
        """`(n, classes)` scores of embeddings against the loss's trained classes; only losses that hold a state per
        class (ArcFace's centres) have them."""
        raise ValueError(f"{type(self).__name__} holds nothing per class (its positives are other images of the "
                         "class); class scores need a loss with class centres (subcenter_arcface)")


class SupConSettings(MetricLossSettings):
    temperature: float = Field(default=0.1, gt=0)  # cosine similarities are divided by it


@METRIC_LOSSES.register("supcon")
class SupConLoss(MetricLoss):
    """Supervised contrastive loss (Khosla et al. 2020): each image against all others of the batch, every same-class
    image a positive. PML's SupConLoss on cosine similarity, averaged over anchors with a positive."""

    Settings: ClassVar[type[SupConSettings]] = SupConSettings

    def __init__(self, temperature: float = 0.1):
        super().__init__()
        self.settings = {"temperature": float(temperature)}
        self.loss = pml_losses("supcon").SupConLoss(temperature=float(temperature))

    @classmethod
    def from_recipe(cls, recipe: "Recipe", **sizes: int | None) -> "SupConLoss":
        return cls(temperature=recipe.loss.temperature)


class NTXentSettings(MetricLossSettings):
    temperature: float = Field(default=0.07, gt=0)  # cosine similarities are divided by it
    # labels: the other images of the class are positives; views: two views of every image in the batch, each the
    # other's only positive (SimCLR; the views differ once the image processor draws random augmentations)
    positives: Literal["labels", "views"] = "labels"


@METRIC_LOSSES.register("ntxent")
class NTXentLoss(MetricLoss):
    """InfoNCE / NT-Xent (SimCLR's loss): one term per positive pair (two images of a class: two views of it),
    the positive against every image of another class. PML's NTXentLoss on cosine similarity."""

    Settings: ClassVar[type[NTXentSettings]] = NTXentSettings

    def __init__(self, temperature: float = 0.07, positives: str = "labels"):
        super().__init__()
        self.settings = {"temperature": float(temperature), "positives": positives}
        self.loss = pml_losses("ntxent").NTXentLoss(temperature=float(temperature))

    @classmethod
    def from_recipe(cls, recipe: "Recipe", **sizes: int | None) -> "NTXentLoss":
        return cls(temperature=recipe.loss.temperature, positives=recipe.loss.positives)

    @classmethod
    def views_per_image(cls, settings: NTXentSettings) -> int:
        return 2 if settings.positives == "views" else 1


class SubCenterArcFaceSettings(MetricLossSettings):
    margin: float = Field(default=28.6, ge=0, lt=90)  # additive angular margin, in degrees (28.6 ≈ 0.5 rad)
    scale: float = Field(default=64.0, gt=0)  # logits are scale × cos(angle)
    sub_centers: int = Field(default=3, ge=1)  # centres per class (1: plain ArcFace)
    num_classes: int | None = Field(default=None, gt=0)  # classes of the centres (unset: data.train's)


@METRIC_LOSSES.register("subcenter_arcface")
class SubCenterArcFaceLoss(MetricLoss):
    """Sub-center ArcFace (Deng et al. 2020): softmax over classes on cos(angle to the nearest of a class's centres),
    with an angular margin on the true class. The centres, `loss.loss.W` (embedding_dim, classes × sub_centers), are
    trained with the model: in the optimizer, in checkpoints, and in final/ (`loss.safetensors`, which `vembed.load`
    restores: `class_scores`), not in a sentence-transformers export."""

    Settings: ClassVar[type[SubCenterArcFaceSettings]] = SubCenterArcFaceSettings
    needs_positives = False  # each image is pulled towards its class's centres, not towards other images

    def __init__(self, num_classes: int, embedding_dim: int, margin: float = 28.6, scale: float = 64.0,
                 sub_centers: int = 3):
        super().__init__()
        self.settings = {"num_classes": int(num_classes), "embedding_dim": int(embedding_dim),
                         "margin": float(margin), "scale": float(scale), "sub_centers": int(sub_centers)}
        self.loss = pml_losses("subcenter_arcface").SubCenterArcFaceLoss(
            num_classes=int(num_classes), embedding_size=int(embedding_dim), margin=float(margin), scale=float(scale),
            sub_centers=int(sub_centers))

    @classmethod
    def from_recipe(cls, recipe: "Recipe", *, num_classes: int | None = None,
                    embedding_dim: int | None = None) -> "SubCenterArcFaceLoss":
        settings = recipe.loss
        num_classes = num_classes or settings.num_classes
        if num_classes is None:
            raise RecipeError("num_classes", "subcenter_arcface has a centre per class: set num_classes, or point "
                                             "data.train at the labelled images")
        if embedding_dim is None:  # the callers (the task, the planner) know the adapter's size
            raise TypeError("subcenter_arcface needs the embedding_dim of the model it trains")
        return cls(num_classes, embedding_dim, margin=settings.margin, scale=settings.scale,
                   sub_centers=settings.sub_centers)

    def class_scores(self, embeddings: torch.Tensor) -> torch.Tensor:
        """Each embedding's cosine to the nearest centre of each class, `(n, classes)`: what the loss's softmax reads
        (before margin and scale), so its argmax is the class the trained centres give."""
        with torch.no_grad():
            return self.loss.get_cosine(embeddings.float().to(self.loss.W.device))


__all__ = ["MetricLoss", "NTXentLoss", "SubCenterArcFaceLoss", "SupConLoss"]
