"""Rectified flow matching: the one time convention, timestep sampling, and the velocity loss.

THE CONVENTION (used by training here and by every sampler in `vembed.generation.samplers`):
- t = 0 is pure noise, t = 1 is data.
- x_t = (1 - t) * noise + t * data                 (a straight line from noise to data)
- the velocity target is v = dx_t/dt = data - noise
- the clean estimate from a predicted velocity v̂ is  data_hat = x_t + (1 - t) * v̂
  (the seed code subtracted here; with this convention data_hat = data exactly when v̂ = v)
- sampling integrates dx/dt = v̂(x, t) from t = 0 (noise) to t = 1 (data).

No data-dependent normalisation: an optional fixed `scale` multiplies the data before the flow and divides the
generated result, so a model never depends on statistics of its training set.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from vembed.generation import FLOW_LOSSES
from vembed.recipe import Settings

if TYPE_CHECKING:
    from vembed.recipe import Recipe

TimeSampling = Literal["uniform", "logit_normal", "beta"]


class FlowSection(Settings):
    """`flow:` rectified flow matching (loss_type: flow_matching): t=0 noise, t=1 data, v = data - noise."""

    time_sampling: Literal["uniform", "logit_normal", "beta"] = "uniform"  # training time distribution on [0, 1]
    logit_normal_mean: float = 0.0  # logit_normal: t = sigmoid(N(mean, std))
    logit_normal_std: float = Field(default=1.0, gt=0)
    beta_a: float = Field(default=1.0, gt=0)  # beta: t ~ Beta(a, b)
    beta_b: float = Field(default=1.0, gt=0)
    cosine_weight: float = Field(default=0.0, ge=0)  # weight of (1 - cos) between the clean estimate and the data
    data_scale: float = Field(default=1.0, gt=0)  # fixed multiplier of the CLIP tokens (no data statistics)
    sampler: Literal["euler", "heun"] = "heun"  # ODE solver used by evaluation
    num_steps: int = Field(default=50, gt=0)  # solver steps (heun evaluates the model twice per step)
    eval_seed: int = 0  # seed of the evaluation noise: generation is deterministic given it


class FlowMatchingSettings(Settings):
    flow: FlowSection = Field(default_factory=FlowSection)  # time sampling, loss terms, sampler: see FlowSection


def _bcast(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B,) times → (B, 1, ..., 1) so they broadcast over a (B, N, D) tensor."""
    return t.reshape(-1, *([1] * (like.ndim - 1))).to(like.dtype)


def interpolate(noise: torch.Tensor, data: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t = (1 - t) noise + t data."""
    tb = _bcast(t, data)
    return (1 - tb) * noise + tb * data


def velocity_target(noise: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """v = data - noise (constant along each straight path)."""
    return data - noise


def clean_estimate(x_t: torch.Tensor, velocity: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """data_hat = x_t + (1 - t) v̂: follow the predicted velocity for the time left until t = 1."""
    return x_t + (1 - _bcast(t, x_t)) * velocity


def sample_timesteps(
    n: int,
    kind: TimeSampling = "uniform",
    *,
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    beta_a: float = 1.0,
    beta_b: float = 1.0,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """n training times in [0, 1]: uniform, logit-normal (sigmoid of N(mean, std)), or Beta(a, b)."""
    if kind == "uniform":
        t = torch.rand(n, generator=generator)
    elif kind == "logit_normal":
        t = torch.sigmoid(logit_mean + logit_std * torch.randn(n, generator=generator))
    elif kind == "beta":
        # torch's Beta takes no generator: draw under a forked RNG seeded from ours, so the draw is reproducible
        # and the global RNG is left as it was.
        seed = int(torch.randint(0, 2**62, (1,), generator=generator).item())
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            t = torch.distributions.Beta(torch.tensor(float(beta_a)), torch.tensor(float(beta_b))).sample((n,))
    else:
        raise ValueError(f"unknown time sampling {kind!r}; use uniform, logit_normal or beta")
    return t.to(device) if device is not None else t


@FLOW_LOSSES.register("flow_matching")
class FlowMatchingLoss(nn.Module):
    """MSE between predicted and target velocity, plus an optional cosine term on the clean estimate.

    `forward(predicted_velocity, noise, data, t)`: `predicted_velocity`, `noise`, `data` are (B, N, D) (data already
    multiplied by the fixed scale), `t` is (B,). Returns a scalar:
        mean((v̂ - (data - noise))²) + cosine_weight * mean_tokens(1 - cos(data_hat, data))
    with data_hat = x_t + (1 - t) v̂ (see the module docstring for the convention).

    >>> loss = FlowMatchingLoss(cosine_weight=0.1)
    >>> noise, data, t = torch.randn(2, 4, 8), torch.randn(2, 4, 8), torch.rand(2)
    >>> loss(data - noise, noise, data, t)   # a perfect prediction
    tensor(0.)
    """

    task = "flow_matching"  # trains models whose task is flow matching (vembed.tasks)
    Settings: ClassVar[type[FlowMatchingSettings]] = FlowMatchingSettings

    def __init__(self, cosine_weight: float = 0.0):
        super().__init__()
        self.cosine_weight = float(cosine_weight)

    @classmethod
    def from_recipe(cls, recipe: "Recipe") -> "FlowMatchingLoss":
        return cls(cosine_weight=recipe.loss.flow.cosine_weight)

    def forward(
        self, predicted_velocity: torch.Tensor, noise: torch.Tensor, data: torch.Tensor, t: torch.Tensor
    ) -> torch.Tensor:
        predicted_velocity = predicted_velocity.float()
        noise, data = noise.float(), data.float()
        loss = F.mse_loss(predicted_velocity, velocity_target(noise, data))
        if self.cosine_weight > 0:
            estimate = clean_estimate(interpolate(noise, data, t), predicted_velocity, t)
            loss = loss + self.cosine_weight * (1 - F.cosine_similarity(estimate, data, dim=-1)).mean()
        return loss

    @property
    def config(self) -> dict[str, Any]:
        return {"name": type(self).__name__, "cosine_weight": self.cosine_weight,
                "convention": "t=0 noise, t=1 data, x_t=(1-t)noise+t*data, v=data-noise"}
