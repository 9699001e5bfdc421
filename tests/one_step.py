"""One training step of a recipe on chosen rows, and the relative difference of two gradient sets: what the tests
comparing two ways of computing the same step (length chunks, packing) share."""

from __future__ import annotations

import torch

from vembed.components import recipe_from_dict


def one_step(raw: dict, rows: list[int], seed: int | None = None) -> tuple[dict[str, torch.Tensor], float,
                                                                           torch.Tensor]:
    """(parameter gradients, loss, the query side's embeddings before the step) of one train_step on `rows`; `seed`
    seeds the step's random draws (dropout) when given."""
    from accelerate.utils import send_to_device

    from vembed.training.loop import Trainer

    trainer = Trainer(recipe_from_dict(raw))
    trainer.build()
    batch = send_to_device(trainer.loader.collate_fn([trainer.dataset[i] for i in rows]), trainer.accelerator.device)
    objective = trainer.accelerator.unwrap_model(trainer.model)
    with torch.no_grad():
        query = objective.encode_side(batch["query"]).clone()
    if seed is not None:
        torch.manual_seed(seed)
    loss = trainer.train_step(batch)
    grads = {n: p.grad.detach().clone() for n, p in objective.named_parameters() if p.grad is not None}
    return grads, loss.item(), query


def relative_difference(actual: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """‖actual − reference‖ / ‖reference‖ over every gradient, the same parameters on both sides."""
    assert actual.keys() == reference.keys()
    ref = torch.cat([g.flatten() for g in reference.values()])
    got = torch.cat([actual[n].flatten() for n in reference])
    return ((got - ref).norm() / ref.norm()).item()


def _rank_step(raw_path: str, out_dir: str, batch: int, seed: int | None) -> None:
    import json
    from pathlib import Path

    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    share = batch // world
    grads, _, _ = one_step(json.loads(Path(raw_path).read_text()), list(range(rank * share, (rank + 1) * share)), seed)
    if rank == 0:
        torch.save({n: g.cpu() for n, g in grads.items()}, Path(out_dir) / "ddp.pt")


def two_rank_gradients(raw: dict, folder, batch: int, seed: int | None = None) -> dict[str, torch.Tensor]:
    """Rank 0's gradients after one step of 2 gloo ranks, each on its half of rows 0..batch-1 (`raw`'s batch_size
    is the per-rank batch); written to and read from `folder`."""
    import json
    from pathlib import Path

    from ranks import run_on_ranks

    raw_path = Path(folder) / "raw.json"
    raw_path.write_text(json.dumps(raw))
    run_on_ranks(_rank_step, str(raw_path), str(folder), batch, seed, world=2)
    return torch.load(Path(folder) / "ddp.pt", weights_only=True)
