"""`compile: true`: the adapter's encoder towers run under torch.compile and the step is the eager step (same loss and
gradients to 1e-5, dropout off), plain, under GradCache and with LoRA; the start block says so; launches where it is
not verified (FSDP, DeepSpeed) are refused by the launch plan, naming the key, before any weight is read."""

from __future__ import annotations

import pytest
import torch

from vembed.components import recipe_from_dict
from vembed.errors import RecipeError

ROWS = list(range(8))


@pytest.fixture
def no_dropout(tiny_clip_recipe) -> dict:
    from tiny_models import TINY_CLIP_CONFIG

    config = {**TINY_CLIP_CONFIG, **{side: {**TINY_CLIP_CONFIG[side], "dropout": 0.0, "attention_dropout": 0.0}
                                     for side in ("text_config", "vision_config")}}
    return dict(tiny_clip_recipe, model_config=config, learnable_temperature=True)


def _step(raw: dict) -> tuple[dict[str, torch.Tensor], float, object]:
    from accelerate.utils import send_to_device

    from vembed.training.loop import Trainer

    trainer = Trainer(recipe_from_dict(raw))
    trainer.build()
    batch = send_to_device(trainer.loader.collate_fn([trainer.dataset[i] for i in ROWS]), trainer.accelerator.device)
    loss = trainer.train_step(batch)
    objective = trainer.accelerator.unwrap_model(trainer.model)
    grads = {n: p.grad.detach().clone() for n, p in objective.named_parameters() if p.grad is not None}
    return grads, loss.item(), trainer


def _relative(actual: dict, reference: dict) -> float:
    assert actual.keys() == reference.keys()
    ref = torch.cat([g.flatten() for g in reference.values()])
    got = torch.cat([actual[n].flatten() for n in reference])
    return ((got - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("changes", [
    {}, {"use_gradient_cache": True, "gradient_cache_chunk_size": 4},
    {"use_lora": True, "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0},
], ids=["plain", "gradcache", "lora"])
def test_a_compiled_step_gives_the_eager_step(no_dropout, changes, tmp_path):
    import torch._dynamo

    eager, eager_loss, _ = _step(dict(no_dropout, **changes, output_dir=str(tmp_path / "eager")))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled, compiled_loss, trainer = _step(dict(no_dropout, **changes, compile=True,
                                                  output_dir=str(tmp_path / "compiled")))
    adapter = trainer.objective.adapter
    assert all(module._compiled_call_impl is not None for module in adapter.compiled_modules())
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2, "no tower was compiled"
    assert abs(compiled_loss - eager_loss) <= 1e-5 * abs(eager_loss)
    assert _relative(compiled, eager) <= 1e-5


def test_the_start_block_says_compile_is_on(no_dropout):
    from vembed.training.loop import Trainer
    from vembed.training.start_block import describe_launch

    def block(raw: dict) -> str:
        trainer = Trainer(recipe_from_dict(raw))
        return describe_launch(trainer.plan, trainer.accelerator, trainer.recipe, 1, 1, [])

    assert "compile             on: torch.compile" in block(dict(no_dropout, compile=True))
    assert "compile" not in block(no_dropout)


def test_a_run_resumes_with_compile_switched(no_dropout):
    """compile changes how the towers run, not what they compute: it is not part of the run's identity."""
    from vembed.training.run_dir import run_identity

    assert run_identity(recipe_from_dict(dict(no_dropout, compile=True))) == run_identity(recipe_from_dict(no_dropout))


def test_compiled_towers_save_the_eager_state_dict(no_dropout):
    from vembed.models.clip import ClipAdapter

    adapter = ClipAdapter.from_recipe(recipe_from_dict(no_dropout))
    before = set(adapter.state_dict())
    adapter.compile_towers()
    assert set(adapter.state_dict()) == before  # no `_orig_mod.` prefixes: checkpoints and final/ load either way


FSDP_LAUNCH = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "WORLD_SIZE": "2"}
ZERO2_LAUNCH = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2", "WORLD_SIZE": "2"}


@pytest.mark.parametrize("launch, changes, says", [
    (FSDP_LAUNCH, {}, "not available under FSDP"),
    (ZERO2_LAUNCH, {}, "not available under DeepSpeed"),
], ids=["fsdp", "deepspeed"])
def test_compile_is_refused_by_the_plan_where_it_is_not_verified(no_dropout, monkeypatch, launch, changes, says):
    from vembed.models.clip import ClipAdapter
    from vembed.training.launch_plan import decide_launch

    for name in ("ACCELERATE_USE_FSDP", "VEMBED_FSDP", "ACCELERATE_USE_DEEPSPEED", "WORLD_SIZE",
                 "VEMBED_EXPECTED_WORLD_SIZE", "VEMBED_LAUNCHER", "ACCELERATE_DEEPSPEED_CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("vembed.training.launch_promise._parent_accelerate_launch_arguments", lambda: None)
    for name, value in launch.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(ClipAdapter, "from_recipe", classmethod(lambda cls, recipe: pytest.fail("model built")))
    with pytest.raises(RecipeError, match=says) as info:
        decide_launch(recipe_from_dict(dict(no_dropout, compile=True, **changes)))
    assert info.value.key == "compile" and "\n" not in str(info.value)


def test_compile_without_a_cpu_compiler_is_one_clear_refusal(no_dropout, monkeypatch):
    from vembed.training.launch_plan import decide_launch

    monkeypatch.setenv("CXX", "no-such-compiler++")
    monkeypatch.setattr("vembed.training.launch_plan._cuda_available", lambda: False)
    with pytest.raises(RecipeError, match="no C\\+\\+ compiler") as info:
        decide_launch(recipe_from_dict(dict(no_dropout, compile=True)))
    assert info.value.key == "compile"


def test_an_unknown_key_near_compile_gets_a_hint(no_dropout):
    with pytest.raises(RecipeError, match="compile"):
        recipe_from_dict(dict(no_dropout, compiled=True))
