"""GISTEmbed (Solatorio, 2024): InfoNCE whose in-batch candidates are masked where a guide model scores them above
the row's positive (likely unlabelled positives). The guide's embeddings arrive with the batch (`guide=`): the
objective encodes the batch with the frozen guide (vembed/losses/guide.py), so the loss still takes embeddings."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from vembed.distributed import gather_with_grad, rank_and_world
from vembed.losses import LOSSES
from vembed.losses.base import EmbeddingLoss, EmbeddingLossSettings
from vembed.losses.contrastive import _check_shapes, _full_precision, _upcast

if TYPE_CHECKING:
    from vembed.recipe import Recipe

Guide = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]


class GISTEmbedSettings(EmbeddingLossSettings):
    # A model folder vembed saved, or a sentence-transformers folder (Transformer + Pooling [+ Normalize]): frozen,
    # it scores every candidate of the batch; a candidate it scores above the row's positive is not a negative.
    gist_guide: str
    gist_margin_strategy: Literal["absolute", "relative"] = "absolute"
    # absolute: masked when guide(q, c) > guide(q, p) - margin; relative: > guide(q, p) - |guide(q, p)| * margin
    gist_margin: float = Field(default=0.0, ge=0.0)
    gist_contrast_anchors: bool = True  # other queries of the batch are candidates too
    gist_contrast_positives: bool = True  # so are other positives, for each positive


def _cosines(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # As torch's CosineSimilarity (what sentence-transformers' GISTEmbedLoss uses): each norm clamped at 1e-8.
    return (x @ y.T) / (x.norm(dim=-1, keepdim=True).clamp_min(1e-8) * y.norm(dim=-1).clamp_min(1e-8).unsqueeze(0))


@LOSSES.register("gist")
class GISTEmbedLoss(EmbeddingLoss):
    """GISTEmbed over the global batch (sentence-transformers' GISTEmbedLoss with ``gather_across_devices``).

    For this rank's B queries, with positives P and hard negatives N gathered from every rank (N: each row's k
    flattened), and the guide's embeddings gq, gp, gn of the same texts::

        s_i    = guide cos(gq_i, gp_i)                              # the row's positive, as the guide sees it
        blocks = [cos(q, P_all), cos(q, Q_all), cos(p_local, P_all), cos(q, N_all)]
        each entry whose guide cosine is above s_i - margin is masked (-inf), except the row's own positive
        loss   = cross_entropy(cat(blocks) / temperature, rank * B + arange(B))

    The query-query and positive-positive blocks are optional (``contrast_anchors``, ``contrast_positives``); a
    block's own diagonal is masked by the guide itself (a text is as similar to itself as anything). With one hard
    negative per row this is sentence-transformers' loss exactly in one process; under DDP the query-query block
    holds every rank's queries (sentence-transformers' gathering keeps only the local ones there, which is not the
    single-process loss), so two ranks equal one process on the whole batch. The guide's embeddings
    are constants (no gradient), so under GradCache the loss is computed on the whole batch like InfoNCE.
    """

    Settings: ClassVar[type[GISTEmbedSettings]] = GISTEmbedSettings
    needs_guide: ClassVar[bool] = True

    def __init__(self, temperature: float = 0.01, margin_strategy: str = "absolute", margin: float = 0.0,
                 contrast_anchors: bool = True, contrast_positives: bool = True, guide_folder: str | None = None):
        super().__init__()
        if margin_strategy not in ("absolute", "relative"):
            raise ValueError(f"margin_strategy must be absolute or relative, got {margin_strategy!r}")
        self.temperature, self.margin_strategy, self.margin = temperature, margin_strategy, margin
        self.contrast_anchors, self.contrast_positives = contrast_anchors, contrast_positives
        self.guide_folder = guide_folder

    @classmethod
    def from_recipe(cls, recipe: "Recipe") -> "GISTEmbedLoss":
        s = recipe.loss
        return cls(s.temperature, s.gist_margin_strategy, s.gist_margin, s.gist_contrast_anchors,
                   s.gist_contrast_positives, s.gist_guide)

    def forward(
        self, query: torch.Tensor, positive: torch.Tensor, negatives: torch.Tensor | None = None,
        labels: torch.Tensor | None = None, scores: torch.Tensor | None = None, guide: Guide | None = None,
    ) -> torch.Tensor:
        _check_shapes(query, positive, negatives)
        if guide is None:
            raise ValueError("GISTEmbedLoss needs the guide model's embeddings of the batch (guide=)")
        batch = query.shape[0]
        rank, _ = rank_and_world()
        offset = rank * batch
        with _full_precision(query.device):
            query, positive = _upcast(query), _upcast(positive)
            guide_query, guide_positive = (_upcast(t.detach()) for t in guide[:2])
            all_positive = gather_with_grad(positive)
            all_guide_positive = gather_with_grad(guide_positive)
            rows = torch.arange(batch, device=query.device)
            own = (guide_query * guide_positive).sum(-1, keepdim=True) / (
                guide_query.norm(dim=-1, keepdim=True).clamp_min(1e-8)
                * guide_positive.norm(dim=-1, keepdim=True).clamp_min(1e-8))
            threshold = own - self.margin if self.margin_strategy == "absolute" else own - own.abs() * self.margin

            def masked(similarity: torch.Tensor, guided: torch.Tensor, keep_positive: bool = False) -> torch.Tensor:
                mask = guided > threshold
                if keep_positive:
                    mask[rows, offset + rows] = False
                return similarity.masked_fill(mask, float("-inf"))

            blocks = [masked(_cosines(query, all_positive), _cosines(guide_query, all_guide_positive), True)]
            if self.contrast_anchors:  # every rank's queries (sentence-transformers' gather keeps only local ones)
                blocks.append(masked(_cosines(query, gather_with_grad(query)),
                                     _cosines(guide_query, gather_with_grad(guide_query))))
            if self.contrast_positives:
                blocks.append(masked(_cosines(positive, all_positive), _cosines(guide_positive, all_guide_positive)))
            if negatives is not None and negatives.shape[1]:
                if guide[2] is None:
                    raise ValueError("GISTEmbedLoss got hard negatives without the guide's embeddings of them")
                all_negative = gather_with_grad(_upcast(negatives).flatten(0, 1))
                all_guide_negative = gather_with_grad(_upcast(guide[2].detach()).flatten(0, 1))
                blocks.append(masked(_cosines(query, all_negative), _cosines(guide_query, all_guide_negative)))
            logits = torch.cat(blocks, dim=1) / self.temperature
            return F.cross_entropy(logits, offset + rows)

    @property
    def config(self) -> dict[str, Any]:
        return {"name": type(self).__name__, "loss_type": "gist", "guide": self.guide_folder,
                "temperature": self.temperature, "margin_strategy": self.margin_strategy, "margin": self.margin,
                "contrast_anchors": self.contrast_anchors, "contrast_positives": self.contrast_positives}


__all__ = ["GISTEmbedLoss"]
