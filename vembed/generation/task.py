"""Flow matching: blip3o_dit learns to turn EVA tokens into CLIP tokens from paired shards; measured by the cosine
between generated and real CLIP tokens on held-out shards."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from vembed.errors import RecipeError
from vembed.generation.flow import interpolate, sample_timesteps
from vembed.tasks import TASKS, Task

if TYPE_CHECKING:
    from accelerate import Accelerator

    from vembed.recipe import Recipe

METRICS = ("image_cosine", "token_cosine", "share_above_0.7", "share_above_0.8", "share_above_0.9")


class FlowMatchingObjective(nn.Module):
    """The DiT and the flow loss in one module: `forward(batch)` draws times and noise, builds x_t, predicts the
    velocity and returns the loss.

    `batch`: `{"eva": (B, M, De), "clip": (B, N, Dc)}`, optionally with `"t"` (B,) and `"noise"` (B, N, Dc) to
    fix the draw (tests; otherwise they come from torch's RNG, which checkpoints save and restore).
    """

    def __init__(self, adapter: nn.Module, loss: nn.Module, recipe: "Recipe"):
        super().__init__()
        self.adapter = adapter
        self.loss = loss
        flow = recipe.loss.flow
        self.data_scale = flow.data_scale
        self.time_kwargs = {"kind": flow.time_sampling, "logit_mean": flow.logit_normal_mean,
                            "logit_std": flow.logit_normal_std, "beta_a": flow.beta_a, "beta_b": flow.beta_b}

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        data = batch["clip"] * self.data_scale
        noise = batch.get("noise")
        noise = torch.randn_like(data) if noise is None else noise
        t = batch.get("t")
        t = sample_timesteps(data.shape[0], **self.time_kwargs).to(data.device) if t is None else t
        velocity = self.adapter(interpolate(noise, data, t), t, batch["eva"])
        return self.loss(velocity, noise, data, t)


def _shard_key(split: str) -> str:
    return f"data.{split}"


@TASKS.register("flow_matching")
class FlowMatchingTask(Task):
    name = "flow_matching"
    no_gradient_cache = "is not supported for blip3o_dit; set it to false"

    @classmethod
    def check_recipe(cls, recipe: "Recipe", *, for_training: bool = True) -> None:
        from vembed.data.embedding_shards import read_index
        from vembed.generation.dit import config_from_recipe

        if recipe.data.format not in ("auto", "shards"):
            raise RecipeError("data.format", f"blip3o_dit trains on shard directories from `vembed extract`; set "
                                             f"data.format: shards (got {recipe.data.format})")
        if recipe.data.streaming:
            raise RecipeError("data.streaming", "applies to contrastive models; blip3o_dit reads the embedding "
                                                "shards of `vembed extract` whole; remove it")
        for key, value in (("use_lora", recipe.use_lora), ("gradient_checkpointing", recipe.gradient_checkpointing)):
            if value:
                raise RecipeError(key, "is not supported for blip3o_dit; set it to false")
        for split in ("train", "validation", "test"):
            if isinstance(getattr(recipe.data, split), dict):
                raise RecipeError(f"data.{split}", "named sources are for pair data; blip3o_dit trains on shard "
                                                   "directories (a path or a list of them)")
        if recipe.data.no_duplicates:
            raise RecipeError("data.no_duplicates", "applies to pair data only; remove it for blip3o_dit")
        for number, stage in enumerate(recipe.stages or ()):
            for key in ("sources", "max_length", "min_pixels", "max_pixels"):
                if getattr(stage, key) is not None:
                    raise RecipeError(f"stages.{number}.{key}", "is for contrastive models; blip3o_dit stages set "
                                                                "epochs, max_steps and learning_rate")
        if recipe.metric_for_best_model not in METRICS:
            raise RecipeError("metric_for_best_model",
                              f"{recipe.metric_for_best_model!r} is not a flow-matching metric; use one of: "
                              f"{', '.join(METRICS)} (e.g. metric_for_best_model: image_cosine)")
        train = read_index(recipe.data.train, "data.train")
        config_from_recipe(recipe, train)  # dims stated in the recipe must match the shards
        for split in ("validation", "test"):
            if getattr(recipe.data, split) is None:
                continue
            other = read_index(getattr(recipe.data, split), _shard_key(split))
            for shape in ("eva_shape", "clip_shape"):
                if other[shape] != train[shape]:
                    raise RecipeError(_shard_key(split), f"{shape.split('_')[0]} tokens are {other[shape]} in "
                                                         f"{other['path']} but {train[shape]} in {train['path']}; "
                                                         "extract both with the same teachers")

    def load_train_data(self):
        from vembed.data.embedding_shards import EmbeddingShardDataset

        self.train_set = EmbeddingShardDataset(self.recipe.data.train,
                                               max_bad_fraction=self.recipe.data.max_bad_fraction)
        return self.train_set.report

    def every_step_uses_every_parameter(self) -> bool:
        return True  # every step runs the whole DiT

    def build_objective(self) -> nn.Module:
        from vembed.components import loss_class, model_class
        from vembed.distributed import rank_and_world

        model = model_class(self.recipe).from_recipe(self.recipe)  # same initial weights on every rank
        # The loop seeds every rank alike; from here on each rank needs its own times and noise, or all ranks would
        # draw the same ones for their different samples. (Checkpoints save each rank's RNG, so resume stays exact.)
        rank, _ = rank_and_world()
        torch.manual_seed(self.recipe.seed + 1_000_003 * rank)
        return FlowMatchingObjective(model, loss_class(self.recipe).from_recipe(self.recipe), self.recipe)

    def train_dataset(self, objective: nn.Module):
        from torch.utils.data import default_collate

        return self.train_set, default_collate

    def load_eval_split(self, split: str) -> dict[str, torch.Tensor] | None:
        from vembed.data.embedding_shards import EmbeddingShardDataset

        directory = getattr(self.recipe.data, split)
        if directory is None:
            return None
        dataset = EmbeddingShardDataset(directory, max_bad_fraction=self.recipe.data.max_bad_fraction,
                                        key=_shard_key(split))
        return dataset.tensors(self.recipe.data.eval_max_samples)

    def evaluate(self, model: nn.Module, data: dict[str, torch.Tensor] | None,
                 accelerator: "Accelerator", prepared: nn.Module | None = None) -> dict[str, float]:
        """Every rank generates the whole split (FSDP needs every rank in each forward); all get the same result."""
        from vembed.evaluation.similarity import evaluate_generation

        if not data:
            return {}
        flow = self.recipe.loss.flow
        metrics, self.last_image_cosines = evaluate_generation(
            model, data["eva"], data["clip"], sampler=flow.sampler, num_steps=flow.num_steps, seed=flow.eval_seed,
            batch_size=self.recipe.resolved_eval_batch_size, device=accelerator.device,
        )
        return metrics

    def headline(self, metrics: dict[str, float]) -> str:
        return "  ".join(f"{k}={metrics[k]:.3f}" for k in METRICS if k in metrics)

    def plots(self, metrics: dict[str, Any], output_dir: Path) -> list[Path]:
        from vembed.evaluation.similarity import plot_similarity_histogram

        # The loop evaluates validation, then test, at the end: the last evaluation is the split metrics report.
        cosines = getattr(self, "last_image_cosines", None)
        if cosines is not None and cosines.numel():
            split = "test" if metrics.get("test") else "validation"
            path = plot_similarity_histogram(cosines, output_dir / "similarity_histogram.png",
                                             title=f"{split}: {cosines.numel()} images, mean {cosines.mean():.3f}")
            return [Path(path)] if path is not None else []
        return []
