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

from vembed.errors import DataError, RecipeError
from vembed.reranking import RERANKERS
from vembed.tasks import TASKS, Task

if TYPE_CHECKING:
    from accelerate import Accelerator

    from vembed.recipe import DataConfig, Recipe

NO_GRADIENT_CACHE = ("is not needed for rerankers: a query's loss reads only its own list (no in-batch negatives), "
                     "so the batch does not grow with memory; set use_gradient_cache: false and pairs_per_chunk to "
                     "bound memory")


class RerankObjective(nn.Module):
    """The reranker and its loss in one module (what DDP wraps). `forward(batch)`: the loss of a collated batch
    (`vembed.reranking.data.collate_lists`)."""

    def __init__(self, adapter: nn.Module, loss: nn.Module, pairs_per_chunk: int | None = None,
                 length_chunks: int = 1):
        super().__init__()
        self.adapter, self.loss, self.pairs_per_chunk = adapter, loss, pairs_per_chunk
        # Length groups index pairs by row: only for rerankers whose batch is rows of tokens (not Qwen-VL's patches).
        self.length_chunks = length_chunks if getattr(adapter, "length_chunking", False) else 1

    def scores(self, pairs: dict[str, torch.Tensor]) -> torch.Tensor:
        """(n,) logits of the flat pairs. With `length_chunks` > 1 the pairs run as that many length-sorted groups,
        each padded only to its own longest pair (the recipe's length-aware encoding: a batch's short pairs stop
        paying for its long ones), their scores put back in batch order."""
        from vembed.models.length_chunks import chunk_rows, in_batch_order, trim_padding

        mask = pairs.get("attention_mask")
        if self.length_chunks <= 1 or mask is None or len(mask) < 2:
            return self._scores(pairs)
        groups = chunk_rows(mask, self.length_chunks)
        parts = [self._scores(trim_padding({key: value[rows] for key, value in pairs.items()})) for rows in groups]
        return in_batch_order(torch.cat(parts), torch.cat(groups))

    def _scores(self, pairs: dict[str, torch.Tensor]) -> torch.Tensor:
        """(n,) logits; in chunks of `pairs_per_chunk` under activation checkpointing when training, so only one
        chunk's activations are alive at a time (each is recomputed in the backward)."""
        n = self.adapter.num_sides(pairs)
        chunk = self.pairs_per_chunk
        if not chunk or n <= chunk:
            return self.adapter(pairs)
        from torch.utils.checkpoint import checkpoint

        parts = []
        for start in range(0, n, chunk):
            # The adapter's own slicing: a Qwen-VL chunk also takes its pairs' images (pixel rows are patches).
            part = self.adapter.slice_batch(pairs, start, min(start + chunk, n))
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

    def __init__(self, recipe: "Recipe"):
        super().__init__(recipe)
        if recipe.data.validation is not None and "metric_for_best_model" not in recipe.model_fields_set:
            recipe.metric_for_best_model = "reranked/ndcg@10"
            recipe.model_fields_set.discard("metric_for_best_model")

    @classmethod
    def check_recipe(cls, recipe: "Recipe", *, for_training: bool = True) -> None:
        from vembed.components import model_class
        from vembed.data.paths import check_data_paths

        if recipe.data.streaming:
            raise RecipeError("data.streaming", "is not available for rerankers yet; set data.streaming: false")
        check_data_paths(recipe.data, ("train",) if for_training else ())
        _check_evaluation(recipe)
        model_class(recipe).check_recipe(recipe)

    def load_train_data(self):
        from vembed.components import model_class
        from vembed.reranking.data import first_image_document, read_lists

        self.train_lists, report = read_lists(self.recipe.data, "train")
        if "image" not in model_class(self.recipe).modalities:
            found = first_image_document(self.train_lists)
            if found is not None:
                raise DataError(f"holds an image document, which model_type {self.recipe.model_type} (text only) "
                                "cannot read; use model_type qwen_vl_reranker or give text documents",
                                file=found.source, row=found.row)
        return report

    def batch_lines(self, world_size: int) -> list[tuple[str, str]]:
        recipe = self.recipe
        lists = recipe.batch_size * world_size
        return [("ranking batch", f"{lists} query lists per forward (each list scored on its own rank)"),
                ("effective batch", f"{lists * recipe.gradient_accumulation_steps} lists per optimizer step"),
                *([("length-aware", f"{recipe.length_chunks} length-sorted padded groups of pairs per forward"
                    if getattr(RERANKERS.get(recipe.model_type), "length_chunking", False)
                    else f"off: {recipe.model_type} batches are not rows of tokens alone")]
                  if recipe.length_chunks > 1 else [])]

    def build_objective(self) -> nn.Module:
        from vembed.components import loss_class

        recipe = self.recipe
        adapter = self.build_adapter()
        return RerankObjective(adapter, loss_class(recipe).from_recipe(recipe), adapter.settings.pairs_per_chunk,
                               recipe.length_chunks)

    def train_dataset(self, objective: nn.Module):
        from vembed.reranking.data import collate_lists

        return self.train_lists, partial(collate_lists, objective.adapter)

    def load_eval_split(self, split: str) -> Any:
        """data.<split>'s corpus split and the first-stage run to rerank on it (None without them): validation is
        evaluated during training, test once at the end (the loop's rule for every task)."""
        from vembed.data.corpus import corpus_sources
        from vembed.evaluation.runs import read_run

        data = self.recipe.data
        if getattr(data, split) is None:
            return None
        return corpus_sources(data, split)[None].load(), read_run(data.first_stage_run_of(split)[1])

    def held_out_images(self, data: Any) -> list[Any]:
        from vembed.tasks.contrastive import side_images

        return side_images(data[0]) if data else []  # the corpus split; its first-stage run names ids only

    def evaluate(self, model: nn.Module, data: Any, accelerator: "Accelerator",
                 prepared: nn.Module | None = None) -> dict[str, float]:
        """Every process reranks the whole run (the same numbers on each: a reranker evaluation is small)."""
        from vembed.reranking.evaluation import FIRST_STAGE_DEPTH, rerank_run

        if not data:
            return {}
        split, run = data
        return rerank_run(partial(model.score, batch_size=self.recipe.resolved_eval_batch_size), split, run,
                          depth=FIRST_STAGE_DEPTH)

    def headline(self, metrics: dict[str, float]) -> str:
        shown = [f"{stage}/{name}" for name in ("ndcg@10", "mrr@10") for stage in ("first_stage", "reranked")]
        return "  ".join(f"{key}={metrics[key]:.4f}" for key in shown if key in metrics)


def _check_evaluation(recipe: "Recipe") -> None:
    """Held-out data (data.validation, data.test) is a corpus folder with a first-stage run to rerank; the best
    checkpoint is picked by a reranked metric (default: reranked/ndcg@10). One line naming the key otherwise, before
    anything is read."""
    from vembed.evaluation.corpus import DEFAULT_CUTOFFS

    data = recipe.data
    for split in ("validation", "test"):
        _check_held_out(data, split)
    if data.validation is None:
        return
    names = [f"{stage}/{name}" for stage in ("reranked", "first_stage") for name in DEFAULT_CUTOFFS.names()]
    if "metric_for_best_model" not in recipe.model_fields_set:
        recipe.metric_for_best_model = "reranked/ndcg@10"
        recipe.model_fields_set.discard("metric_for_best_model")
    elif recipe.metric_for_best_model not in names:
        raise RecipeError("metric_for_best_model", f"{recipe.metric_for_best_model!r} is not a reranking metric; use "
                                                   f"one of: {', '.join(names)}")


def _check_held_out(data: "DataConfig", split: str) -> None:
    """data.<split> (when set) is a corpus folder whose first-stage run file exists; a run file is set only for a
    split that is."""
    import os

    from vembed.data.corpus import corpus_sources

    key, run = data.first_stage_run_of(split)
    if getattr(data, split) is None:
        if run is not None:
            bare = " (a bare path is data.validation's run; data.test's is first_stage_run: {test: PATH})" \
                if key == "data.first_stage_run" and data.test is not None else ""
            raise RecipeError(key, f"is set but data.{split} is not; name the corpus folder the run was retrieved "
                                   f"on{bare}")
        return
    if None not in corpus_sources(data, split):
        raise RecipeError(f"data.{split}", "must be a corpus folder (corpus.jsonl, queries.jsonl, qrels/) for "
                                           "rerankers: its first-stage candidates are reranked and judged")
    corpus_sources(data, split)[None].check()
    if run is None or not os.path.isfile(run):
        found = "is not set" if run is None else f"{run!r} is not a file"
        shape = "; a run per split: first_stage_run: {validation: PATH, test: PATH}" if split == "test" else ""
        raise RecipeError(key, f"{found}; give the TREC run file of the first stage on data.{split} (e.g. the "
                               f"embedder's top 100 per query){shape}")
