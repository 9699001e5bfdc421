"""The learning rate a run actually uses: the recipe's, optionally scaled linearly with the number of processes."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vembed.recipe import Recipe


def scaled_learning_rate(learning_rate: float, num_processes: int, scale_with_world_size: bool) -> float:
    """`learning_rate × num_processes` when scaling is on (the linear scaling rule), else `learning_rate`."""
    if num_processes < 1:
        raise ValueError(f"num_processes must be at least 1, got {num_processes}")
    return learning_rate * num_processes if scale_with_world_size else learning_rate


def learning_rate_for(recipe: "Recipe", num_processes: int, log: Callable[[str], None] | None = None) -> float:
    """The optimizer's learning rate for this launch; when it differs from the recipe's, says so once via `log`
    (the loop passes `accelerator.print`, which prints on the main process only)."""
    lr = scaled_learning_rate(recipe.learning_rate, num_processes, recipe.scale_lr_with_world_size)
    if recipe.scale_lr_with_world_size and log is not None:
        processes = f"{num_processes} process{'es' if num_processes != 1 else ''}"
        log(f"learning rate {_short(recipe.learning_rate)} × {processes} = {_short(lr)} (scale_lr_with_world_size)")
    return lr


def _short(value: float) -> str:
    """1e-4 rather than 0.0001 or 1.000000e-04: how learning rates are written in recipes."""
    mantissa, exponent = f"{value:e}".split("e")
    mantissa = mantissa.rstrip("0").rstrip(".")
    return f"{mantissa}e{int(exponent)}"
