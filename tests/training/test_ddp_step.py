"""DDP exactness through the real training components: 2 gloo ranks vs one process on the concatenated batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ranks import run_on_ranks

from vembed.components import recipe_from_dict

GLOBAL_BATCH = 8  # 4 per rank


def _gradients(raw: dict, rows: list[int]) -> dict[str, torch.Tensor]:
    """One forward/backward of the prepared objective on `rows` of the training data; returns the gradients."""
    from vembed.training.loop import Trainer

    trainer = Trainer(recipe_from_dict(raw))
    trainer.build()
    examples = [trainer.dataset[i] for i in rows]
    batch = trainer.loader.collate_fn(examples)
    batch = {k: (v if not hasattr(v, "to") else v) for k, v in batch.items()}
    from accelerate.utils import send_to_device

    batch = send_to_device(batch, trainer.accelerator.device)
    loss = trainer.model(batch)
    trainer.accelerator.backward(loss)
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    return {n: p.grad.detach().clone() for n, p in unwrapped.named_parameters() if p.grad is not None}


def _ddp_worker(raw_path: str, out_dir: str) -> None:
    import torch.distributed as dist

    raw = json.loads(Path(raw_path).read_text())
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2
    half = GLOBAL_BATCH // world
    grads = _gradients(raw, list(range(rank * half, (rank + 1) * half)))
    if rank == 0:
        torch.save(grads, Path(out_dir, "ddp.pt"))


@pytest.mark.parametrize(
    "loss_settings",
    [
        {"loss_type": "infonce", "learnable_temperature": True, "symmetric_loss": True},
        {"loss_type": "siglip", "learnable_temperature": True, "temperature": 0.1},
        {"loss_type": "infonce", "mrl_dims": [16, 8]},
        {"loss_type": "infonce", "learnable_temperature": True, "compile": True},  # towers under torch.compile
    ],
    ids=["infonce", "siglip", "matryoshka", "compiled"],
)
def test_ddp_gradients_match_single_process_full_batch(tiny_clip_recipe, tmp_path, loss_settings):
    raw = dict(tiny_clip_recipe, batch_size=GLOBAL_BATCH // 2, **loss_settings)
    # Dropout would draw different masks in different process layouts; exactness is about the maths.
    for tower in ("text_config", "vision_config"):
        raw["model_config"] = {**raw["model_config"], tower: {**raw["model_config"][tower], "dropout": 0.0}}
    raw_path = tmp_path / "raw.json"
    raw_path.write_text(json.dumps(raw))

    run_on_ranks(_ddp_worker, str(raw_path), str(tmp_path), world=2)
    ddp = torch.load(tmp_path / "ddp.pt", weights_only=True)

    single = _gradients(dict(raw, batch_size=GLOBAL_BATCH), list(range(GLOBAL_BATCH)))
    assert ddp.keys() == single.keys()
    # Relative to the whole gradient: some tensors (e.g. attention key biases) have a gradient that is zero in theory,
    # so their own scale is rounding noise and a per-tensor ratio would compare noise with noise.
    reference = torch.cat([g.flatten() for g in single.values()])
    actual = torch.cat([ddp[name].flatten() for name in single])
    relative = ((actual - reference).norm() / reference.norm()).item()
    assert relative <= 1e-5, f"relative gradient difference {relative:.2e}"
    scale = reference.abs().max().item()
    for name, grad in single.items():
        worst = (ddp[name] - grad).abs().max().item() / scale
        assert worst <= 1e-5, f"{name}: max difference {worst:.2e} of the largest gradient entry"
    assert any("loss." in n for n in single) or loss_settings.get("learnable_temperature") is not True
    print(f"relative gradient difference: {relative:.2e}")
