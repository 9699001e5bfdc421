"""FSDP2 on 2 CPU ranks for the image tasks: one training step of the classification and the metric-learning objective
(tiny ViT, each ViT layer sharded by the code every FSDP launch runs) equals one process on the whole batch.

These objectives call the adapter's `classify` / `encode`, not its `forward`, where FSDP2 gathers a unit's weights:
without `adapter_methods` the ViT's last norm and the head stayed sharded and the forward failed ("mixed torch.Tensor
and DTensor", found by `vembed bench strategies` on the ViT recipe).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ranks import run_on_ranks

VIT = {"model_type": "vit", "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2,
       "num_attention_heads": 4, "image_size": 32, "patch_size": 8, "qkv_bias": False,
       "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
RECIPES = {"classification": {"loss_type": "cross_entropy", "num_labels": 3},
           "metric_learning": {"loss_type": "supcon"}}
BATCH = 8  # 4 per rank


def _objective(task: str):
    from vembed.classification.metric_task import MetricLearningObjective
    from vembed.classification.task import ClassificationObjective
    from vembed.components import loss_class, recipe_from_dict
    from vembed.tasks import task_for

    recipe = recipe_from_dict({"model_type": "vision", "model_config": VIT, "seed": 0, **RECIPES[task]})
    torch.manual_seed(0)
    adapter = task_for(recipe)(recipe).build_adapter()
    if task == "classification":
        return ClassificationObjective(adapter, loss_class(recipe).from_recipe(recipe)), recipe
    loss = loss_class(recipe).from_recipe(recipe, num_classes=3, embedding_dim=adapter.embedding_dim)
    return MetricLearningObjective(adapter, loss), recipe


def _batch() -> dict:
    from vembed.models.batch import PIXEL_VALUES

    g = torch.Generator().manual_seed(3)
    return {"inputs": {PIXEL_VALUES: torch.randn(BATCH, 3, 32, 32, generator=g)},
            "labels": torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])}


def _half(batch: dict, rank: int) -> dict:
    rows = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
    return {"inputs": {k: v[rows] for k, v in batch["inputs"].items()}, "labels": batch["labels"][rows]}


def _step(objective, batch: dict) -> None:
    # Plain SGD: the update is proportional to the gradient, so a summed-instead-of-averaged gradient would show.
    optimizer = torch.optim.SGD([p for p in objective.parameters() if p.requires_grad], lr=0.5)
    objective(batch).backward()
    optimizer.step()


def _fsdp_worker(task: str, out_dir: str) -> None:
    import torch.distributed as dist
    from accelerate import Accelerator

    from vembed.training.fsdp import FsdpSettings, shard_objective
    from vembed.training.sharded_state import gather_full_state_dict

    rank = dist.get_rank()
    accelerator = Accelerator(cpu=True)
    objective, recipe = _objective(task)
    shard_objective(objective, recipe, accelerator, FsdpSettings(reshard_after_forward=True, offload=False))
    _step(objective, _half(_batch(), rank))
    with torch.no_grad():  # evaluation's path: the objective's forward with the images alone
        keyword = "classify" if task == "classification" else "embed"
        outputs = objective(**{keyword: _half(_batch(), rank)["inputs"]})
    full = gather_full_state_dict(accelerator, objective)  # every rank takes part
    torch.save({"outputs": outputs, "state": full if rank == 0 else None}, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.parametrize("task", sorted(RECIPES))
def test_fsdp_step_of_an_image_task_equals_one_process_on_the_whole_batch(tmp_path, task):
    single, _ = _objective(task)
    before = {name: p.detach().clone() for name, p in single.named_parameters()}
    _step(single, _batch())
    run_on_ranks(_fsdp_worker, task, str(tmp_path), world=2)

    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    got = ranks[0]["state"]
    for name, param in single.named_parameters():
        torch.testing.assert_close(got[name], param.detach(), rtol=0, atol=1e-5, msg=name)
    assert any(not torch.equal(before[n], p) for n, p in single.named_parameters())  # the step moved the weights
    with torch.no_grad():
        keyword = "classify" if task == "classification" else "embed"
        expected = single(**{keyword: _batch()["inputs"]})
    torch.testing.assert_close(torch.cat([r["outputs"] for r in ranks]), expected, rtol=0, atol=1e-5)
