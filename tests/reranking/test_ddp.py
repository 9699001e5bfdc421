"""DDP exactness of the rerank task: 2 gloo ranks, each on half of the lists, give the gradients of one process on
all of them, for every ranking loss, with lists of different lengths (ranks hold different numbers of pairs)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from ranks import run_on_ranks

from vembed.components import recipe_from_dict

LOSSES = ("rerank_bce", "rerank_listwise", "lambdaloss")
GLOBAL_BATCH = 6  # 3 lists per rank


def _write_uneven_lists(path: Path) -> Path:
    from rerank_lists import WORDS

    rng = random.Random(1)
    rows = []
    for i in range(GLOBAL_BATCH):
        length = [2, 5, 3, 4, 2, 6][i]
        documents = [" ".join(rng.choices(WORDS, k=rng.randint(2, 6))) for _ in range(length)]
        labels = [float(rng.choice([0, 1, 2])) for _ in range(length)]
        labels[0] = 2.0  # a relevant document in every list
        rows.append({"query": f"a photo of a {WORDS[i]}", "documents": documents, "labels": labels})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _gradients(raw: dict, rows: list[int]) -> dict[str, torch.Tensor]:
    from accelerate.utils import send_to_device

    from vembed.training.loop import Trainer

    trainer = Trainer(recipe_from_dict(raw))
    trainer.build()
    batch = send_to_device(trainer.loader.collate_fn([trainer.dataset[i] for i in rows]), trainer.accelerator.device)
    trainer.accelerator.backward(trainer.model(batch))
    return {n: p.grad.detach().clone() for n, p in trainer.objective.named_parameters() if p.grad is not None}


def _ddp_worker(raw_path: str, out_dir: str, losses: tuple[str, ...] = LOSSES) -> None:
    import torch.distributed as dist

    rank, half = dist.get_rank(), GLOBAL_BATCH // 2
    for loss in losses:
        raw = dict(json.loads(Path(raw_path).read_text()), loss_type=loss)
        grads = _gradients(raw, list(range(rank * half, (rank + 1) * half)))
        if rank == 0:
            torch.save(grads, Path(out_dir, f"{loss}.pt"))


def test_two_ranks_give_the_gradients_of_one_process(rerank_recipe, tmp_path):
    train = _write_uneven_lists(tmp_path / "uneven.jsonl")
    # A wide initialisation spreads the logits: near-equal scores would make the gradients (softmax minus target)
    # tiny, so rounding noise, and LambdaLoss's ranking of near-ties depend on the last bit.
    model_config = dict(rerank_recipe["model_config"], initializer_range=0.5)
    raw = dict(rerank_recipe, batch_size=GLOBAL_BATCH // 2, data={"train": str(train)}, pairs_per_chunk=4,
               model_config=model_config)
    _check_ranks_against_one_process(raw, tmp_path, LOSSES)


def test_two_ranks_give_the_gradients_of_one_process_for_the_qwen_vl_reranker(qwen_rerank_recipe, tmp_path):
    """The same with the Qwen-VL reranker on lists of text and image documents (one loss: the exactness is the
    task's, the model only has to be deterministic under DDP)."""
    from rerank_lists import write_image_lists

    train = write_image_lists(tmp_path / "data" / "lists.jsonl", count=GLOBAL_BATCH)
    model_config = dict(qwen_rerank_recipe["model_config"], initializer_range=0.2)
    raw = dict(qwen_rerank_recipe, batch_size=GLOBAL_BATCH // 2, data={"train": str(train)}, pairs_per_chunk=4,
               model_config=model_config)
    _check_ranks_against_one_process(raw, tmp_path, ("lambdaloss",))


def _check_ranks_against_one_process(raw: dict, tmp_path: Path, losses: tuple[str, ...]) -> None:
    raw_path = tmp_path / "raw.json"
    raw_path.write_text(json.dumps(raw))
    run_on_ranks(_ddp_worker, str(raw_path), str(tmp_path), losses, world=2)
    for loss in losses:
        ddp = torch.load(tmp_path / f"{loss}.pt", weights_only=True)
        single = _gradients(dict(raw, loss_type=loss, batch_size=GLOBAL_BATCH), list(range(GLOBAL_BATCH)))
        assert ddp.keys() == single.keys() and len(single) > 10
        reference = torch.cat([g.flatten() for g in single.values()])
        actual = torch.cat([ddp[name].flatten() for name in single])
        relative = ((actual - reference).norm() / reference.norm()).item()
        assert relative <= 1e-5, f"{loss}: relative gradient difference {relative:.2e}"
