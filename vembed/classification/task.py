"""Image classification: model_type vision with its linear head, trained by cross-entropy (loss_type cross_entropy) on
labelled images (vembed/classification/labelled.py), measured by accuracy, per-class precision/recall/F1 and the
confusion matrix (vembed/classification/evaluation.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import Dataset

from vembed.errors import RecipeError
from vembed.tasks import TASKS, Task

if TYPE_CHECKING:
    from accelerate import Accelerator

    from vembed.classification.labelled import LabelledImages
    from vembed.recipe import AugmentationConfig, Recipe

METRICS = ("accuracy", "top5_accuracy", "macro_f1", "micro_f1", "macro_precision", "macro_recall")
CONFUSION_PNG = "confusion_matrix.png"
RELIABILITY_PNG = "reliability.png"  # the held-out split's calibration: accuracy per confidence bin


class ClassificationObjective(nn.Module):
    """The adapter (backbone, pooling, head) and the loss in one module. `forward(batch)`: the loss of
    `{"inputs": preprocessed images, "labels": (B,)}`; `forward(classify=inputs)`: the logits (evaluation goes
    through the prepared wrapper, so ZeRO-3 gathers the weights as in training)."""

    adapter_methods = ("classify",)  # what forward calls on the adapter besides its forward (FSDP2 hooks them)

    def __init__(self, adapter: nn.Module, loss: nn.Module):
        super().__init__()
        self.adapter = adapter
        self.loss = loss

    def forward(self, batch: dict[str, Any] | None = None, classify: dict[str, torch.Tensor] | None = None):
        if classify is not None:
            return self.adapter.classify(classify)
        return self.loss(self.adapter.classify(batch["inputs"]), batch["labels"])


def check_class_balance(data: "LabelledImages", recipe: "Recipe") -> None:
    """data.m_per_class against the labelled images: each class has m images, and there are classes enough for one
    process's batch (the launch checks the global batch once its size is known)."""
    if recipe.data.m_per_class:
        from vembed.data.sampler import MPerClassBatchSampler

        sampler = MPerClassBatchSampler(data.labels, recipe.data.m_per_class, recipe.batch_size, 1)
        sampler.check(file=data.source, names=list(data.names))


class LabelledImageDataset(Dataset):
    """`dataset[i]` or `dataset[(epoch, i)]` -> `((epoch, i), image, label)` (a path, a lazily opened image or cached
    pixels: `LabelledImages.image`): the key is what the training
    collator seeds sample i's augmentation with (the training sampler yields epoch-tagged indices for it:
    `tags_epochs`)."""

    tags_epochs = True

    def __init__(self, data: "LabelledImages"):
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[tuple[int, int], Any, int]:
        epoch, index = key if isinstance(key, tuple) else (0, key)
        return (epoch, index), self.data.image(index), self.data.labels[index]

    def class_labels(self) -> list[int]:
        """Each image's class id (what data.m_per_class balances batches on)."""
        return list(self.data.labels)

    @property
    def class_names(self) -> list[str]:
        return list(self.data.names)


class ClassificationCollator:
    """Dataset items -> the adapter's preprocessed images and the targets (runs in DataLoader workers): class indices,
    or soft targets `(B, num_labels)` when the batch is mixed. With `augmentation` (training only), each image is
    cropped/flipped by its own (seed, epoch, index) draws before preprocessing, and mixup/cutmix by the batch's."""

    def __init__(self, adapter: nn.Module, augmentation: "AugmentationConfig | None" = None, seed: int = 0):
        self.adapter = adapter
        self.augmentation = augmentation if augmentation is not None and augmentation.enabled else None
        self.seed = seed

    def __call__(self, items: list[tuple[tuple[int, int], Any, int]]) -> dict[str, Any]:
        from vembed.data.records import Side

        labels = torch.tensor([label for _, _, label in items], dtype=torch.long)
        config = self.augmentation
        if config is None:
            return {"inputs": self.adapter.preprocess([Side(image=path) for _, path, _ in items]), "labels": labels}
        from vembed.classification.augment import augment_image, batch_rng, mix_batch, sample_rng
        from vembed.data.images import load_image
        from vembed.models.batch import PIXEL_VALUES

        images = [augment_image(load_image(path), config, sample_rng(self.seed, epoch, index))
                  for (epoch, index), path, _ in items]
        inputs = self.adapter.preprocess([Side(image=image) for image in images])
        if config.mixup_alpha > 0 or config.cutmix_alpha > 0:
            rng = batch_rng(self.seed, [key for key, _, _ in items])
            inputs[PIXEL_VALUES], targets = mix_batch(inputs[PIXEL_VALUES], labels, self.adapter.settings.num_labels,
                                                     config, rng)
            return {"inputs": inputs, "labels": targets}
        return {"inputs": inputs, "labels": labels}


def read_split(recipe: "Recipe", split: str, names: list[str] | None,
               num_labels: int | None = None) -> "LabelledImages":
    from vembed.classification.labelled import read_labelled_images

    data = recipe.data
    return read_labelled_images(getattr(data, split), f"data.{split}", label_column=data.columns.label,
                                image_root=data.image_root, names=names, num_labels=num_labels,
                                max_bad_fraction=data.max_bad_fraction)


def with_image_cache(data: "LabelledImages", adapter: nn.Module, recipe: "Recipe") -> "LabelledImages":
    """The training images resized once, as the pair data's (vembed/data/image_cache.py, the same key rules), unless
    augmentation crops the originals. Building the cache decodes every image, so those that do not decode are
    skipped and counted now (data.max_bad_fraction), before step 1."""
    from vembed.data.image_cache import cache_applies, open_image_cache

    settings = recipe.data
    if not cache_applies(settings, adapter) or recipe.augmentation.enabled:
        return data
    data.cache = open_image_cache(sorted(set(data.paths)), adapter.image_processor, settings.image_cache_dir,
                                  load=data.load, stamp=data.stamp)
    if data.cache is not None and data.cache.errors:
        data.without({key: message if file is None else f"{file}: {message}"
                      for key, (message, file) in data.cache.errors.items()})
        data.check_bad_fraction(settings.max_bad_fraction, " (found decoding every image for the image cache)")
    return data


def class_names(recipe: "Recipe") -> list[str]:
    """The classes of the training data (or the recipe's label_names), checked against the head's size."""
    settings = recipe.model
    train = read_split(recipe, "train", settings.label_names, settings.num_labels)
    if settings.num_labels is not None and settings.num_labels != len(train.names):
        raise RecipeError("num_labels", f"is {settings.num_labels} but {recipe.data.train} has {len(train.names)} "
                                        f"classes; set num_labels: {len(train.names)} (or fix the data)")
    return train.names


@TASKS.register("classification")
class ClassificationTask(Task):
    name = "classification"
    augments_images = True
    class_balanced_batches = True  # data.m_per_class: each record has a class
    no_gradient_cache = "is not supported for classification; remove it"

    @classmethod
    def check_recipe(cls, recipe: "Recipe", *, for_training: bool = True) -> None:
        data = recipe.data
        if data.streaming:
            raise RecipeError("data.streaming", "classification reads its labelled images whole; "
                                                "remove it")
        for split in ("train", "validation", "test"):
            if isinstance(getattr(data, split), (dict, list)):
                raise RecipeError(f"data.{split}", "classification takes one ImageFolder directory, CSV/JSONL "
                                                   "file or `datasets` folder/Parquet file per split")
        for key, value in (("stages", recipe.stages), ("data.no_duplicates", data.no_duplicates)):
            if value:
                raise RecipeError(key, "is not supported for classification; remove it")
        if recipe.metric_for_best_model not in METRICS:
            raise RecipeError("metric_for_best_model",
                              f"{recipe.metric_for_best_model!r} is not a classification metric; use one of: "
                              f"{', '.join(METRICS)} (e.g. metric_for_best_model: accuracy)")
        from vembed.components import model_class

        model_class(recipe).check_recipe(recipe)  # the backbone's config; a text tower for head_init: class_names
        if data.train is not None:
            names = class_names(recipe)
            if data.m_per_class:
                check_class_balance(read_split(recipe, "train", names), recipe)
            if getattr(recipe.loss, "class_weights", None) is not None:
                from vembed.classification.losses import class_weight_tensor

                class_weight_tensor(recipe.loss.class_weights, read_split(recipe, "train", names).labels, len(names))
            for split in ("validation", "test"):
                if getattr(data, split) is not None:
                    read_split(recipe, split, names)

    def load_train_data(self) -> "LabelledImages":
        recipe = self.recipe
        names = class_names(recipe)
        self.train_data = read_split(recipe, "train", names)
        # The head's size and class names follow the data; every later build (final/ from gathered shards) reads them.
        recipe.model.num_labels, recipe.model.label_names = len(names), names
        return self.train_data

    def build_objective(self) -> nn.Module:
        from vembed.components import loss_class

        recipe = self.recipe
        adapter = self.build_adapter()
        # The class weights come from the training labels (class_weights: balanced), read again at every launch.
        data = self.train_data
        return ClassificationObjective(adapter, loss_class(recipe).from_recipe(recipe, labels=data.labels,
                                                                              num_classes=len(data.names)))

    def batch_lines(self, world_size: int) -> list[tuple[str, str]]:
        from vembed.data.image_cache import cache_line

        return super().batch_lines(world_size) + cache_line(self.train_data.cache)

    def train_dataset(self, objective: nn.Module):
        recipe = self.recipe
        with_image_cache(self.train_data, objective.adapter, recipe)
        return (LabelledImageDataset(self.train_data),
                ClassificationCollator(objective.adapter, recipe.augmentation, recipe.seed))

    def held_out_images(self, data: "LabelledImages | None") -> list[Any]:
        return [data.image(i) for i in range(len(data))] if data else []

    def load_eval_split(self, split: str) -> "LabelledImages | None":
        if getattr(self.recipe.data, split) is None:
            return None
        return read_split(self.recipe, split, self.recipe.model.label_names).head(self.recipe.data.eval_max_samples)

    def evaluate(self, model: nn.Module, data: "LabelledImages | None", accelerator: "Accelerator",
                 prepared: nn.Module | None = None) -> dict[str, Any]:
        """Every rank classifies the whole split (ZeRO-3 needs every rank in each forward); all get the same."""
        from vembed.classification.evaluation import classification_metrics

        if not data:
            return {}
        forward = (lambda inputs: prepared(classify=inputs)) if prepared is not None else model.classify
        collate = ClassificationCollator(model)
        dataset = LabelledImageDataset(data)
        batch_size = self.recipe.resolved_eval_batch_size
        was_training = model.training
        model.eval()
        scores = []
        with torch.no_grad(), accelerator.autocast():
            for start in range(0, len(dataset), batch_size):
                batch = collate([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))])
                inputs = {k: v.to(accelerator.device) for k, v in batch["inputs"].items()}
                scores.append(forward(inputs).float().cpu())
        model.train(was_training)
        return classification_metrics(torch.cat(scores).numpy(), torch.tensor(data.labels).numpy(),
                                      self.recipe.model.label_names)

    def headline(self, metrics: dict[str, Any]) -> str:
        return "  ".join(f"{k}={metrics[k]:.4f}" for k in ("accuracy", "top5_accuracy", "macro_f1") if k in metrics)

    def split_report(self, split: str) -> dict[str, Any] | None:
        return None

    def plots(self, metrics: dict[str, Any], output_dir: Path) -> list[Path]:
        from vembed.classification.evaluation import plot_confusion_matrix, plot_reliability

        split = "test" if metrics.get("test") else "validation"
        report = metrics.get(split) or {}
        if not report.get("confusion_matrix"):
            return []
        paths = [plot_confusion_matrix(report["confusion_matrix"], output_dir / CONFUSION_PNG,
                                       title=f"{split}: accuracy {report['accuracy']:.3f}"),
                 plot_reliability(report.get("calibration") or [], output_dir / RELIABILITY_PNG,
                                  title=f"{split}: ECE {report.get('ece', float('nan')):.3f}, NLL "
                                        f"{report.get('nll', float('nan')):.3f}")]
        return [path for path in paths if path is not None]
