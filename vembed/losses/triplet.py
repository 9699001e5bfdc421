"""Triplet losses: a margin between the anchor-positive and anchor-negative distances, on given triplets
(`triplet`: query, positive, hard negatives) or mined within the batch from labels (`batch_hard_triplet`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from vembed.distributed import gather_no_grad, gather_with_grad, rank_and_world
from vembed.losses import LOSSES
from vembed.losses.base import EmbeddingLoss, EmbeddingLossSettings
from vembed.losses.contrastive import _check_shapes, _full_precision, _upcast

if TYPE_CHECKING:
    from vembed.recipe import Recipe


def pair_distance(kind: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Distance of x[..., :] to y[..., :] along the last dimension (broadcasting)."""
    if kind == "cosine":
        return 1 - (F.normalize(x, dim=-1) * F.normalize(y, dim=-1)).sum(-1)
    if kind == "manhattan":
        return (x - y).abs().sum(-1)
    return torch.linalg.vector_norm(x - y, dim=-1)


class TripletSettings(EmbeddingLossSettings):
    triplet_margin: float = Field(default=5.0, ge=0)  # the negative must be this much further than the positive
    triplet_distance: Literal["euclidean", "cosine", "manhattan"] = "euclidean"


@LOSSES.register("triplet")
class TripletLoss(EmbeddingLoss):
    """Triplet margin loss on (query, positive, hard negative) triplets (sentence-transformers' TripletLoss)::

        loss = mean over i, j of relu(dist(q_i, p_i) - dist(q_i, n_ij) + margin)

    ``negatives`` (B, k, d): with k > 1 every negative of a row makes a triplet (k = 1 is sentence-transformers'
    loss exactly). Distances: euclidean, cosine (1 - cos) or manhattan. Per triplet: nothing is gathered under DDP.
    Note that on unit vectors euclidean distances are at most 2, so sentence-transformers' margin of 5 is never met;
    a margin below 1 suits them.
    """

    Settings: ClassVar[type[TripletSettings]] = TripletSettings
    min_negatives: ClassVar[int] = 1

    def __init__(self, margin: float = 5.0, distance: str = "euclidean"):
        super().__init__()
        self.margin, self.distance = margin, distance

    @classmethod
    def from_recipe(cls, recipe: "Recipe") -> "TripletLoss":
        return cls(recipe.loss.triplet_margin, recipe.loss.triplet_distance)

    def forward(
        self, query: torch.Tensor, positive: torch.Tensor, negatives: torch.Tensor | None = None,
        labels: torch.Tensor | None = None, scores: torch.Tensor | None = None,
    ) -> torch.Tensor:
        _check_shapes(query, positive, negatives)
        if negatives is None or negatives.shape[1] == 0:
            raise ValueError("TripletLoss needs a hard negative per pair (data.columns.negatives); the batch has none")
        with _full_precision(query.device):
            query, positive, negatives = _upcast(query), _upcast(positive), _upcast(negatives)
            to_positive = pair_distance(self.distance, query, positive).unsqueeze(1)
            to_negatives = pair_distance(self.distance, query.unsqueeze(1), negatives)
            return F.relu(to_positive - to_negatives + self.margin).mean()

    @property
    def config(self) -> dict[str, Any]:
        return {"name": type(self).__name__, "loss_type": "triplet", "margin": self.margin,
                "distance": self.distance}


class BatchHardTripletSettings(EmbeddingLossSettings):
    triplet_margin: float = Field(default=5.0, ge=0)
    batch_hard_distance: Literal["euclidean", "squared_euclidean", "cosine"] = "euclidean"


def _distance_matrix(kind: str, anchors: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """(A, C) distances, computed as sentence-transformers' batch-hard loss does (from dot products, the zeros of
    the euclidean square root given a zero gradient)."""
    if kind == "cosine":
        return 1 - F.normalize(anchors, dim=-1) @ F.normalize(candidates, dim=-1).T
    squared = (anchors * anchors).sum(-1, keepdim=True) - 2.0 * anchors @ candidates.T \
        + (candidates * candidates).sum(-1).unsqueeze(0)
    squared = squared.clamp(min=0)
    if kind == "squared_euclidean":
        return squared
    zero = squared.eq(0).to(squared.dtype)
    return (1.0 - zero) * torch.sqrt(squared + zero * 1e-16)


@LOSSES.register("batch_hard_triplet")
class BatchHardTripletLoss(EmbeddingLoss):
    """Batch-hard triplet loss (Hermans et al., 2017) on labels (sentence-transformers' BatchHardTripletLoss).

    The embeddings are every query and every positive of the batch, each carrying its row's label
    (``labels`` (B,), the data's label column); for each of them as anchor, the furthest same-label embedding and the
    nearest other-label one make its triplet::

        E      = [queries ; positives] of the global batch, labels [l ; l]
        loss   = mean over anchors a of relu(max_{same label, not a} d(a, .) - min_{other label} d(a, .) + margin)

    Under DDP this rank's 2B embeddings are the anchors and the candidates are gathered from every rank with
    gradients, so the mined triplets are those of the global batch; the mean over ranks is the global mean.
    Distances: euclidean, squared_euclidean or cosine (1 - cos).
    """

    Settings: ClassVar[type[BatchHardTripletSettings]] = BatchHardTripletSettings
    needs_labels: ClassVar[bool] = True
    uses_negatives: ClassVar[bool] = False

    def __init__(self, margin: float = 5.0, distance: str = "euclidean"):
        super().__init__()
        self.margin, self.distance = margin, distance

    @classmethod
    def from_recipe(cls, recipe: "Recipe") -> "BatchHardTripletLoss":
        return cls(recipe.loss.triplet_margin, recipe.loss.batch_hard_distance)

    def forward(
        self, query: torch.Tensor, positive: torch.Tensor, negatives: torch.Tensor | None = None,
        labels: torch.Tensor | None = None, scores: torch.Tensor | None = None,
    ) -> torch.Tensor:
        _check_shapes(query, positive, None)
        if labels is None:
            raise ValueError("BatchHardTripletLoss needs a label per pair (data.columns.label); the batch has none")
        batch = query.shape[0]
        rank, world = rank_and_world()
        with _full_precision(query.device):
            query, positive = _upcast(query), _upcast(positive)
            anchors = torch.cat([query, positive])
            candidates = torch.cat([gather_with_grad(query), gather_with_grad(positive)])
            everyone = gather_no_grad(labels.to(torch.int64))
            anchor_labels = torch.cat([labels, labels]).to(torch.int64)
            candidate_labels = torch.cat([everyone, everyone])
            distances = _distance_matrix(self.distance, anchors, candidates)
            # an anchor is its own candidate at these columns: not its own positive
            own = rank * batch + torch.arange(batch, device=query.device)
            own = torch.cat([own, own + world * batch])
            same = anchor_labels.unsqueeze(1) == candidate_labels.unsqueeze(0)
            is_self = torch.zeros_like(same)
            is_self[torch.arange(2 * batch, device=query.device), own] = True
            hardest_positive = (distances * (same & ~is_self)).max(dim=1).values
            # sentence-transformers' form: same-label columns lifted by the row's largest distance before the min
            lifted = distances + distances.max(dim=1, keepdim=True).values * same
            hardest_negative = lifted.min(dim=1).values
            return F.relu(hardest_positive - hardest_negative + self.margin).mean()

    @property
    def config(self) -> dict[str, Any]:
        return {"name": type(self).__name__, "loss_type": "batch_hard_triplet", "margin": self.margin,
                "distance": self.distance}


__all__ = ["BatchHardTripletLoss", "TripletLoss", "pair_distance"]
