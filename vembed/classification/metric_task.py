"""Image retrieval by metric learning: model_type vision without a head, its embeddings trained by a loss on labelled
embeddings (loss_type supcon / ntxent / subcenter_arcface, vembed/classification/metric_losses.py) over labelled images
(vembed/classification/labelled.py; positives are images of the same class), measured by leave-one-out image-to-image
retrieval within a held-out split: precision@1, recall@k, MAP@R (vembed/classification/metric_evaluation.py).

A held-out split's classes need not be the training ones (the CUB-200 / Cars-196 / SOP protocol holds out whole
classes): its labels are only compared with each other.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from vembed.classification.task import (
    ClassificationCollator,
    LabelledImageDataset,
    check_class_balance,
    read_split,
    with_image_cache,
)
from vembed.errors import DataError, RecipeError
from vembed.tasks import TASKS, Task

if TYPE_CHECKING:
    from accelerate import Accelerator

    from vembed.classification.labelled import LabelledImages
    from vembed.recipe import AugmentationConfig, Recipe


class MetricLearningObjective(nn.Module):
    """The adapter (backbone, pooling, projection) and the loss in one module. `forward(batch)`: the loss of
    `{"inputs": preprocessed images, "labels": (B,)}`; `forward(embed=inputs)`: the embeddings (evaluation goes
    through the prepared wrapper, so ZeRO-3 gathers the weights as in training)."""

    adapter_methods = ("encode",)  # what forward calls on the adapter besides its forward (FSDP2 hooks them)

    def __init__(self, adapter: nn.Module, loss: nn.Module):
        super().__init__()
        self.adapter = adapter
        self.loss = loss

    def forward(self, batch: dict[str, Any] | None = None, embed: dict[str, torch.Tensor] | None = None):
        if embed is not None:
            return self.adapter.encode(embed)
        return self.loss(self.adapter.encode(batch["inputs"]), batch["labels"])


class RowsOfImages(LabelledImageDataset):
    """`((epoch, row), image, row)`: the row id is the label when the positives are views of one image (rows are
    distinct across ranks, so a view's positive is never another rank's image)."""

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[tuple[int, int], Any, int]:
        epoch, index = key if isinstance(key, tuple) else (0, key)
        return (epoch, index), self.data.image(index), index


class ViewsCollator:
    """`views` views of each item, one after the other, labelled by the row: each view's positives are the other views
    of its image. With `augmentation`, view v of row i in an epoch is cropped/flipped by its own draws (seed, epoch,
    i x views + v), so the views differ and resume replays them; without, they are the same pixels."""

    def __init__(self, adapter: nn.Module, views: int, augmentation: "AugmentationConfig | None" = None,
                 seed: int = 0):
        self.adapter, self.views, self.seed = adapter, views, seed
        self.augmentation = augmentation if augmentation is not None and augmentation.enabled else None

    def __call__(self, items: list[tuple[tuple[int, int], Any, int]]) -> dict[str, Any]:
        from vembed.data.records import Side

        if self.augmentation is None:
            images = [path for _, path, _ in items for _ in range(self.views)]
        else:
            from vembed.classification.augment import augment_image, sample_rng
            from vembed.data.images import load_image

            images = [augment_image(load_image(path), self.augmentation,
                                    sample_rng(self.seed, epoch, index * self.views + view))
                      for (epoch, index), path, _ in items for view in range(self.views)]
        return {"inputs": self.adapter.preprocess([Side(image=image) for image in images]),
                "labels": torch.tensor([row for _, _, row in items for _ in range(self.views)], dtype=torch.long)}


def check_positives(data: "LabelledImages", loss_type: str) -> None:
    """A pair-based loss learns from two images of a class: a class with one image has no positive."""
    lone = sorted(label for label, count in Counter(data.labels).items() if count < 2)
    if lone:
        names = ", ".join(repr(data.names[label]) for label in lone[:5]) + (", ..." if len(lone) > 5 else "")
        raise DataError(f"{len(lone)} class(es) have a single image ({names}); loss_type {loss_type} needs two or "
                        "more images of every class (positives are images of the same class): add images, drop "
                        "those classes, or use loss_type subcenter_arcface", file=data.source)


@TASKS.register("metric_learning")
class MetricLearningTask(Task):
    name = "metric_learning"
    batch_wide_loss = True  # pairs and triplets over the batch gathered from every rank (metric_losses.py)
    augments_images = True  # crops and flips; mixup/cutmix mix labels, which these losses do not take
    class_balanced_batches = True  # data.m_per_class: each record has a class
    no_gradient_cache = ("is not used by metric learning (it trains embeddings, with no classification head); "
                         "remove it")

    @classmethod
    def check_recipe(cls, recipe: "Recipe", *, for_training: bool = True) -> None:
        from vembed.classification.metric_evaluation import METRICS
        from vembed.classification.metric_losses import require_library
        from vembed.components import loss_class

        data = recipe.data
        for key in ("mixup_alpha", "cutmix_alpha"):
            if getattr(recipe.augmentation, key):
                raise RecipeError(f"augmentation.{key}", "mixes two images' labels, which metric-learning losses do "
                                                         "not take; remove it (crops and flips apply)")
        if data.streaming:
            raise RecipeError("data.streaming", "metric learning reads its labelled images whole; "
                                                "remove it")
        for split in ("train", "validation", "test"):
            value = getattr(data, split)
            query_gallery = split != "train" and isinstance(value, dict) and set(value) == set(QUERY_GALLERY)
            if isinstance(value, list) or (isinstance(value, dict) and not query_gallery):
                raise RecipeError(f"data.{split}", "metric learning takes one ImageFolder directory, CSV/JSONL "
                                                   "file or `datasets` folder/Parquet file per split"
                                                   + ("" if split == "train" else ", or a query set and a gallery: "
                                                      "{query: ..., gallery: ...}"))
            if query_gallery and any(not isinstance(value[part].files, str) for part in QUERY_GALLERY):
                raise RecipeError(f"data.{split}", "query and gallery each take one ImageFolder directory, CSV/JSONL "
                                                   "file or `datasets` folder/Parquet file")
        for key, value in (("stages", recipe.stages), ("num_labels", recipe.model.num_labels),
                           ("head_init", recipe.model.head_init != "random")):
            if value:
                raise RecipeError(key, "is not used by metric learning (it trains embeddings, with no "
                                       "classification head); remove it")
        if recipe.metric_for_best_model not in METRICS:
            raise RecipeError("metric_for_best_model",
                              f"{recipe.metric_for_best_model!r} is not a retrieval metric of labelled images; use "
                              f"one of: {', '.join(METRICS)}")
        require_library(recipe.loss_type)
        loss_class(recipe).check_recipe(recipe)
        frozen = getattr(recipe.model, "freeze_backbone", False)
        if frozen and recipe.model.projection_dim is None and not loss_class(recipe).proxies_of(recipe.loss):
            raise RecipeError("freeze_backbone", "leaves nothing to train: the embedding is the backbone's output; "
                                                 "set projection_dim (a trained projection on the frozen backbone)")
        if data.train is not None:
            train = read_split(recipe, "train", None)
            declared = getattr(recipe.loss, "num_classes", None)
            if declared is not None and declared != len(train.names):
                raise RecipeError("num_classes", f"is {declared} but {data.train} has {len(train.names)} classes; "
                                                 f"set num_classes: {len(train.names)} or remove it")
            loss = loss_class(recipe)
            if data.m_per_class and loss.views_per_image(recipe.loss) > 1:
                raise RecipeError("data.m_per_class", "balances classes, but with positives: views each image is its "
                                                      "own class; remove one of them")
            check_class_balance(train, recipe)
            if loss.positives_needed(recipe.loss) and loss.views_per_image(recipe.loss) == 1:
                check_positives(train, recipe.loss_type)
            for split in ("validation", "test"):
                if getattr(data, split) is not None:
                    read_held_out(recipe, split)

    def load_train_data(self) -> "LabelledImages":
        self.train_data = read_split(self.recipe, "train", None)
        return self.train_data

    def build_objective(self) -> nn.Module:
        from vembed.components import loss_class

        recipe = self.recipe
        adapter = self.build_adapter()
        loss = loss_class(recipe).from_recipe(recipe, num_classes=len(self.train_data.names),
                                              embedding_dim=adapter.embedding_dim)
        loss.class_names = list(self.train_data.names)  # saved with a loss's class centres: their names, by id
        return MetricLearningObjective(adapter, loss)

    def batch_lines(self, world_size: int) -> list[tuple[str, str]]:
        from vembed.data.image_cache import cache_line

        return super().batch_lines(world_size) + cache_line(self.train_data.cache)

    def train_dataset(self, objective: nn.Module):
        from vembed.components import loss_class

        views = loss_class(self.recipe).views_per_image(self.recipe.loss)
        recipe = self.recipe
        with_image_cache(self.train_data, objective.adapter, recipe)
        if views == 1:
            return (LabelledImageDataset(self.train_data),
                    ClassificationCollator(objective.adapter, recipe.augmentation, recipe.seed))
        return RowsOfImages(self.train_data), ViewsCollator(objective.adapter, views, recipe.augmentation, recipe.seed)

    def held_out_images(self, data: "LabelledImages | QueryGallery | None") -> list[Any]:
        if isinstance(data, QueryGallery):
            return self.held_out_images(data.query) + self.held_out_images(data.gallery)
        return [data.image(i) for i in range(len(data))] if data else []

    def load_eval_split(self, split: str) -> "LabelledImages | QueryGallery | None":
        if getattr(self.recipe.data, split) is None:
            return None
        return read_held_out(self.recipe, split).head(self.recipe.data.eval_max_samples)

    def evaluate(self, model: nn.Module, data: "LabelledImages | QueryGallery | None", accelerator: "Accelerator",
                 prepared: nn.Module | None = None) -> dict[str, Any]:
        """Every rank embeds the whole split (ZeRO-3 needs every rank in each forward); all get the same metrics."""
        from vembed.classification.metric_evaluation import retrieval_metrics

        if not data:
            return {}
        size = self.recipe.resolved_eval_batch_size
        if isinstance(data, QueryGallery):
            queries = embed_images(model, data.query, accelerator, size, prepared)
            gallery = embed_images(model, data.gallery, accelerator, size, prepared)
            return retrieval_metrics(queries.numpy(), np.asarray(data.query.labels),
                                     reference_embeddings=gallery.numpy(),
                                     reference_labels=np.asarray(data.gallery.labels))
        embeddings = embed_images(model, data, accelerator, size, prepared)
        return retrieval_metrics(embeddings.numpy(), torch.tensor(data.labels).numpy())

    def headline(self, metrics: dict[str, Any]) -> str:
        return "  ".join(f"{k}={metrics[k]:.4f}" for k in ("recall_at_1", "recall_at_4", "mean_average_precision_at_r")
                         if k in metrics)


# A held-out split given as {query: ..., gallery: ...}: each query image is searched in the gallery (In-Shop style).
QUERY_GALLERY = ("query", "gallery")


@dataclass
class QueryGallery:
    """A held-out split of two sets, their labels mapped onto one list of class names."""

    query: "LabelledImages"
    gallery: "LabelledImages"

    def __bool__(self) -> bool:
        return bool(self.query) and bool(self.gallery)

    def head(self, limit: int | None) -> "QueryGallery":
        return QueryGallery(self.query.head(limit), self.gallery.head(limit))


def read_held_out(recipe: "Recipe", split: str) -> "LabelledImages | QueryGallery":
    """A held-out split: one set searched leave-one-out, or a query set and a gallery, whose class names are matched
    by name (each set's ids are its own until then)."""
    from dataclasses import replace

    from vembed.classification.labelled import read_labelled_images

    value, data = getattr(recipe.data, split), recipe.data
    if not isinstance(value, dict):
        return read_split(recipe, split, None)
    parts = {part: read_labelled_images(value[part].files, f"data.{split}.{part}", label_column=data.columns.label,
                                        image_root=value[part].image_root or data.image_root,
                                        max_bad_fraction=data.max_bad_fraction) for part in QUERY_GALLERY}
    names = sorted({name for part in parts.values() for name in part.names})
    ids = {name: i for i, name in enumerate(names)}
    mapped = {key: replace(part, names=names, labels=[ids[part.names[label]] for label in part.labels])
              for key, part in parts.items()}
    return QueryGallery(mapped["query"], mapped["gallery"])


def embed_images(model: nn.Module, data: "LabelledImages", accelerator: "Accelerator", batch_size: int,
                 prepared: nn.Module | None = None) -> torch.Tensor:
    """The adapter's embeddings of every image of `data`, (n, d) float32 on the CPU, in data order."""
    forward = (lambda inputs: prepared(embed=inputs)) if prepared is not None else model.encode
    collate = ClassificationCollator(model)
    dataset = LabelledImageDataset(data)
    was_training = model.training
    model.eval()
    parts = []
    with torch.no_grad(), accelerator.autocast():
        for start in range(0, len(dataset), batch_size):
            batch = collate([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))])
            inputs = {k: v.to(accelerator.device) for k, v in batch["inputs"].items()}
            parts.append(forward(inputs).float().cpu())
    model.train(was_training)
    return torch.cat(parts)
