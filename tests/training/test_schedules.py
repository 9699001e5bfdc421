"""vembed's schedules equal transformers' get_scheduler step for step (they replace it only to keep peft's import
out of start-up)."""

from __future__ import annotations

import pytest
import torch

from vembed.training.schedules import get_scheduler


@pytest.mark.parametrize("name", ["cosine", "linear", "constant"])
@pytest.mark.parametrize("warmup, total", [(0, 10), (3, 17)])
def test_schedules_match_transformers(name, warmup, total):
    import transformers

    def learning_rates(make):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        scheduler = make(name, optimizer, num_warmup_steps=warmup, num_training_steps=total)
        rates = []
        for _ in range(total + 2):
            rates.append(scheduler.get_last_lr()[0])
            optimizer.step()
            scheduler.step()
        return rates, scheduler.state_dict()

    ours, state = learning_rates(get_scheduler)
    theirs, _ = learning_rates(transformers.get_scheduler)
    assert ours == pytest.approx(theirs, abs=1e-12)
    assert state["last_epoch"] == total + 2  # resumable like any LambdaLR


def test_unknown_schedule_is_refused():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match="cosine, linear, constant"):
        get_scheduler("cosin", optimizer, num_warmup_steps=0, num_training_steps=3)
