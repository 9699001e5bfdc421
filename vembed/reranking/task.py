"""Reranking: a cross-encoder scores each query's list of documents jointly and a ranking loss compares the scores
with the labels. Lists are the unit: a batch is B queries x (their L documents) pairs.

No in-batch negatives: a query's loss reads only its own list, so each rank's loss is complete on its own lists (the
losses divide by global counts; vembed/reranking/losses.py) and GradCache, which exists to keep a contrastive batch
large, has nothing to do here: it is refused, naming why.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from vembed.errors import RecipeError
from vembed.tasks import TASKS, Task

if TYPE_CHECKING:
    from accelerate import Accelerator

    from vembed.recipe import Recipe

NO_GRADIENT_CACHE = ("is not needed for rerankers: a query's loss reads only its own list (no in-batch negatives), "
                     "so the batch does not grow with memory; set use_gradient_cache: false and pairs_per_chunk to "
                     "bound memory")


class RerankObjective(nn.Module):
    """The reranker and its loss in one module (what DDP wraps). `forward(batch)`: the loss of a collated batch
    (`vembed.reranking.data.collate_lists`)."""

    def __init__(self, adapter: nn.Module, loss: nn.Module, pairs_per_chunk: int | None = None):
        super().__init__()
        self.adapter, self.loss, self.pairs_per_chunk = adapter, loss, pairs_per_chunk

    def scores(self, pairs: dict[str, torch.Tensor]) -> torch.Tensor:
        """(n,) logits of the flat pairs; in chunks of `pairs_per_chunk` under activation checkpointing when
        training, so only one chunk's activations are alive at a time (each is recomputed in the backward)."""
        n = next(iter(pairs.values())).shape[0]
        chunk = self.pairs_per_chunk
        if not chunk or n <= chunk:
            return self.adapter(pairs)
        from torch.utils.checkpoint import checkpoint

        parts = []
        for start in range(0, n, chunk):
            part = {key: value[start:start + chunk] for key, value in pairs.items()}
            if torch.is_grad_enabled():
                parts.append(checkpoint(self.adapter, part, use_reentrant=False))
            else:
                parts.append(self.adapter(part))
        return torch.cat(parts)

    def forward(self, batch: dict[str, Any]) -> torch.Tensor:
        mask = batch["mask"]
        flat = self.scores(batch["pairs"])
        scores = torch.zeros(mask.shape, dtype=flat.dtype, device=flat.device).masked_scatter(mask, flat)
        return self.loss(scores, batch["labels"], mask)


@TASKS.register("rerank")
class RerankTask(Task):
    name = "rerank"
    uses_gradient_cache = False
    no_gradient_cache = NO_GRADIENT_CACHE  # what the launch plan says when GradCache is asked for

    @classmethod
    def check_recipe(cls, recipe: "Recipe", *, for_training: bool = True) -> None:
        from vembed.components import model_class
        from vembed.data.sources import check_data_paths

        if recipe.use_gradient_cache:
            raise RecipeError("use_gradient_cache", NO_GRADIENT_CACHE)
        if recipe.data.streaming:
            raise RecipeError("data.streaming", "is not available for rerankers yet; set data.streaming: false")
        check_data_paths(recipe.data, ("train",) if for_training else ())
        model_class(recipe).check_recipe(recipe)

    def load_train_data(self):
        from vembed.reranking.data import read_lists

        self.train_lists, report = read_lists(self.recipe.data, "train")
        return report

    def batch_lines(self, world_size: int) -> list[tuple[str, str]]:
        recipe = self.recipe
        lists = recipe.batch_size * world_size
        return [("ranking batch", f"{lists} query lists per forward (each list scored on its own rank)"),
                ("effective batch", f"{lists * recipe.gradient_accumulation_steps} lists per optimizer step")]

    def build_objective(self) -> nn.Module:
        from vembed.components import loss_class, model_class

        recipe = self.recipe
        adapter = model_class(recipe).from_recipe(recipe)
        if recipe.gradient_checkpointing:
            adapter.enable_gradient_checkpointing()
        if recipe.use_lora:
            adapter.apply_lora(recipe)
        return RerankObjective(adapter, loss_class(recipe).from_recipe(recipe), adapter.settings.pairs_per_chunk)

    def train_dataset(self, objective: nn.Module):
        from vembed.reranking.data import collate_lists

        return self.train_lists, partial(collate_lists, objective.adapter)

    def load_eval_split(self, split: str) -> Any:
        return None  # reranking evaluation (a first-stage run file reranked) is not built yet

    def evaluate(self, model: nn.Module, data: Any, accelerator: "Accelerator",
                 prepared: nn.Module | None = None) -> dict[str, float]:
        return {}

    def headline(self, metrics: dict[str, float]) -> str:
        return "  ".join(f"{key}={value:.4f}" for key, value in metrics.items())
