"""Learning-rate schedules (the recipe's `scheduler_type`), equal step for step to transformers' `get_scheduler`.

Why not `transformers.get_scheduler`: its module imports `transformers.trainer_utils`, which imports all of peft —
2 to 5 s of a run's start-up on a 2-core machine for three one-line formulas. A test holds these to transformers'.
"""

from __future__ import annotations

import math
from functools import partial

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def _warmup(step: int, warmup: int) -> float:
    return float(step) / float(max(1, warmup))


def _cosine(step: int, *, warmup: int, total: int) -> float:
    """Linear warm-up, then half a cosine from the learning rate to 0."""
    if step < warmup:
        return _warmup(step, warmup)
    progress = float(step - warmup) / float(max(1, total - warmup))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def _linear(step: int, *, warmup: int, total: int) -> float:
    """Linear warm-up, then a straight line from the learning rate to 0."""
    if step < warmup:
        return _warmup(step, warmup)
    return max(0.0, float(total - step) / float(max(1, total - warmup)))


def _constant(step: int, **_: int) -> float:
    # As transformers' "constant": no warm-up, whatever warmup_ratio says.
    return 1.0


SHAPES = {"cosine": _cosine, "linear": _linear, "constant": _constant}  # step -> factor of the peak learning rate


def get_scheduler(name: str, optimizer: Optimizer, *, num_warmup_steps: int, num_training_steps: int) -> LambdaLR:
    if name == "constant":
        return LambdaLR(optimizer, _constant)
    shapes = {"cosine": _cosine, "linear": _linear}
    if name not in shapes:
        raise ValueError(f"unknown scheduler_type {name!r}; use {', '.join([*shapes, 'constant'])}")
    return LambdaLR(optimizer, partial(shapes[name], warmup=num_warmup_steps, total=num_training_steps))
