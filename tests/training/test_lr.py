"""scale_lr_with_world_size: the optimizer's learning rate is learning_rate × processes, said once; off by default."""

from __future__ import annotations

import pytest

from vembed.components import recipe_from_dict
from vembed.training.lr import learning_rate_for, scaled_learning_rate


@pytest.mark.parametrize("processes", [1, 2, 8])
def test_scaling_multiplies_by_the_number_of_processes(processes):
    assert scaled_learning_rate(1e-4, processes, True) == pytest.approx(1e-4 * processes)
    assert scaled_learning_rate(1e-4, processes, False) == 1e-4


def test_scaling_is_off_by_default_and_logs_nothing():
    recipe = recipe_from_dict({"learning_rate": 1e-4})
    said: list[str] = []
    assert recipe.scale_lr_with_world_size is False
    assert learning_rate_for(recipe, 4, log=said.append) == 1e-4
    assert said == []


def test_scaled_rate_is_logged_once_with_both_numbers():
    recipe = recipe_from_dict({"learning_rate": 1e-4, "scale_lr_with_world_size": True})
    said: list[str] = []
    assert learning_rate_for(recipe, 2, log=said.append) == pytest.approx(2e-4)
    assert said == ["learning rate 1e-4 × 2 processes = 2e-4 (scale_lr_with_world_size)"]


def test_zero_processes_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        scaled_learning_rate(1e-4, 0, True)


def test_three_processes_message_keeps_the_mantissa():
    recipe = recipe_from_dict({"learning_rate": 5e-5, "scale_lr_with_world_size": True})
    said: list[str] = []
    learning_rate_for(recipe, 3, log=said.append)
    assert said == ["learning rate 5e-5 × 3 processes = 1.5e-4 (scale_lr_with_world_size)"]
