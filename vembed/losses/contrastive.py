"""Contrastive losses on embeddings: InfoNCE (softmax over the batch) and SigLIP (a sigmoid per pair).

Both score this rank's queries against the documents of every rank (gathered with gradients through
`vembed.distributed.gather_with_grad`), with hard negatives as extra columns, and both return this rank's share of the
global-batch loss so that DDP's gradient averaging gives the gradient of the single-process loss on the whole batch.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from vembed.distributed import gather_no_grad, gather_with_grad, rank_and_world
from vembed.errors import RecipeError
from vembed.losses import LOSSES
from vembed.losses.base import EmbeddingLoss, EmbeddingLossSettings
from vembed.recipe import InvalidKey

if TYPE_CHECKING:
    from vembed.recipe import Recipe

# CLIP's cap on a learned logit scale (a temperature of at least 0.01): above it training becomes unstable.
MAX_LOGIT_SCALE = 100.0


def _check_shapes(query: torch.Tensor, positive: torch.Tensor, negatives: torch.Tensor | None) -> None:
    if query.dim() != 2 or positive.shape != query.shape:
        raise ValueError(
            f"query and positive must both be (B, d); got query {tuple(query.shape)}, positive {tuple(positive.shape)}"
        )
    if negatives is not None and (
        negatives.dim() != 3 or negatives.shape[0] != query.shape[0] or negatives.shape[2] != query.shape[1]
    ):
        raise ValueError(
            f"negatives must be (B, k, d) = ({query.shape[0]}, k, {query.shape[1]}); got {tuple(negatives.shape)}"
        )


def _upcast(tensor: torch.Tensor) -> torch.Tensor:
    # bf16/fp16 embeddings are scored in float32 (a softmax over thousands of logits needs the mantissa); float64
    # stays float64.
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


@contextmanager
def _full_precision(device: torch.device):
    # Under mixed-precision autocast a matmul would run in bf16/fp16 again, undoing the upcast.
    with torch.autocast(device_type=device.type, enabled=False):
        yield


def _all_documents(positive: torch.Tensor, negatives: torch.Tensor | None) -> torch.Tensor:
    """`[positives of rank 0, 1, ... ; hard negatives of rank 0, 1, ...]`: (W*B + W*B*k, d), gradients flowing back."""
    documents = gather_with_grad(positive)
    if negatives is None:
        return documents
    return torch.cat([documents, gather_with_grad(negatives.flatten(0, 1))], dim=0)


def _positive_columns(batch_size: int, device: torch.device) -> torch.Tensor:
    # This rank's i-th query is the (rank * B + i)-th gathered document: the offset is what makes the gathered
    # columns line up with the local rows.
    rank, _ = rank_and_world()
    return rank * batch_size + torch.arange(batch_size, device=device)


def _global_batch(query: torch.Tensor) -> int:
    return query.shape[0] * rank_and_world()[1]


def _same_label(labels: torch.Tensor | None, num_columns: int) -> torch.Tensor | None:
    """(B, W*B) True where this rank's row i and the gathered in-batch column j share a label: a record of the same
    class is not a negative. None without labels. The row's own positive is kept by the caller."""
    if labels is None:
        return None
    everyone = gather_no_grad(labels.to(torch.int64))
    if everyone.shape[0] != num_columns:
        raise ValueError(f"labels must be one per pair: {everyone.shape[0]} gathered for {num_columns} pairs")
    return labels.to(torch.int64).unsqueeze(1) == everyone.unsqueeze(0)


def _value(param: torch.Tensor) -> float:
    """A one-element parameter as a float; a sharded (FSDP DTensor) one is gathered first (a collective)."""
    return float((param.full_tensor() if hasattr(param, "full_tensor") else param).item())


def _log_scale_parameter(temperature: float, learnable: bool) -> nn.Parameter:
    # Stored as log(1 / temperature): the optimiser then moves the scale multiplicatively and it stays positive. A
    # fixed temperature is a frozen parameter so that both cases save and load the same state dict. Shape (1,), not a
    # scalar: DeepSpeed cannot broadcast 0-dim parameters.
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    return nn.Parameter(torch.tensor([math.log(1.0 / temperature)]), requires_grad=learnable)


class InfoNCESettings(EmbeddingLossSettings):
    symmetric_loss: bool = True  # also score documents -> queries
    # As in the Qwen3-(VL-)Embedding recipe: drop in-batch negatives scoring above the positive + margin (likely
    # unlabelled positives) ...
    mask_false_negatives: bool = False
    false_negative_margin: float = Field(default=0.1, ge=0.0)  # ... by this margin of cosine similarity
    query_query_loss: bool = False  # other queries of the batch are negatives of each query too
    document_document_loss: bool = False  # other positives of the batch are negatives of each positive

    @model_validator(mode="after")
    def _margin_needs_masking(self) -> "InfoNCESettings":
        # By value, not by presence: a saved recipe (every key written out) must read back.
        default = type(self).model_fields["false_negative_margin"].default
        if self.false_negative_margin != default and not self.mask_false_negatives:
            raise InvalidKey("false_negative_margin", "does nothing unless mask_false_negatives is true; set "
                                                      "mask_false_negatives: true or remove false_negative_margin")
        return self


class SigLIPSettings(EmbeddingLossSettings):
    siglip_bias_init: float = -10.0  # initial learnable bias


@LOSSES.register("infonce")
class InfoNCELoss(EmbeddingLoss):
    """InfoNCE (CLIP's contrastive loss, MultipleNegativesRankingLoss in sentence-transformers) over the global batch.

    Each local query is classified against every document of every rank: all positives gathered from all ranks,
    followed by all hard negatives gathered from all ranks. For this rank's B queries::

        D      = [P_all ; N_all]               # (W*B + W*B*k, d); N_all is each rank's (B, k, d) flattened
        logits = scale * q_local @ D.T         # (B, W*B + W*B*k), scale = 1 / temperature
        labels = rank * B + arange(B)          # the query's own positive among the gathered ones
        loss   = cross_entropy(logits, labels) # mean over this rank's B rows

    Hard negatives are columns added to the in-batch negatives, never a replacement for them. With
    ``symmetric=True`` the documents -> queries direction is added, ``scale * p_local @ Q_all.T`` with the same
    labels (hard negatives take no part in it), and the loss is the mean of the two directions.

    Why the mean over the local B rows, under DDP: the single-process loss on the concatenated global batch of W*B
    pairs is ``L = 1/(W*B) * sum over all rows = 1/W * sum_r loss_r``. The backward of ``gather_with_grad`` sums
    every rank's gradient for a slice and hands it to the rank that owns it, so rank r's embeddings receive
    ``sum_s d loss_s / d e_r = W * dL/d e_r``; DDP then averages parameter gradients over the W ranks, which gives
    exactly ``dL/d theta``. The loss's own parameter (a learnable temperature) gets ``d loss_r / d tau`` on each rank,
    and DDP's average is again ``dL/d tau`` -- provided the loss module sits inside the DDP-wrapped module so that
    its parameters are averaged too. The value returned on each rank is ``loss_r``; the global loss is their mean.

    Inputs must already be L2-normalised (the adapter does it); they are not renormalised here. Logits are computed
    in float32 whatever the input dtype, with autocast disabled. Every rank must pass the same B (drop the last
    incomplete batch) and the same k, or none: the all-gather needs equal shapes.

    Temperature: fixed, or learned (``learnable_temperature=True``) as ``log_scale = log(1 / temperature)``. A learned
    scale is capped at 100 (temperature 0.01) like CLIP; the cap is applied to the parameter itself before it is used
    (open_clip clamps it after each optimiser step), so a scale at the cap keeps its gradient and can move back
    down. A fixed temperature is used as given. Exclude ``log_scale`` from weight decay: decay pulls it towards 0,
    i.e. towards temperature 1.

    Options of the Qwen3-(VL-)Embedding recipe, both composable with everything above:

    - ``false_negative_margin`` (false-negative masking): a negative column of row i whose similarity exceeds the
      row's positive similarity by more than the margin (``s_ij > s_ii + margin``) is taken for an unlabelled
      positive and dropped from the softmax. The mask is computed on detached similarities, so it only selects.
      It applies to every negative column (in-batch, hard, and the query-query / document-document ones), in both
      directions.
    - ``query_query`` / ``document_document``: the queries -> documents softmax also holds ``q_i . q_j`` and
      ``p_i . p_j`` for every gathered j other than i itself (the GTE / Qwen3-Embedding "improved contrastive
      loss")::

          logits_i = scale * [q_i @ D.T,  q_i @ Q_all.T (j != i),  p_i @ P_all.T (j != i)]

      The reverse (documents -> queries) direction, when symmetric, stays as it is.

    Under DDP the self columns to drop sit at ``rank * B + i`` of the gathered blocks, like the labels.

    Labels (``labels``: one int64 id per pair, equal for pairs of the same class; the collator makes them from the
    data's label column): an in-batch column whose record shares row i's label is not a negative of row i and is
    dropped, in every in-batch block (gathered positives, query-query, document-document) and in the reverse
    direction; the row's own positive stays. Labels are gathered from every rank, so this holds across the global
    batch. Hard negatives carry no label and are never dropped for it.

    Args (defaults are the recipe's):
        temperature: divides the cosine similarities (initial value when learned). Must be >= 0.01 when learned.
        learnable_temperature: learn the temperature.
        symmetric: also score documents -> queries and average the two directions.
        false_negative_margin: mask negatives scoring above the positive + this margin; None: no masking.
        query_query: add the in-batch query-query similarities as negatives.
        document_document: add the in-batch positive-positive similarities as negatives.

    Example::

        loss_fn = InfoNCELoss(temperature=0.05, symmetric=True)
        q = F.normalize(torch.randn(8, 64), dim=-1)
        p = F.normalize(torch.randn(8, 64), dim=-1)
        n = F.normalize(torch.randn(8, 2, 64), dim=-1)  # 2 hard negatives per pair
        loss = loss_fn(q, p, n)  # scalar, float32
        loss = loss_fn(q, p, n, labels=torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]))  # same-label pairs are not negatives
    """

    Settings: ClassVar[type[InfoNCESettings]] = InfoNCESettings

    def __init__(
        self,
        temperature: float = 0.05,
        learnable_temperature: bool = False,
        symmetric: bool = True,
        false_negative_margin: float | None = None,
        query_query: bool = False,
        document_document: bool = False,
    ):
        super().__init__()
        self.false_negative_margin = false_negative_margin
        self.query_query = query_query
        self.document_document = document_document
        if learnable_temperature and 1.0 / temperature > MAX_LOGIT_SCALE * (1 + 1e-6):
            raise ValueError(
                f"a learnable temperature starts at {temperature}, below the cap of {1 / MAX_LOGIT_SCALE}; "
                f"use temperature >= {1 / MAX_LOGIT_SCALE} or a fixed temperature"
            )
        self.temperature = temperature
        self.learnable_temperature = learnable_temperature
        self.symmetric = symmetric
        self.log_scale = _log_scale_parameter(temperature, learnable_temperature)

    @classmethod
    def from_recipe(cls, recipe: "Recipe") -> "InfoNCELoss":
        try:
            settings = recipe.loss
            return cls(
                settings.temperature,
                settings.learnable_temperature,
                settings.symmetric_loss,
                false_negative_margin=settings.false_negative_margin if settings.mask_false_negatives else None,
                query_query=settings.query_query_loss,
                document_document=settings.document_document_loss,
            )
        except ValueError as err:
            raise RecipeError("temperature", str(err)) from None

    def scale(self) -> torch.Tensor:
        """The logit scale 1 / temperature in use (a learned one clamped to MAX_LOGIT_SCALE first)."""
        if self.log_scale.requires_grad:
            with torch.no_grad():
                self.log_scale.clamp_(max=math.log(MAX_LOGIT_SCALE))
        return self.log_scale.exp()

    def forward(
        self, query: torch.Tensor, positive: torch.Tensor, negatives: torch.Tensor | None = None,
        labels: torch.Tensor | None = None, scores: torch.Tensor | None = None,
    ) -> torch.Tensor:
        _check_shapes(query, positive, negatives)
        with _full_precision(query.device):
            query, positive = _upcast(query), _upcast(positive)
            negatives = _upcast(negatives) if negatives is not None else None
            scale = self.scale()
            columns = _positive_columns(query.shape[0], query.device)
            all_queries = gather_with_grad(query) if (self.symmetric or self.query_query) else None
            blocks = [query @ _all_documents(positive, negatives).T]
            if self.query_query:
                blocks.append(query @ all_queries.T)
            if self.document_document:
                blocks.append(positive @ gather_with_grad(positive).T)
            scores = torch.cat(blocks, dim=1)
            # Column offsets of the extra blocks, whose self similarity (at rank * B + i within a block) is dropped.
            self_blocks = [sum(block.shape[1] for block in blocks[:k]) for k in range(1, len(blocks))]
            # In-batch blocks (gathered positives, and the query-query / document-document ones): W*B columns each,
            # one per record, where a record sharing the row's label is dropped. Hard negatives carry no label.
            same = _same_label(labels, _global_batch(query))
            in_batch = [0, *self_blocks]
            loss = F.cross_entropy(self._logits(scale, scores, columns, self_blocks, same, in_batch), columns)
            if self.symmetric:
                reverse = self._logits(scale, positive @ all_queries.T, columns, [], same, [0])
                loss = (loss + F.cross_entropy(reverse, columns)) / 2
        return loss

    def _logits(
        self, scale: torch.Tensor, scores: torch.Tensor, columns: torch.Tensor, self_blocks: list[int],
        same_label: torch.Tensor | None = None, in_batch: list[int] = (),
    ) -> torch.Tensor:
        """`scale * scores` with dropped columns at -inf: each row's self similarity in the extra blocks, (labels
        given) the records sharing the row's label in each in-batch block, and (masking on) negatives above the
        row's positive + margin. Filling after scaling keeps the gradient of the scale finite (it would be inf * 0
        otherwise); the mask is computed without gradient, it only selects. `columns`: each row's positive."""
        rows = torch.arange(scores.shape[0], device=scores.device)
        with torch.no_grad():
            dropped = torch.zeros_like(scores, dtype=torch.bool)
            for offset in self_blocks:
                dropped[rows, offset + columns] = True
            if same_label is not None:
                for offset in in_batch:
                    dropped[:, offset : offset + same_label.shape[1]] |= same_label
            if self.false_negative_margin is not None:
                threshold = scores[rows, columns].unsqueeze(1) + self.false_negative_margin
                dropped |= scores > threshold
            dropped[rows, columns] = False
        return (scale * scores).masked_fill(dropped, float("-inf"))

    @property
    def config(self) -> dict[str, Any]:
        config = {
            "name": type(self).__name__,
            "loss_type": "infonce",
            "temperature": self.temperature,
            "learnable_temperature": self.learnable_temperature,
            "symmetric": self.symmetric,
            "false_negative_margin": self.false_negative_margin,
            "query_query": self.query_query,
            "document_document": self.document_document,
        }
        if self.learnable_temperature:
            config["learned_temperature"] = math.exp(-min(_value(self.log_scale), math.log(MAX_LOGIT_SCALE)))
        return config


@LOSSES.register("siglip")
class SigLIPLoss(EmbeddingLoss):
    """SigLIP's pairwise sigmoid loss (Zhai et al., 2023) over the global batch.

    Every (local query, gathered document) pair is an independent binary classification: positive for the query's
    own document, negative for every other positive of every rank and every gathered hard negative. For this rank's
    B queries::

        D      = [P_all ; N_all]                    # (W*B + W*B*k, d), as in InfoNCELoss
        logits = t * q_local @ D.T + b              # (B, W*B + W*B*k)
        z[i,j] = +1 if j == rank * B + i else -1
        loss   = -sum_ij log sigmoid(z[i,j] * logits[i,j]) / B

    Dividing by the local batch size B is the paper's normalisation, and under DDP it is what makes gradient
    averaging over ranks equal the gradient of the single-process loss on the concatenated global batch (same
    reasoning as in `InfoNCELoss`: the global loss is the mean over ranks of these per-rank losses).

    The scale ``t`` starts at ``1 / temperature`` and is stored as ``log_scale``; it is learned when
    ``learnable_temperature`` is true and fixed otherwise, with no cap (the paper uses none). The bias ``b`` starts
    at ``bias_init`` (-10 in the paper, which offsets the heavy imbalance of one positive to many negatives) and is
    always learned. With ``labels`` (as for InfoNCE) a pair of two records of the same label is left out of the sum
    (neither pushed apart nor pulled together), the record's own pair kept. As for InfoNCE: inputs already
    L2-normalised, logits in float32, equal B and k on every rank, and keep ``log_scale`` and ``bias`` out of weight
    decay.

    Args (defaults are the recipe's):
        temperature: initial 1 / t (the paper's t = 10 is temperature 0.1).
        learnable_temperature: learn t (the paper does).
        bias_init: initial b.

    Example::

        loss_fn = SigLIPLoss(temperature=0.1, learnable_temperature=True, bias_init=-10.0)
        q = F.normalize(torch.randn(8, 64), dim=-1)
        p = F.normalize(torch.randn(8, 64), dim=-1)
        loss = loss_fn(q, p)  # scalar, float32; gradients reach q, p, loss_fn.log_scale and loss_fn.bias
    """

    Settings: ClassVar[type[SigLIPSettings]] = SigLIPSettings

    def __init__(self, temperature: float = 0.05, learnable_temperature: bool = False, bias_init: float = -10.0):
        super().__init__()
        self.temperature = temperature
        self.learnable_temperature = learnable_temperature
        self.bias_init = bias_init
        self.log_scale = _log_scale_parameter(temperature, learnable_temperature)
        self.bias = nn.Parameter(torch.tensor([float(bias_init)]))

    @classmethod
    def from_recipe(cls, recipe: "Recipe") -> "SigLIPLoss":
        try:
            settings = recipe.loss
            return cls(settings.temperature, settings.learnable_temperature, settings.siglip_bias_init)
        except ValueError as err:
            raise RecipeError("temperature", str(err)) from None

    def forward(
        self, query: torch.Tensor, positive: torch.Tensor, negatives: torch.Tensor | None = None,
        labels: torch.Tensor | None = None, scores: torch.Tensor | None = None,
    ) -> torch.Tensor:
        _check_shapes(query, positive, negatives)
        with _full_precision(query.device):
            query, positive = _upcast(query), _upcast(positive)
            negatives = _upcast(negatives) if negatives is not None else None
            documents = _all_documents(positive, negatives)
            logits = self.log_scale.exp() * query @ documents.T + self.bias
            signs = -torch.ones_like(logits)
            rows = torch.arange(query.shape[0], device=query.device)
            columns = _positive_columns(query.shape[0], query.device)
            signs[rows, columns] = 1.0
            terms = F.logsigmoid(signs * logits)
            if labels is not None:  # pairs of the same label are neither negatives nor positives: left out
                width = _global_batch(query)
                keep = torch.ones_like(terms, dtype=torch.bool)
                keep[:, :width] = ~_same_label(labels, width)
                keep[rows, columns] = True
                terms = terms * keep
            loss = -terms.sum() / query.shape[0]
        return loss

    @property
    def config(self) -> dict[str, Any]:
        config = {
            "name": type(self).__name__,
            "loss_type": "siglip",
            "temperature": self.temperature,
            "learnable_temperature": self.learnable_temperature,
            "bias_init": self.bias_init,
            "learned_bias": _value(self.bias),
        }
        if self.learnable_temperature:
            config["learned_temperature"] = math.exp(-_value(self.log_scale))
        return config


__all__ = ["MAX_LOGIT_SCALE", "InfoNCELoss", "SigLIPLoss"]
