"""The training DataLoader of one stage, and how many batches each process takes from it per epoch.

Which sampler draws the batches is decided here: named sources (one source per step, the same on every rank),
data.no_duplicates or data.m_per_class take a batch sampler; else the plain per-epoch shuffle with whole batches only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vembed.errors import DataError

if TYPE_CHECKING:
    from vembed.recipe import Recipe
    from vembed.training.stages import Stage


def train_loader(dataset: Any, collate: Any, recipe: "Recipe", num_processes: int, stage: "Stage") -> tuple[Any, Any]:
    """The (unprepared) training DataLoader of `stage`, and its batch sampler when it needs one: named sources
    (one source per step, the same on every rank) or data.no_duplicates; else the plain per-epoch shuffle."""
    from torch.utils.data import DataLoader

    from vembed.data.sampler import EpochShuffleSampler, build_batch_sampler

    if recipe.data.m_per_class:  # labelled images (the tasks that declare class_balanced_batches)
        batch_sampler = class_balanced_sampler(dataset, recipe, num_processes)
    else:
        batch_sampler = build_batch_sampler(dataset, recipe.batch_size, num_processes, recipe.seed,
                                            stage=stage.index, weights=stage.weights, only=stage.only,
                                            no_duplicates=recipe.data.no_duplicates)
    common = dict(collate_fn=collate, num_workers=recipe.data.num_workers,
                  persistent_workers=recipe.data.num_workers > 0,  # not re-forked (model and all) every epoch
                  pin_memory=torch.cuda.is_available(),
                  # Its own generator: starting an iterator draws the workers' base seed, from the global RNG
                  # without one, and a resumed run starts one more (to skip batches) after restoring that RNG,
                  # which shifted every dropout mask after a resume.
                  generator=torch.Generator().manual_seed(recipe.seed))
    if batch_sampler is not None:
        return DataLoader(dataset, batch_sampler=batch_sampler, **common), batch_sampler
    sampler = EpochShuffleSampler(len(dataset), seed=recipe.seed, tags_epochs=getattr(dataset, "tags_epochs", False))
    # drop_last: every rank must gather equally many embeddings
    return DataLoader(dataset, batch_size=recipe.batch_size, sampler=sampler, drop_last=True, **common), None


def class_balanced_sampler(dataset: Any, recipe: "Recipe", num_processes: int) -> Any:
    """`data.m_per_class` batches over the dataset's class labels, checked against this launch's global batch."""
    from vembed.data.sampler import MPerClassBatchSampler

    sampler = MPerClassBatchSampler(dataset.class_labels(), recipe.data.m_per_class, recipe.batch_size, num_processes,
                                    recipe.seed, tags_epochs=getattr(dataset, "tags_epochs", False))
    sampler.check(file=str(recipe.data.train), names=getattr(dataset, "class_names", None))
    return sampler


def batches_per_process(num_batches: int, num_processes: int) -> int:
    """Batches each process iterates per epoch once accelerate shards a drop_last loader of `num_batches`: whole
    rounds only (each rank takes every num_processes-th batch; an incomplete last round is dropped so every rank
    gathers equally many embeddings)."""
    return num_batches // num_processes


def batches_per_epoch(loader: Any, num_records: int, recipe: "Recipe", num_processes: int) -> int:
    """`batches_per_process` of an unprepared loader; a split too small for one batch on every process is a
    DataError."""
    batches = batches_per_process(len(loader), num_processes)
    if batches == 0:
        raise DataError(
            f"{num_records} training records cannot fill one batch of {recipe.batch_size} on "
            f"{num_processes} process(es); lower batch_size or add data",
            file=str(recipe.data.train),
        )
    return batches
