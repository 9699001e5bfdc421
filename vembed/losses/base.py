"""The loss contract: losses take embeddings, never models.

That separation is what lets GradCache sit between encoder and loss, Matryoshka wrap any loss, and cross-device
gathering live in one place (inside the loss, through `vembed.distributed`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from vembed.recipe import InvalidKey, Settings

if TYPE_CHECKING:
    from vembed.recipe import Recipe


class EmbeddingLossSettings(Settings):
    """The keys every embedding loss reads."""

    # infonce: logits / temperature; siglip: initial scale 1/temperature
    temperature: float = Field(default=0.05, gt=0)
    learnable_temperature: bool = False
    mrl_dims: list[int] | None = None  # Matryoshka: the loss at each truncated dimension (vembed.losses.matryoshka)
    mrl_weights: list[float] | None = None  # per-dimension weights (unset: all 1)
    # FLOPS regularisation of sparse vectors (embedding: sparse; vembed/losses/sparse.py), added to the loss as
    # sentence-transformers' SpladeLoss does: this weight * sum over the vocabulary of the squared mean weight over
    # the global batch's queries (SPLADE papers' lambda_q, about 1e-4 to 1e-2); unset: no such term.
    flops_query_weight: float | None = Field(default=None, ge=0)
    # The same over the batch's documents, positives and hard negatives together (lambda_d); unset: no such term.
    flops_document_weight: float | None = Field(default=None, ge=0)
    # Only queries with more than this many non-zero weights count in their mean (unset: all).
    flops_query_threshold: int | None = Field(default=None, ge=0)
    # Only documents with more than this many non-zero weights count in their mean (unset: all).
    flops_document_threshold: int | None = Field(default=None, ge=0)
    # Raise both FLOPS weights from 0 to their value over this share of the run's optimizer steps, as
    # sentence-transformers' SpladeRegularizerWeightSchedulerCallback (which its trainer adds by default with 1/3,
    # quadratic); unset or 0: the full weights from step 1 (vembed's default, as before this key).
    flops_warmup_ratio: float | None = Field(default=None, ge=0, le=1)
    # How the weights rise: quadratic, weight * (step / warmup steps)^2 (sentence-transformers' default), or linear.
    flops_warmup: Literal["quadratic", "linear"] = "quadratic"

    @property
    def flops_regularized(self) -> bool:
        """Whether a FLOPS term is asked for (a weight set, even 0)."""
        return self.flops_query_weight is not None or self.flops_document_weight is not None

    @model_validator(mode="after")
    def _matryoshka(self) -> "EmbeddingLossSettings":
        if self.mrl_dims is not None:
            if not self.mrl_dims:
                raise InvalidKey("mrl_dims", "is empty; list at least one dimension or remove the key")
            if any(d <= 0 for d in self.mrl_dims):
                raise InvalidKey("mrl_dims", f"dimensions must be positive, got {self.mrl_dims}")
            if len(set(self.mrl_dims)) != len(self.mrl_dims):
                raise InvalidKey("mrl_dims", f"has repeated dimensions: {self.mrl_dims}")
            if self.mrl_dims != sorted(self.mrl_dims, reverse=True):
                raise InvalidKey("mrl_dims", f"{self.mrl_dims} is not from largest to smallest; write "
                                             f"{sorted(self.mrl_dims, reverse=True)}")
        if not self.flops_regularized:
            for key in ("flops_warmup_ratio", "flops_warmup"):
                if getattr(self, key) != type(self).model_fields[key].default:
                    raise InvalidKey(key, "warms up the FLOPS weights; set flops_query_weight or "
                                          "flops_document_weight, or remove it")
        for side in ("query", "document"):
            if getattr(self, f"flops_{side}_threshold") is not None and getattr(self, f"flops_{side}_weight") is None:
                raise InvalidKey(f"flops_{side}_threshold", f"does nothing without flops_{side}_weight; set it or "
                                                            "remove the threshold")
        if self.mrl_weights is not None:
            if self.mrl_dims is None:
                raise InvalidKey("mrl_weights", "is set but mrl_dims is not; set mrl_dims or remove mrl_weights")
            if len(self.mrl_weights) != len(self.mrl_dims):
                raise InvalidKey("mrl_weights", f"has {len(self.mrl_weights)} weights for {len(self.mrl_dims)} "
                                                "mrl_dims; give one per dimension")
        return self


class EmbeddingLoss(nn.Module):
    """Base class. `forward(query, positive, negatives=None, labels=None, scores=None) -> scalar loss`.

    Shapes: `query` and `positive` are `(B, d)` for this process's B local pairs; `negatives`, when given, is
    `(B, k, d)` hard negatives; `labels`, when given, `(B,)` int64 class ids: pairs sharing one are not each
    other's in-batch negatives (losses without in-batch negatives ignore them); `scores`, when given, the data's
    score column as float32: `(B,)` one gold score per pair, or `(B, 1 + k)` teacher scores of the positive and
    each hard negative (losses that do not read scores ignore them). Under torch.distributed a loss
    gathers what it needs from other ranks itself and returns this rank's share, scaled so that averaging gradients
    over ranks (what DDP does) gives the gradient of the loss on the concatenated global batch.
    """

    Settings: ClassVar[type[EmbeddingLossSettings]] = EmbeddingLossSettings  # the recipe keys this loss reads
    # Whether it scores token vectors `(B, T, d)` (late interaction, `embedding: multi_vector`) rather than one
    # vector per side `(B, d)`; the recipe check pairs it with the adapter's `embedding`.
    token_vectors: ClassVar[bool] = False
    # What a batch must carry for this loss, checked against the data before training (vembed/losses/inputs.py):
    needs_scores: ClassVar[str | None] = None  # "pair": one score per pair; "candidates": a list of 1 + k
    needs_labels: ClassVar[bool] = False  # a label per pair (data.columns.label)
    min_negatives: ClassVar[int] = 0  # hard negatives per pair
    needs_guide: ClassVar[bool] = False  # guide= the guide model's embeddings of the batch (GISTEmbed)
    # teacher= (B, d) a teacher's embeddings of the rows, extracted beforehand (embedding_mse)
    needs_teacher: ClassVar[bool] = False
    uses_negatives: ClassVar[bool] = True  # False: hard negatives are not read, so they are not loaded or encoded
    # Why this loss cannot run under GradCache (the launch plan refuses it, naming the reason); None: it can, because
    # it is computed on the whole batch's embeddings.
    gradient_cache_refusal: ClassVar[str | None] = None

    @classmethod
    def from_recipe(cls, recipe: "Recipe") -> "EmbeddingLoss":
        raise NotImplementedError

    def begin_step(self, step: int, total_steps: int) -> None:
        """Told by the loop before each optimizer step's batches: `step` optimizer steps are done, of `total_steps`.
        For a loss whose terms follow a schedule (the FLOPS warmup); resuming tells it the restored step."""

    def forward(
        self, query: torch.Tensor, positive: torch.Tensor, negatives: torch.Tensor | None = None,
        labels: torch.Tensor | None = None, scores: torch.Tensor | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError

    @property
    def config(self) -> dict[str, Any]:
        """What the loss was built with, for the saved model card and metrics.json."""
        return {"name": type(self).__name__}
