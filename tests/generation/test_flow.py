"""The flow convention, the loss and the samplers against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from vembed.generation import FLOW_LOSSES
from vembed.generation.flow import (
    FlowMatchingLoss,
    clean_estimate,
    interpolate,
    sample_timesteps,
    velocity_target,
)
from vembed.generation.samplers import SAMPLERS, EulerSampler, HeunSampler
from vembed.losses import LOSSES

# One token with two channels: noise (1, -2), data (3, 4), t = 0.25.
NOISE = torch.tensor([[[1.0, -2.0]]])
DATA = torch.tensor([[[3.0, 4.0]]])
T = torch.tensor([0.25])


def test_interpolation_velocity_and_clean_estimate_by_hand():
    # x_t = 0.75 * (1, -2) + 0.25 * (3, 4) = (1.5, -0.5); v = data - noise = (2, 6)
    assert torch.equal(interpolate(NOISE, DATA, T), torch.tensor([[[1.5, -0.5]]]))
    assert torch.equal(velocity_target(NOISE, DATA), torch.tensor([[[2.0, 6.0]]]))
    x_t = interpolate(NOISE, DATA, T)
    # x_t + (1 - t) v = (1.5 + 0.75 * 2, -0.5 + 0.75 * 6) = (3, 4): the exact velocity recovers the data...
    assert torch.equal(clean_estimate(x_t, velocity_target(NOISE, DATA), T), DATA)
    # ... and a zero velocity leaves x_t where it is.
    assert torch.equal(clean_estimate(x_t, torch.zeros_like(x_t), T), x_t)


def test_the_ends_of_the_path_are_noise_and_data():
    assert torch.equal(interpolate(NOISE, DATA, torch.tensor([0.0])), NOISE)
    assert torch.equal(interpolate(NOISE, DATA, torch.tensor([1.0])), DATA)


def test_loss_is_velocity_mse_plus_weighted_cosine_of_the_clean_estimate():
    predicted = torch.tensor([[[3.0, 6.0]]])  # the target (2, 6) off by (1, 0)
    mse = (1.0**2 + 0.0**2) / 2
    assert FlowMatchingLoss()(predicted, NOISE, DATA, T).item() == pytest.approx(mse)
    # clean estimate: (1.5, -0.5) + 0.75 * (3, 6) = (3.75, 4.0); cosine with (3, 4) by hand
    cosine = (3.75 * 3 + 4.0 * 4) / (math.hypot(3.75, 4.0) * 5.0)
    loss = FlowMatchingLoss(cosine_weight=0.5)(predicted, NOISE, DATA, T)
    assert loss.item() == pytest.approx(mse + 0.5 * (1 - cosine), rel=1e-6)


def test_perfect_prediction_has_zero_loss_with_the_cosine_term():
    noise, data, t = torch.randn(3, 5, 4), torch.randn(3, 5, 4), torch.rand(3)
    loss = FlowMatchingLoss(cosine_weight=1.0)(velocity_target(noise, data), noise, data, t)
    assert loss.item() == pytest.approx(0.0, abs=1e-6)


def test_loss_is_registered_and_built_from_the_recipe():
    from vembed.components import recipe_from_dict

    recipe = recipe_from_dict({"loss_type": "flow_matching", "flow": {"cosine_weight": 0.3}})
    loss = FLOW_LOSSES.get("flow_matching").from_recipe(recipe)
    assert "flow_matching" not in LOSSES  # the embedding losses' registry holds embedding losses only
    assert isinstance(loss, FlowMatchingLoss) and loss.cosine_weight == 0.3


def _decay(x, t):  # dx/dt = -x + t
    return -x + t.view(-1, 1, 1)


def test_one_euler_and_one_heun_step_by_hand():
    x = torch.full((1, 1, 1), 2.0)
    # Euler, h = 0.5 from t = 0: 2 + 0.5 * (-2 + 0) = 1
    assert EulerSampler(2).step(_decay, x, 0.0, 0.5).item() == pytest.approx(1.0)
    # Heun: v0 = -2, x' = 1, v1 = -1 + 0.5 = -0.5, x = 2 + 0.25 * (-2 - 0.5) = 1.375
    assert HeunSampler(2).step(_decay, x, 0.0, 0.5).item() == pytest.approx(1.375)


def test_samplers_follow_a_straight_path_exactly():
    noise, data = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    for sampler in (EulerSampler(1), EulerSampler(7), HeunSampler(1), HeunSampler(3)):
        out = sampler.sample(lambda x, t: data - noise, noise)
        torch.testing.assert_close(out, data)


def test_heun_is_second_order_and_euler_first_order():
    # dx/dt = -x from x0 = 1: exact x(1) = e^-1.
    x0 = torch.ones(1, 1, 1)
    exact = math.exp(-1)

    def error(sampler):
        return abs(sampler.sample(lambda x, t: -x, x0).item() - exact)

    euler_ratio = error(EulerSampler(10)) / error(EulerSampler(20))
    heun_ratio = error(HeunSampler(10)) / error(HeunSampler(20))
    assert euler_ratio == pytest.approx(2.0, rel=0.1)
    assert heun_ratio == pytest.approx(4.0, rel=0.1)
    assert HeunSampler(10).function_evaluations == EulerSampler(20).function_evaluations == 20


def test_samplers_are_chosen_by_name():
    assert SAMPLERS.get("euler") is EulerSampler and SAMPLERS.get("heun") is HeunSampler


@pytest.mark.parametrize("kind, kwargs, mean", [
    ("uniform", {}, 0.5),
    ("logit_normal", {"logit_mean": 0.0, "logit_std": 1.0}, 0.5),
    ("beta", {"beta_a": 2.0, "beta_b": 5.0}, 2.0 / 7.0),
])
def test_timestep_sampling_is_reproducible_and_has_the_expected_mean(kind, kwargs, mean):
    first = sample_timesteps(20000, kind, generator=torch.Generator().manual_seed(3), **kwargs)
    again = sample_timesteps(20000, kind, generator=torch.Generator().manual_seed(3), **kwargs)
    assert torch.equal(first, again)
    assert first.min() >= 0 and first.max() <= 1
    assert first.mean().item() == pytest.approx(mean, abs=0.01)


def test_logit_normal_concentrates_in_the_middle():
    t = sample_timesteps(20000, "logit_normal", logit_std=0.5, generator=torch.Generator().manual_seed(0))
    middle = ((t > 0.25) & (t < 0.75)).float().mean().item()
    # P(|N(0, 0.5)| < logit(0.75) = ln 3) = erf(ln 3 / (0.5 * sqrt 2))
    assert middle == pytest.approx(math.erf(math.log(3) / (0.5 * math.sqrt(2))), abs=0.01)
