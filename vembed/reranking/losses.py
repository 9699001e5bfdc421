"""Losses on score lists, never on models: `forward(scores, labels, mask) -> scalar`.

`scores` (B, L): a reranker's raw logits for B queries' lists of L documents (the positive and its mined negatives,
or a list from the data); `labels` (B, L): relevance (1/0, or graded / soft scores); `mask` (B, L) bool: which
entries are real documents (lists shorter than L are padded); for the distillation losses (rerank_margin_mse,
rerank_distill_kl) `labels` are a teacher's scores. Each loss equals sentence-transformers' CrossEncoder loss of the
same name on the same logits, or its formula where that library has none (tests/reranking/test_losses.py: value and
gradient).

Under torch.distributed every loss is a mean over the whole global batch: the count it divides by (pairs or lists)
is summed over ranks, so that DDP's gradient average gives the gradient of one process on the concatenated batch even
when ranks hold lists of different lengths.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from vembed.recipe import Settings
from vembed.reranking import RANKING_LOSSES

if TYPE_CHECKING:
    from vembed.recipe import Recipe

PADDING_SCORE = -1e16  # a padded entry's logit: last in any sort, zero weight in a softmax


class RankingLossSettings(Settings):
    """The keys every ranking loss reads (none yet)."""


class RankingLoss(nn.Module):
    Settings: ClassVar[type[Settings]] = RankingLossSettings
    task: ClassVar[str] = "rerank"  # vembed.tasks: trains rerankers

    @classmethod
    def from_recipe(cls, recipe: "Recipe") -> "RankingLoss":
        return cls()

    def forward(self, scores: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def config(self) -> dict[str, Any]:
        return {"name": type(self).__name__}


def global_mean(total: torch.Tensor, count: torch.Tensor | int) -> torch.Tensor:
    """`total / count` where count is summed over ranks, times the world size: DDP then averages to the
    one-process mean of the global batch."""
    import torch.distributed as dist

    count = torch.as_tensor(count, dtype=total.dtype, device=total.device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        count = count.detach().clone()
        dist.all_reduce(count)
        return total * dist.get_world_size() / count.clamp(min=1)
    return total / count.clamp(min=1)


@RANKING_LOSSES.register("rerank_bce")
class PointwiseBCELoss(RankingLoss):
    """Binary cross-entropy of each pair's logit against its label, averaged over pairs (sentence-transformers'
    BinaryCrossEntropyLoss)."""

    def forward(self, scores: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        per_pair = F.binary_cross_entropy_with_logits(scores[mask].float(), labels[mask].float(), reduction="none")
        return global_mean(per_pair.sum(), mask.sum())


@RANKING_LOSSES.register("rerank_listwise")
class ListwiseSoftmaxLoss(RankingLoss):
    """Cross-entropy between the softmax of a list's labels and the softmax of its logits, averaged over lists
    (sentence-transformers' ListNetLoss). Binary labels make the target put e/(e + n - 1) on a lone positive."""

    def forward(self, scores: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        logits = scores.float().masked_fill(~mask, PADDING_SCORE)
        target = labels.float().masked_fill(~mask, float("-inf")).softmax(dim=1)
        per_list = -(target * logits.log_softmax(dim=1)).sum(dim=1)
        return global_mean(per_list.sum(), scores.shape[0])


class LambdaSettings(RankingLossSettings):
    # NDCG-Loss2++ (the LambdaLoss paper's best): lambda_mu x NDCG-Loss2 weights + LambdaRank weights; 0: LambdaRank.
    lambda_mu: float = Field(default=10.0, ge=0)
    lambda_k: int | None = Field(default=None, gt=0)  # nDCG@k: pairs with both ranks below k do not count
    lambda_sigma: float = Field(default=1.0, gt=0)  # the logistic's slope on score differences


@RANKING_LOSSES.register("lambdaloss")
class LambdaLoss(RankingLoss):
    """LambdaLoss (Wang et al. 2018), an nDCG surrogate: over the pairs (i, j) of a list ranked by the current
    scores whose labels differ, -weight_ij log2 sigmoid(sigma (s_i - s_j)), where the weight is how much swapping them
    changes nDCG; the mean over those pairs (sentence-transformers' LambdaLoss with its defaults,
    NDCGLoss2PPScheme, binary log)."""

    Settings = LambdaSettings

    def __init__(self, mu: float = 10.0, k: int | None = None, sigma: float = 1.0, eps: float = 1e-10):
        super().__init__()
        self.mu, self.k, self.sigma, self.eps = mu, k, sigma, eps

    @classmethod
    def from_recipe(cls, recipe: "Recipe") -> "LambdaLoss":
        loss = recipe.loss
        return cls(mu=loss.lambda_mu, k=loss.lambda_k, sigma=loss.lambda_sigma)

    @property
    def config(self) -> dict[str, Any]:
        return {"name": type(self).__name__, "mu": self.mu, "k": self.k, "sigma": self.sigma}

    def forward(self, scores: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        length = scores.shape[1]
        logits = scores.float().masked_fill(~mask, PADDING_SCORE)
        truth = labels.float().masked_fill(~mask, float("-inf"))
        ranked_logits, order = logits.sort(dim=1, descending=True)
        ranked_truth = truth.gather(1, order)  # labels in the order the scores rank them
        ideal = truth.sort(dim=1, descending=True).values.clamp(min=0.0)
        label_gap = ranked_truth[:, :, None] - ranked_truth[:, None, :]
        counted = torch.isfinite(label_gap) & (label_gap > 0)  # real pairs, i above j in truth
        k = self.k or length
        top = torch.zeros(length, length, dtype=torch.bool, device=scores.device)
        top[:k, :] = True
        top[:, :k] = True
        counted = counted & top
        ranked_truth = ranked_truth.clamp(min=0.0)
        position = torch.arange(1, length + 1, device=scores.device, dtype=torch.float32)
        discount = torch.log2(1.0 + position)
        best_dcg = ((2.0 ** ideal - 1.0) / discount)[:, :k].sum(dim=1).clamp(min=self.eps)
        gain = (2.0 ** ranked_truth - 1.0) / best_dcg[:, None]
        gain_gap = (gain[:, :, None] - gain[:, None, :]).abs()
        # LambdaRank: |1/D(i) - 1/D(j)|; NDCG-Loss2: |1/D(|i-j|) - 1/D(|i-j|+1)| (0 on the diagonal).
        lambdarank = (1.0 / discount[:, None] - 1.0 / discount[None, :]).abs()
        distance = (position[:, None] - position[None, :]).abs().long()
        extended = torch.log2(1.0 + torch.arange(0, length + 1, device=scores.device, dtype=torch.float32))
        ndcg2 = (1.0 / extended[distance.clamp(min=1)] - 1.0 / extended[distance + 1]).abs()
        ndcg2 = ndcg2.masked_fill(distance == 0, 0.0)
        weights = (self.mu * ndcg2 + lambdarank)[None] * gain_gap
        differences = (ranked_logits[:, :, None] - ranked_logits[:, None, :]).clamp(min=-1e8, max=1e8)
        pair_losses = weights * F.logsigmoid(self.sigma * differences) / math.log(2)
        return global_mean(-pair_losses[counted].sum(), counted.sum())


@RANKING_LOSSES.register("rerank_margin_mse")
class MarginMSERankingLoss(RankingLoss):
    """MarginMSE distillation (Hofstätter et al. 2020): each list's first document is the positive, its `labels` are
    a teacher's scores of the list; for every other document j the student's margin s_0 - s_j matches the teacher's
    t_0 - t_j, squared error averaged over the (list, j) margins (sentence-transformers' CrossEncoder MarginMSELoss
    with teacher scores [positive, negative 1, ...])."""

    def forward(self, scores: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores, labels = scores.float(), labels.float()
        student = scores[:, :1] - scores[:, 1:]
        teacher = labels[:, :1] - labels[:, 1:]
        counted = mask[:, 1:] & mask[:, :1]
        return global_mean(((student - teacher.detach()) ** 2)[counted].sum(), counted.sum())


class ListDistillSettings(RankingLossSettings):
    # The student's logits are divided by `temperature`, the teacher's scores by `teacher_temperature` (unset: the
    # same); 1.0: the raw logits, a cross-encoder's natural scale.
    temperature: float = Field(default=1.0, gt=0)
    teacher_temperature: float | None = Field(default=None, gt=0)


@RANKING_LOSSES.register("rerank_distill_kl")
class ListDistillKLLoss(RankingLoss):
    """KL distillation over a list: the softmax of a query's student logits follows the softmax of the teacher's
    scores given as the list's `labels` (data: `{"query", "documents": [...], "scores": [...]}`)::

        p_teacher = softmax(labels / teacher_temperature)
        loss = temperature^2 * sum_lists KL(p_teacher || softmax(logits / temperature)) / lists

    (the embedders' `distill_kl` on a reranker's list; temperature^2 keeps the gradient's size independent of the
    temperature). sentence-transformers has no listwise KL for CrossEncoders; at temperature 1 the gradient is its
    ListNetLoss's with the teacher scores as labels, and the value that loss's minus the teacher's entropy."""

    Settings = ListDistillSettings

    def __init__(self, temperature: float = 1.0, teacher_temperature: float | None = None):
        super().__init__()
        self.temperature = temperature
        self.teacher_temperature = teacher_temperature if teacher_temperature is not None else temperature

    @classmethod
    def from_recipe(cls, recipe: "Recipe") -> "ListDistillKLLoss":
        return cls(recipe.loss.temperature, recipe.loss.teacher_temperature)

    @property
    def config(self) -> dict[str, Any]:
        return {"name": type(self).__name__, "temperature": self.temperature,
                "teacher_temperature": self.teacher_temperature}

    def forward(self, scores: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        log_student = (scores.float() / self.temperature).masked_fill(~mask, PADDING_SCORE).log_softmax(dim=1)
        teacher = (labels.float().detach() / self.teacher_temperature).masked_fill(~mask, float("-inf"))
        target = teacher.softmax(dim=1)
        per_entry = (torch.xlogy(target, target) - target * log_student).masked_fill(~mask, 0.0)
        return global_mean(per_entry.sum() * self.temperature ** 2, scores.shape[0])
