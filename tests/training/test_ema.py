"""ema_decay (vembed/training/ema.py): the average follows every optimizer step as timm's model EMA does; final/ and
the run's evaluation are the average; a resumed run ends with the average of the whole run; sharded launches refuse
it in one line."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from training_digits import digits_recipe as recipe
from training_digits import write_digit_splits

DECAY = 0.6  # far from 1, so a few steps move the average visibly away from the weights


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    return write_digit_splits(tmp_path_factory.mktemp("digits"))


def test_the_average_is_the_exponential_average_of_the_trainable_weights_and_is_lent_and_given_back():
    from vembed.training.ema import WeightAverage

    module = nn.Linear(2, 1)
    module.bias.requires_grad_(False)
    with torch.no_grad():
        module.weight.copy_(torch.tensor([[1.0, 2.0]]))
    average = WeightAverage(module, decay=0.5)
    assert set(average.average) == {"weight"}  # a frozen tensor is not averaged
    for value in ([3.0, 2.0], [5.0, 6.0]):
        with torch.no_grad():
            module.weight.copy_(torch.tensor([value]))
        average.update(module)
    # (1, 2) -> 0.5 (1, 2) + 0.5 (3, 2) = (2, 2) -> 0.5 (2, 2) + 0.5 (5, 6) = (3.5, 4)
    assert torch.equal(average.average["weight"], torch.tensor([[3.5, 4.0]])) and average.updates == 2
    with average.lent_to(module):
        assert torch.equal(module.weight, torch.tensor([[3.5, 4.0]]))
    assert torch.equal(module.weight, torch.tensor([[5.0, 6.0]]))
    again = WeightAverage(module, decay=0.5)
    again.load_state_dict(average.state_dict())
    assert torch.equal(again.average["weight"], average.average["weight"]) and again.updates == 2
    module.bias.requires_grad_(True)  # another model: a checkpoint of the first does not fit it
    with pytest.raises(ValueError, match=r"differ in parameters \(bias\)"):
        WeightAverage(module, decay=0.5).load_state_dict(average.state_dict())


def _adapter_weights(trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.objective.adapter.named_parameters() if p.requires_grad}


def test_final_and_its_evaluation_are_the_average_of_the_steps_the_run_took(digits, tmp_path, monkeypatch):
    """The run without EMA takes the same steps (the average never feeds back into training): its weights after each
    step, averaged by hand, are what the EMA run saves in final/ and evaluates."""
    from vembed.components import recipe_from_dict
    from vembed.models import load_adapter
    from vembed.training.loop import Trainer

    steps: list[dict[str, torch.Tensor]] = []
    take_step = Trainer.train_on_batch

    def recording(self, batch, state):
        loss = take_step(self, batch, state)
        steps.append(_adapter_weights(self))
        return loss

    plain = Trainer(recipe_from_dict(recipe(digits, tmp_path / "plain", max_steps=4)))
    plain.build()
    expected = {name: value.float() for name, value in _adapter_weights(plain).items()}
    monkeypatch.setattr(Trainer, "train_on_batch", recording)
    plain.run()
    monkeypatch.undo()
    assert len(steps) == 4
    for weights in steps:
        for name, value in weights.items():
            expected[name] = DECAY * expected[name] + (1 - DECAY) * value.float()

    averaged = Trainer(recipe_from_dict(recipe(digits, tmp_path / "ema", max_steps=4, ema_decay=DECAY)))
    result = averaged.run()
    saved = dict(load_adapter(tmp_path / "ema" / "final").named_parameters())
    for name, value in expected.items():
        torch.testing.assert_close(saved[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.equal(saved["classifier.weight"], steps[-1]["classifier.weight"])  # not the last step's
    from test_classification import saved_model_metrics  # the saved final/ classifying the validation split

    again = saved_model_metrics(tmp_path / "ema", digits)
    metrics = json.loads((tmp_path / "ema" / "metrics.json").read_text())["validation"]
    assert again["confusion_matrix"] == metrics["confusion_matrix"] == result.metrics["validation"]["confusion_matrix"]
    assert again["nll"] == pytest.approx(metrics["nll"], abs=1e-6)


def test_a_resumed_run_ends_with_the_average_of_the_whole_run(digits, tmp_path):
    from interrupts import stop_after_checkpoint

    from vembed.components import recipe_from_dict
    from vembed.models import load_adapter
    from vembed.training.loop import Trainer

    raw = recipe(digits, tmp_path / "whole", max_steps=6, save_steps=3, ema_decay=DECAY)
    Trainer(recipe_from_dict(raw)).run()
    interrupted = dict(raw, output_dir=str(tmp_path / "interrupted"))
    stop_after_checkpoint(lambda: Trainer(recipe_from_dict(interrupted)).run(), 3)
    Trainer(recipe_from_dict(dict(interrupted, resume_from="auto"))).run()
    whole = dict(load_adapter(tmp_path / "whole" / "final").named_parameters())
    resumed = dict(load_adapter(tmp_path / "interrupted" / "final").named_parameters())
    for name, value in whole.items():
        assert torch.equal(resumed[name], value), name


@pytest.mark.parametrize("kind", ["fsdp", "deepspeed"])
def test_a_sharded_launch_refuses_the_average_in_one_line(digits, tmp_path, kind):
    from vembed import recipe_checks
    from vembed.components import recipe_from_dict
    from vembed.errors import RecipeError
    from vembed.training.launch_promise import LaunchPromise

    parsed = recipe_from_dict(recipe(digits, tmp_path / "run", ema_decay=0.999))
    with pytest.raises(RecipeError) as refused:
        recipe_checks.check_launch(parsed, kind, on_cpu=True, promise=LaunchPromise("python run.py", None))
    assert refused.value.key == "ema_decay" and f"this {kind} launch shards them" in str(refused.value)
    assert "\n" not in str(refused.value)


@pytest.mark.slow
def test_a_ddp_launch_averages_as_one_process_on_the_whole_batch(digits, tmp_path):
    """`accelerate launch` on 2 gloo ranks (6 images each) with ema_decay: final/ (the average) and its evaluation
    are those of one process on the 12 images of each global batch."""
    from launching import final_weights, max_relative_difference, one_process_and_launched

    raw = recipe(digits, tmp_path / "unused", batch_size=12, ema_decay=DECAY, eval_before_training=True)
    single, launched = one_process_and_launched(raw, tmp_path, "ddp_cpu.yaml", steps=4)
    assert max_relative_difference(final_weights(launched), final_weights(single)) <= 1e-4
    plain = recipe(digits, tmp_path / "unused", batch_size=12)
    _, without = one_process_and_launched(plain, tmp_path / "plain", "ddp_cpu.yaml", steps=4)
    assert _relative_norm(final_weights(without), final_weights(single)) > 1e-3  # the average, not the last step
    ours, reference = (json.loads((out / "metrics.json").read_text()) for out in (launched, single))
    assert ours["train"]["world_size"] == 2
    for when in ("before", "validation"):
        assert ours[when]["confusion_matrix"] == reference[when]["confusion_matrix"], when
        assert ours[when]["nll"] == pytest.approx(reference[when]["nll"], abs=1e-5), when


def _relative_norm(actual: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    whole = torch.cat([value.float().flatten() for value in reference.values()])
    got = torch.cat([actual[name].float().flatten() for name in reference])
    return ((got - whole).norm() / whole.norm()).item()
