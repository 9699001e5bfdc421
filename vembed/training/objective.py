"""The trainable unit: an adapter and its loss in one module, so the strategy wraps (DDP, ...) both at once.

A learnable temperature or SigLIP bias lives in the loss; keeping the loss inside the wrapped module is what makes
DDP average its gradient like every other parameter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from vembed.losses.base import EmbeddingLoss
from vembed.models.base import EmbeddingAdapter

if TYPE_CHECKING:
    from collections.abc import Callable


class ContrastiveObjective(nn.Module):
    def __init__(self, adapter: EmbeddingAdapter, loss: EmbeddingLoss):
        super().__init__()
        self.adapter = adapter
        self.loss = loss

    def embed(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Query, positive and (B, k, d) hard-negative embeddings of a collated batch.

        The adapter is called (its `forward` is `encode`), never `.encode` directly: wrappers that hook the call,
        such as an FSDP unit gathering its weights, must see it."""
        negatives = self.adapter(batch["negative"]) if batch.get("num_negatives") else None
        return self.shape_embeddings(
            self.adapter(batch["query"]), self.adapter(batch["positive"]), negatives,
            int(batch.get("num_negatives") or 0),
        )

    @staticmethod
    def shape_embeddings(
        query: torch.Tensor, positive: torch.Tensor, negatives: torch.Tensor | None, num_negatives: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if negatives is None or num_negatives == 0:
            return query, positive, None
        return query, positive, negatives.view(query.shape[0], num_negatives, -1)

    def forward(self, batch: dict[str, Any] | None = None, *, encode: dict[str, Any] | None = None,
                run_inside: "Callable[[ContrastiveObjective], torch.Tensor] | None" = None) -> torch.Tensor:
        """The loss of a batch; or, for evaluation (`encode`: a preprocessed batch of sides), their float32
        embeddings; or `run_inside(self)`: a pass that must run inside this module's (wrapped) forward so that DDP
        and other wrappers see it (GradCache's replays, vembed/training/grad_cache.py).

        All go through `forward` so that the wrapper (DDP, FSDP's root, DeepSpeed's engine) runs around every pass:
        ZeRO-3 gathers a parameter read outside its own module's forward only inside its engine's forward. `encode`
        is an argument, not a closure, so the wrapper sees the inputs too (DeepSpeed casts them to its dtype)."""
        if encode is not None:
            return self._encode_in_full_precision(encode)
        if run_inside is not None:
            return run_inside(self)
        return self.loss(*self.embed(batch))

    def _encode_in_full_precision(self, inputs: dict[str, Any]) -> torch.Tensor:
        # Evaluation measures the model that is saved, as `vembed eval` runs it: in the dtype of its weights (float32;
        # only DeepSpeed's bf16/fp16 engines hold half-precision weights), whatever autocast the launch wraps the
        # forward in (accelerate's mixed precision).
        device = next((v.device for v in inputs.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))
        with torch.autocast(device.type, enabled=False):
            return self.adapter(inputs).float()


def parameter_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: no weight decay on biases, norms, embeddings' scalars or the loss's temperature/bias."""
    decay, no_decay = [], []
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        if param.ndim < 2 or name.startswith("loss.") or "norm" in name.lower():
            no_decay.append(param)
        else:
            decay.append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]
