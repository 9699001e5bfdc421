"""FSDP on 2 CPU ranks: one training step of the DiT, each DiT block sharded, equals one process on the whole batch,
and the gathered full state dict loads on a single device.

Sharded by the same code every FSDP launch runs (`vembed.training.fsdp.shard_objective`: the blocks
`Blip3oDiT.block_classes()` names, then the model, then the objective) and exported through the same collective
gather as the final model of a sharded run.
"""

from __future__ import annotations

from pathlib import Path

import torch
from ranks import run_on_ranks

from vembed.generation.dit import Blip3oDiT, DiTConfig

CONFIG = dict(eva_dim=12, clip_dim=8, num_tokens=4, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2,
              eva_adapter_layers=2, mlp_ratio=2.0)
BATCH = 8  # 4 per rank


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"eva": torch.randn(BATCH, 4, 12, generator=g), "clip": torch.randn(BATCH, 4, 8, generator=g),
            "noise": torch.randn(BATCH, 4, 8, generator=g), "t": torch.rand(BATCH, generator=g)}


def _objective():
    from vembed.components import recipe_from_dict
    from vembed.generation.flow import FlowMatchingLoss
    from vembed.generation.task import FlowMatchingObjective

    torch.manual_seed(0)
    model = Blip3oDiT(DiTConfig(**CONFIG))
    with torch.no_grad():  # move off the zero initialisation so every parameter gets a gradient
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    recipe = recipe_from_dict({"model_type": "blip3o_dit", "loss_type": "flow_matching"})
    return FlowMatchingObjective(model, FlowMatchingLoss(cosine_weight=0.5), recipe)


def _step(objective, batch) -> None:
    # Plain SGD: the update is proportional to the gradient, so a summed-instead-of-averaged gradient would show
    # (Adam's first step is nearly sign(gradient) and would hide it).
    optimizer = torch.optim.SGD(objective.parameters(), lr=0.5)
    objective(batch).backward()
    optimizer.step()


def _fsdp_worker(out_dir: str) -> None:
    import torch.distributed as dist
    from accelerate import Accelerator

    from vembed.components import recipe_from_dict
    from vembed.training.fsdp import FsdpSettings, shard_objective
    from vembed.training.sharded_state import gather_full_state_dict

    rank = dist.get_rank()
    accelerator = Accelerator(cpu=True)
    assert accelerator.num_processes == 2
    objective = _objective()
    recipe = recipe_from_dict({"model_type": "blip3o_dit", "loss_type": "flow_matching"})
    shard_objective(objective, recipe, accelerator, FsdpSettings(reshard_after_forward=True, offload=False))
    assert type(objective).__name__.startswith("FSDP")
    half = BATCH // 2
    _step(objective, {k: v[rank * half : (rank + 1) * half] for k, v in _batch().items()})
    full = gather_full_state_dict(accelerator, objective)  # every rank takes part
    if rank == 0:
        exported = Blip3oDiT(DiTConfig(**CONFIG))
        exported.load_state_dict({k.removeprefix("adapter."): v for k, v in full.items() if k.startswith("adapter.")})
        exported.save(Path(out_dir) / "fsdp")


def test_fsdp_step_matches_one_process_and_the_export_loads_single_device(tmp_path):
    from vembed.generation import load_generator

    single = _objective()
    _step(single, _batch())
    run_on_ranks(_fsdp_worker, str(tmp_path), world=2)

    loaded = load_generator(tmp_path / "fsdp")
    expected = dict(single.adapter.named_parameters())
    got = dict(loaded.named_parameters())
    assert got.keys() == expected.keys()
    for name, param in expected.items():
        torch.testing.assert_close(got[name], param.detach(), rtol=0, atol=1e-5, msg=name)
    # The step moved the weights (so the comparison is not between two untouched copies).
    assert not torch.allclose(_objective().adapter.out_proj.weight, loaded.out_proj.weight)
    batch = _batch()
    with torch.no_grad():
        torch.testing.assert_close(loaded(batch["noise"], batch["t"], batch["eva"]),
                                   single.adapter(batch["noise"], batch["t"], batch["eva"]), rtol=0, atol=1e-5)
