"""ODE samplers for the flow convention of `vembed.generation.flow` (t = 0 noise → t = 1 data), by name.

A velocity function is `velocity(x, t) -> v̂` with `x` (B, N, D) and `t` (B,). Samplers start from Gaussian noise
drawn from a generator seeded by the caller, so generation is deterministic given a seed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vembed.registry import Registry

Velocity = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

SAMPLERS: Registry[type["Sampler"]] = Registry("flow.sampler")


class Sampler:
    """Integrates dx/dt = v̂(x, t) over `num_steps` equal steps from t = 0 to t = 1."""

    def __init__(self, num_steps: int):
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self.num_steps = num_steps

    @property
    def function_evaluations(self) -> int:
        """Model evaluations per sample (the cost to compare samplers by)."""
        return self.num_steps

    def step(self, velocity: Velocity, x: torch.Tensor, t: float, h: float) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def sample(self, velocity: Velocity, noise: torch.Tensor) -> torch.Tensor:
        x = noise
        h = 1.0 / self.num_steps
        for i in range(self.num_steps):
            x = self.step(velocity, x, i * h, h)
        return x


def _times(x: torch.Tensor, t: float) -> torch.Tensor:
    return torch.full((x.shape[0],), t, device=x.device, dtype=torch.float32)


@SAMPLERS.register("euler")
class EulerSampler(Sampler):
    """x ← x + h v̂(x, t): one function evaluation per step."""

    def step(self, velocity: Velocity, x: torch.Tensor, t: float, h: float) -> torch.Tensor:
        return x + h * velocity(x, _times(x, t))


@SAMPLERS.register("heun")
class HeunSampler(Sampler):
    """Heun's method (explicit trapezoid): predict with Euler, correct with the mean of the two slopes.

    Two evaluations per step, the second at t + h, t = 1 included. (Ending on an Euler step instead, as EDM does,
    was measured worse on our tiny teacher pair: the last, largest-error step then dominates; see docs/notes.md.)
    """

    @property
    def function_evaluations(self) -> int:
        return 2 * self.num_steps

    def step(self, velocity: Velocity, x: torch.Tensor, t: float, h: float) -> torch.Tensor:
        v0 = velocity(x, _times(x, t))
        predicted = x + h * v0
        v1 = velocity(predicted, _times(x, t + h))
        return x + 0.5 * h * (v0 + v1)


def build_sampler(name: str, num_steps: int) -> Sampler:
    return SAMPLERS.get(name)(num_steps)

