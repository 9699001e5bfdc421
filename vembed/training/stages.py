"""Curriculum stages: the recipe's `stages:` (or the recipe itself, as one stage) turned into what the loop runs.

Each stage trains the same model and optimizer state on its own data mix (named sources and weights), inputs
(max_length, image pixel budget), epochs or steps and peak learning rate. The learning rate follows the recipe's
scheduler_type and warmup_ratio within each stage; one `LambdaLR` over the global step holds the whole curriculum,
so the scheduler's state (its step count) is all a checkpoint needs to resume it exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from torch.optim.lr_scheduler import LambdaLR

from vembed.training.schedules import SHAPES

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from vembed.recipe import Recipe


@dataclass
class Stage:
    """One stage as run: what the recipe asks for, then (`plan`) its length in batches and optimizer steps."""

    index: int
    name: str
    epochs: int
    max_steps: int | None
    learning_rate: float  # peak, as in the recipe (before scale_lr_with_world_size)
    weights: dict[str, float] | None = None  # named source -> weight; None: by size
    only: list[str] | None = None  # the named sources this stage uses; None: all
    max_length: int | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    loader: Any = field(default=None, repr=False)  # its training DataLoader (prepared by the accelerator)
    batch_sampler: Any = field(default=None, repr=False)  # its SourceBatchSampler, when it has one
    batches_per_epoch: int = 0  # micro-batches per process
    steps_per_epoch: int = 0
    total_steps: int = 0
    num_epochs: int = 0
    first_step: int = 0  # global step at which the stage starts

    @property
    def end_step(self) -> int:
        return self.first_step + self.total_steps

    def plan(self, batches_per_epoch: int, accumulation: int, first_step: int) -> None:
        """The stage's length: its epochs in micro-batches per process and optimizer steps, from `first_step` (a
        stage plan, not the launch plan of launch_plan.py nor the memory plan of `vembed plan`)."""
        # accelerate also steps at the end of an epoch whose micro-batches do not fill the last accumulation.
        self.batches_per_epoch = batches_per_epoch
        self.steps_per_epoch = math.ceil(batches_per_epoch / accumulation)
        self.total_steps = self.max_steps or self.steps_per_epoch * self.epochs
        self.num_epochs = math.ceil(self.total_steps / self.steps_per_epoch)
        self.first_step = first_step


def stages_of(recipe: "Recipe") -> list[Stage]:
    """The stages to run: the recipe's `stages:`, each key unset taken from the recipe; or the recipe as one."""
    sources = recipe.data.sources("train") or {}
    recipe_weights = {name: s.weight for name, s in sources.items()} if any(
        s.weight is not None for s in sources.values()) else None
    # The adapter's own settings (max_length; min/max_pixels for qwen_vl): what a stage leaves unset.
    built = {key: getattr(recipe.model, key, None) for key in ("max_length", "min_pixels", "max_pixels")}
    if not recipe.stages:
        return [Stage(0, "train", recipe.epochs, recipe.max_steps, recipe.learning_rate, weights=recipe_weights,
                      **built)]
    stages = []
    for index, config in enumerate(recipe.stages):
        weights, only = recipe_weights, None
        if isinstance(config.sources, dict):
            weights = {name: weight for name, weight in config.sources.items() if weight > 0}
            only = list(weights)
        elif isinstance(config.sources, list):
            weights, only = None, list(config.sources)
        stages.append(Stage(
            index, config.name or f"stage-{index + 1}",
            config.epochs or recipe.epochs,
            config.max_steps if config.max_steps is not None else (recipe.max_steps if not config.epochs else None),
            config.learning_rate or recipe.learning_rate,
            weights=weights, only=only,
            max_length=config.max_length or built["max_length"],
            min_pixels=config.min_pixels or built["min_pixels"],
            max_pixels=config.max_pixels or built["max_pixels"],
        ))
    return stages


def planned_stages(recipe: "Recipe", dataset: Any, collate: Any, num_processes: int) -> list[Stage]:
    """The stages to run, each with its (unprepared) training loader and its length planned, in batches per process
    and optimizer steps, from the step where the previous one ends: the last one's `end_step` is the run's total."""
    from vembed.training.train_loader import batches_per_epoch, train_loader

    stages = stages_of(recipe)
    first_step = 0
    for stage in stages:
        stage.loader, stage.batch_sampler = train_loader(dataset, collate, recipe, num_processes, stage)
        stage.plan(batches_per_epoch(stage.loader, len(dataset), recipe, num_processes),
                   recipe.gradient_accumulation_steps, first_step)
        first_step = stage.end_step
    return stages


def staged_scheduler(optimizer: "Optimizer", stages: list[Stage], scheduler_type: str, warmup_ratio: float,
                     base_learning_rate: float) -> LambdaLR:
    """One `LambdaLR` over the whole curriculum: in stage k, `stage lr / base lr × shape(step - first step of k)`,
    the shape (warm-up, then cosine/linear/constant) spanning the stage's own steps. The factor is a `partial` of
    plain numbers: LambdaLR saves no state for it, so a checkpoint restores the schedule from the step alone."""
    spans = tuple((stage.first_step, stage.total_steps, stage.learning_rate / base_learning_rate,
                   int(warmup_ratio * stage.total_steps)) for stage in stages)
    return LambdaLR(optimizer, partial(_staged_factor, spans=spans, shape=scheduler_type))


def _staged_factor(step: int, *, spans: tuple[tuple[int, int, float, int], ...], shape: str) -> float:
    first, total, scale, warmup = spans[0]
    for span in spans:
        if step >= span[0]:
            first, total, scale, warmup = span
    return scale * SHAPES[shape](step - first, warmup=warmup, total=total)
