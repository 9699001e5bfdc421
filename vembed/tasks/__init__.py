"""Tasks: what a model is trained to do and how it is measured, chosen by the model's `task` through a registry.

A task gives the one training loop everything that differs between, say, contrastive retrieval and flow matching:
the recipe checks, the objective module (model + loss in one `nn.Module`, so strategies wrap both), the training
dataset and its collation, whether every step reaches every parameter (DDP's unused-parameter search), evaluation
(metrics dict and a one-line headline) and plots. Checkpointing, resuming, logging and launches stay in the loop.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from vembed.errors import RecipeError
from vembed.registry import Registry

if TYPE_CHECKING:
    from collections.abc import Callable

    from accelerate import Accelerator
    from torch import nn
    from torch.utils.data import Dataset

    from vembed.recipe import Recipe
    from vembed.training.stages import Stage

TASKS: Registry[type["Task"]] = Registry(
    "task", modules=("vembed.tasks.contrastive", "vembed.generation.task", "vembed.reranking.task",
                     "vembed.classification.task", "vembed.classification.metric_task")
)


class Task:
    """The contract. One instance per training run; the loop calls the methods in the order listed."""

    name: ClassVar[str]
    # The task's loss can be computed on detached embeddings of chunked forwards (vembed/training/grad_cache.py).
    uses_gradient_cache: ClassVar[bool] = False
    # Why GradCache is refused when asked for under this task (None: its loss is per sample).
    no_gradient_cache: ClassVar[str | None] = None
    # The task's training collation reads `augmentation:` (vembed/classification/augment.py).
    augments_images: ClassVar[bool] = False
    # Its training data has a class per record, so batches can be class-balanced (data.m_per_class).
    class_balanced_batches: ClassVar[bool] = False
    # Its loss scores the gathered global batch against itself (a batch x batch matrix): `vembed plan` counts it.
    batch_wide_loss: ClassVar[bool] = False
    # What `vembed plan` calls the global batch.
    plan_batch: ClassVar[str] = "global"

    def __init__(self, recipe: "Recipe"):
        self.recipe = recipe

    @classmethod
    def check_gradient_cache(cls, recipe: "Recipe") -> None:
        """The one rule for asking GradCache of a task without a batch-wide loss (stage 3 of vembed/recipe_checks.py,
        and `vembed plan` through `planning.choose_gradient_cache`): refused, saying why (`no_gradient_cache`)."""
        if recipe.use_gradient_cache and not cls.uses_gradient_cache:
            raise RecipeError("use_gradient_cache", cls.no_gradient_cache or (
                f"the {cls.name} task's loss is per sample, so GradCache has nothing to cache; remove the key"))

    @classmethod
    def check_recipe(cls, recipe: "Recipe", *, for_training: bool = True) -> None:
        """Checks that need the file system or the model's config, before anything is built (stage 4 of
        `vembed.recipe_checks`, which lists every rule)."""

    def load_train_data(self) -> Any:
        """Read the training data (before the accelerator exists); returns a report with `summary()`,
        `to_dict()` and `num_skipped`."""
        raise NotImplementedError

    def every_step_uses_every_parameter(self) -> bool:
        """False when some batches leave parameters without gradients (DDP must then search for them)."""
        return True

    def batch_lines(self, world_size: int) -> list[tuple[str, str]]:
        """(label, value) lines for the start block on what one optimizer step sees."""
        recipe = self.recipe
        return [("global batch", f"{recipe.batch_size * world_size} per forward, "
                                 f"{recipe.batch_size * world_size * recipe.gradient_accumulation_steps} per "
                                 "optimizer step")]

    def build_objective(self) -> "nn.Module":
        """Model and loss in one module with `.adapter` (what is saved) and `.loss` (with a `config`)."""
        raise NotImplementedError

    def build_adapter(self) -> "nn.Module":
        """The recipe's model as every task trains it: built by its registry, with gradient checkpointing and LoRA
        where the recipe asks (one home, so a task cannot forget either)."""
        from vembed.components import model_class

        recipe = self.recipe
        adapter = model_class(recipe).from_recipe(recipe)
        if recipe.gradient_checkpointing:
            adapter.enable_gradient_checkpointing()
        if recipe.use_lora:
            adapter.apply_lora(recipe)
        return adapter

    def train_dataset(self, objective: "nn.Module") -> tuple["Dataset", "Callable"]:
        """The training dataset and its collate function: map-style (the loop's sampler shuffles and shards it), or
        a `vembed.data.streaming.ShardStream` (streamed; it shards, shuffles and collates itself)."""
        raise NotImplementedError

    def enter_stage(self, objective: "nn.Module", stage: "Stage") -> None:
        """Apply a curriculum stage's inputs to the model (tokens per text, image size) before its first batch."""

    def learning_rate_scales(self, objective: "nn.Module") -> "dict[nn.Parameter, float]":
        """Parameters of `objective` trained at their own rate, as multiples of the learning rate; none by default."""
        return {}

    def begin_step(self, objective: "nn.Module", step: int, total_steps: int) -> None:
        """Before each optimizer step's batches (`step` steps done of `total_steps`, restored on resume): what follows
        the step count besides the learning rate (a loss's schedule)."""

    def load_eval_split(self, split: str) -> Any:
        """Held-out data for `split` ("validation"/"test"), or something empty when the recipe has none."""
        raise NotImplementedError

    def held_out_images(self, data: Any) -> list[Any]:
        """The images (paths, or PIL images of a table) that evaluating on `data`, what `load_eval_split` gave, decodes:
        decoded once before training (`vembed.data.images.check_images_decode`). None where evaluation reads none."""
        return []

    def load_held_out(self) -> tuple[Any, Any]:
        """The validation and test data, every image they name decoded once: a bad one stops the launch here, before
        a weight is read or the output folder is taken, not at an evaluation after final/ is written."""
        from vembed.data.images import check_images_decode

        splits = {split: self.load_eval_split(split) for split in ("validation", "test")}
        for split, data in splits.items():
            check_images_decode(self.held_out_images(data), f"data.{split}")
        return splits["validation"], splits["test"]

    def evaluate(self, model: "nn.Module", data: Any, accelerator: "Accelerator",
                 prepared: "nn.Module | None" = None) -> dict[str, float]:
        """Metrics of `model` (the adapter) on `data`. `prepared`: the objective as the launch wrapped it (DDP, FSDP's
        root, DeepSpeed's engine); forward passes through it gather sharded weights as in training."""
        raise NotImplementedError

    def headline(self, metrics: dict[str, float]) -> str:
        """The few metrics printed on one line."""
        raise NotImplementedError

    def split_report(self, split: str) -> dict[str, Any] | None:
        """What was read of a held-out split (rows read, kept, skipped, evaluated; per named source) once
        `load_eval_split` read it, for the model card; None when the task does not count it."""
        return None

    def plots(self, metrics: dict[str, Any], output_dir: Path) -> list[Path]:
        """PNGs of a finished run, from its metrics; the paths written."""
        return []


def task_name_for(recipe: "Recipe") -> str:
    """The model's task, checked against the loss's: a flow loss cannot train a contrastive model or back."""
    from vembed.components import CATALOG, loss_class, model_class

    def tasks_of(component: Any) -> tuple[str, ...]:
        # An adapter several tasks train lists them (`tasks`: the vision adapter, classification or metric learning);
        # the loss, which belongs to one task, then picks it.
        return tuple(getattr(component, "tasks", None) or (getattr(component, "task", "contrastive"),))

    model_tasks, (loss_task,) = tasks_of(model_class(recipe)), tasks_of(loss_class(recipe))
    if loss_task not in model_tasks:
        fitting = [n for n in CATALOG.names("loss_type") if tasks_of(CATALOG.component("loss_type", n))[0]
                   in model_tasks]
        raise RecipeError(
            "loss_type",
            f"{recipe.loss_type!r} is a {loss_task} loss but model_type {recipe.model_type!r} is trained by "
            f"{' or '.join(model_tasks)}; use loss_type {' or '.join(fitting)}",
        )
    return loss_task


def task_for(recipe: "Recipe") -> type[Task]:
    return TASKS.get(task_name_for(recipe))


__all__ = ["TASKS", "Task", "task_for", "task_name_for"]
