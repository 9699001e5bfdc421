"""Contrastive retrieval: embedding adapters trained on (query, positive, negatives) pairs, measured by retrieval."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from vembed.errors import DataError, RecipeError
from vembed.tasks import TASKS, Task

if TYPE_CHECKING:
    from accelerate import Accelerator
    from torch import nn

    from vembed.data.records import Example
    from vembed.recipe import Recipe


@TASKS.register("contrastive")
class ContrastiveTask(Task):
    name = "contrastive"
    uses_gradient_cache = True

    @classmethod
    def check_recipe(cls, recipe: "Recipe", *, for_training: bool = True) -> None:
        from vembed.models import MODELS
        from vembed.recipe import _check_data_paths

        if recipe.data.format == "shards":
            raise RecipeError("data.format", f"shards hold teacher embeddings for blip3o_dit; model_type "
                                             f"{recipe.model_type!r} trains on JSONL/CSV/Parquet/hf pairs")
        from vembed.data.streaming import check_stream_recipe, wants_streaming

        streamed = wants_streaming(recipe.data)
        if streamed and for_training:
            check_stream_recipe(recipe.data, recipe.max_steps)
        _check_data_paths(recipe, ("validation", "test") if streamed else ("train", "validation", "test"))
        adapter_cls = MODELS.get(recipe.model_type)
        adapter_cls.check_recipe(recipe)
        dim = adapter_cls.embedding_dim_for(recipe)  # reads the config only: a bad model_name fails here, cheaply
        if recipe.mrl_dims:
            too_big = [d for d in recipe.mrl_dims if d > dim]
            if too_big:
                raise RecipeError("mrl_dims",
                                  f"{too_big} exceed the embedding size {dim} of this model; use dims <= {dim}")

    def load_train_data(self):
        from vembed.data.sources import load_examples
        from vembed.data.streaming import wants_streaming

        if wants_streaming(self.recipe.data):
            return self._open_train_stream()
        self.train_examples, report = load_examples(
            self.recipe.data, "train", num_hard_negatives=self.recipe.data.num_hard_negatives
        )
        check_images_per_side(self.recipe.model_type, self.train_examples)
        return report

    def every_step_uses_every_parameter(self) -> bool:
        from vembed.models import MODELS

        if self.train_examples is None:
            return False  # streamed: the records are not known before training, so DDP searches
        return every_step_uses_every_tower(MODELS.get(self.recipe.model_type).modalities, self.train_examples)

    def batch_lines(self, world_size: int) -> list[tuple[str, str]]:
        recipe = self.recipe
        contrastive = recipe.batch_size * world_size
        return [("contrastive batch", f"{contrastive} (negatives gathered across processes)"),
                ("effective batch", f"{contrastive * recipe.gradient_accumulation_steps} per optimizer step")]

    def build_objective(self) -> "nn.Module":
        from vembed.losses import build_loss
        from vembed.models import MODELS
        from vembed.training.objective import ContrastiveObjective

        recipe = self.recipe
        adapter = MODELS.get(recipe.model_type).from_recipe(recipe)
        if recipe.gradient_checkpointing:
            adapter.enable_gradient_checkpointing()
        if recipe.use_lora:
            adapter.apply_lora(recipe)
        return ContrastiveObjective(adapter, build_loss(recipe))

    def train_dataset(self, objective: "nn.Module"):
        from vembed.data.collate import PairCollator
        from vembed.data.dataset import PairDataset

        if self.train_examples is None:
            return self._train_stream(objective), None
        self.num_negatives = min((len(e.negatives) for e in self.train_examples), default=0)
        return PairDataset(self.train_examples, self.num_negatives), PairCollator(objective.adapter)

    # --- streamed training data (vembed/data/streaming.py) ----------------------------------------------------------
    def _open_train_stream(self):
        from vembed.data.streaming import StreamReport, open_stream

        self.train_examples = None
        self.stream_backend, self.stream_shards = open_stream(self.recipe.data)
        sizes = [shard.num_samples for shard in self.stream_shards]
        return StreamReport(split="train", files=[shard.path for shard in self.stream_shards],
                            backend=self.stream_backend, num_hard_negatives=self.recipe.data.num_hard_negatives or 0,
                            planned_samples=None if None in sizes else sum(sizes))

    def _train_stream(self, objective: "nn.Module"):
        from vembed.data.collate import PairCollator
        from vembed.data.stream_samples import SampleDecoder
        from vembed.data.streaming import ShardStream
        from vembed.models import MODELS

        recipe, data = self.recipe, self.recipe.data
        decoder = SampleDecoder(data.columns.model_dump(), data.image_root, data.num_hard_negatives or 0,
                                MODELS.get(recipe.model_type).max_images_per_side)
        return ShardStream(self.stream_backend, self.stream_shards, decoder, PairCollator(objective.adapter),
                           batch_size=recipe.batch_size, seed=recipe.seed, shuffle_buffer=data.shuffle_buffer)

    def load_eval_split(self, split: str) -> "list[Example]":
        from vembed.data.sources import load_examples

        if getattr(self.recipe.data, split) is None:
            return []
        examples, _ = load_examples(self.recipe.data, split, num_hard_negatives=0)
        check_images_per_side(self.recipe.model_type, examples)
        limit = self.recipe.data.eval_max_samples
        return examples[:limit] if limit else examples

    def evaluate(self, model: "nn.Module", data: "list[Example]", accelerator: "Accelerator",
                 prepared: "nn.Module | None" = None) -> dict[str, float]:
        from vembed.evaluation.retrieval import evaluate_retrieval

        if not data:
            return {}
        return evaluate_retrieval(
            model,
            data,
            batch_size=self.recipe.resolved_eval_batch_size,
            mrl_dims=self.recipe.mrl_dims,
            accelerator=accelerator,
            # Small sets encode in a blink; a bar for each would only bury the training bar.
            show_progress=accelerator.is_local_main_process and len(data) >= 2000,
            # Through the wrapper, as in training: ZeRO-3 gathers weights read outside their module's forward (CLIP's
            # position embedding) only inside its engine's forward (ContrastiveObjective.forward's `encode`).
            forward=None if prepared is None else lambda inputs: prepared(encode=inputs),
        )

    def headline(self, metrics: dict[str, float]) -> str:
        keys = ("q2d/recall@1", "q2d/recall@5", "q2d/recall@10", "q2d/mrr", "d2q/recall@1")
        return "  ".join(f"{k}={metrics[k]:.3f}" for k in keys if k in metrics)

    def plots(self, metrics: dict[str, Any], output_dir: Path) -> None:
        from vembed.evaluation.plots import plot_recall_vs_dim

        split = metrics.get("test") or metrics.get("validation")
        if split and self.recipe.mrl_dims:
            plot_recall_vs_dim(split, output_dir / "recall_vs_dim.png")


def every_step_uses_every_tower(modalities: frozenset[str], examples: "list[Example]") -> bool:
    """True when each record feeds every tower (e.g. text AND image for CLIP), so every batch gives every parameter a
    gradient and DDP can skip its (costly) search for unused parameters."""
    for example in examples:
        sides = [example.query, example.positive, *example.negatives]
        present = {"text" for s in sides if s.text} | {"image" for s in sides if s.image is not None}
        if not modalities <= present:
            return False
    return True


def check_images_per_side(model_type: str, examples: "list[Example]") -> None:
    """Refuse, before training, records with more images on one side than the model embeds (naming the row)."""
    from vembed.models import MODELS

    limit = MODELS.get(model_type).max_images_per_side
    if limit is None:
        return
    for example in examples:
        named = [("the query", example.query), ("the positive", example.positive)]
        named += [("a hard negative", negative) for negative in example.negatives]
        for name, side in named:
            if len(side.images) > limit:
                raise DataError(
                    f"{name} has {len(side.images)} images; model_type {model_type} embeds at most {limit} per side "
                    "(qwen_vl takes several): give one image path per cell",
                    file=example.source,
                    row=example.row,
                )
