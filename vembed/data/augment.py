"""Training-time image augmentation for the image-only tasks (recipe key `augmentation:`): random resized crop and
horizontal flip on each decoded image, before the adapter's processor resizes it to the model's size; mixup and
cutmix on the processed batch, with soft targets.

Every draw comes from a generator seeded by (seed, epoch, sample index), never from global or worker RNG state: a
run's augmentations are a function of its recipe, so a resumed run replays them, DataLoader workers draw what the
main process would, and a sample looks different in each epoch. Written here rather than taken from torchvision
(whose PyPI wheels do not import beside the torch vembed pins) or timm (which needs torchvision).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from PIL import Image

    from vembed.recipe import AugmentationConfig


def sample_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The generator of one sample's draws in one epoch (independent streams for distinct keys)."""
    return np.random.default_rng(np.random.SeedSequence([seed % 2**63, epoch, index]))


def batch_rng(seed: int, keys: list[tuple[int, int]]) -> np.random.Generator:
    """The generator of a batch's mixup/cutmix draws: a function of the samples in it (their (epoch, index) keys)."""
    flat = [value for key in keys for value in key]
    return np.random.default_rng(np.random.SeedSequence([seed % 2**63, 1, *flat]))


def crop_box(width: int, height: int, scale: tuple[float, float], ratio: tuple[float, float],
             rng: np.random.Generator) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of a random crop covering a `scale` fraction of the area with aspect ratio in
    `ratio` (log-uniform), the Inception-style crop ViT recipes train with: 10 tries, then the largest central crop
    whose ratio is within bounds."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            left = int(rng.integers(0, width - w + 1))
            top = int(rng.integers(0, height - h + 1))
            return left, top, left + w, top + h
    aspect = width / height
    if aspect < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif aspect > ratio[1]:
        w, h = int(round(height * ratio[1])), height
    else:
        w, h = width, height
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


def augment_image(image: "Image.Image", config: "AugmentationConfig", rng: np.random.Generator) -> "Image.Image":
    """The crop (if `crop_scale` is set), then the flip (with probability `horizontal_flip`)."""
    from PIL import Image

    if config.crop_scale is not None:
        image = image.crop(crop_box(image.width, image.height, config.crop_scale, config.crop_ratio, rng))
    if config.horizontal_flip and rng.random() < config.horizontal_flip:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return image


def mix_batch(pixels: torch.Tensor, labels: torch.Tensor, num_classes: int, config: "AugmentationConfig",
              rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixup or cutmix (one of them, even odds, when both are on) of each image with the batch's reversed order:
    `(pixels, soft targets (B, num_classes))`. Each rank mixes its own batch (as timm's Mixup does under DDP)."""
    targets = torch.nn.functional.one_hot(labels, num_classes).float()
    modes = [mode for mode, alpha in (("mixup", config.mixup_alpha), ("cutmix", config.cutmix_alpha)) if alpha > 0]
    if not modes or len(labels) < 2:
        return pixels, targets
    mode = modes[int(rng.integers(len(modes)))]
    alpha = config.mixup_alpha if mode == "mixup" else config.cutmix_alpha
    lam = float(rng.beta(alpha, alpha))
    partner = torch.arange(len(labels) - 1, -1, -1)
    if mode == "mixup":
        mixed = lam * pixels + (1 - lam) * pixels[partner]
    else:
        height, width = pixels.shape[-2:]
        cut = math.sqrt(1 - lam)
        cut_h, cut_w = int(height * cut), int(width * cut)
        cy, cx = int(rng.integers(height)), int(rng.integers(width))
        top, bottom = max(cy - cut_h // 2, 0), min(cy + cut_h // 2, height)
        left, right = max(cx - cut_w // 2, 0), min(cx + cut_w // 2, width)
        mixed = pixels.clone()
        mixed[..., top:bottom, left:right] = pixels[partner][..., top:bottom, left:right]
        lam = 1 - (bottom - top) * (right - left) / (height * width)  # the share actually kept, after clipping
    return mixed, lam * targets + (1 - lam) * targets[partner]


__all__ = ["augment_image", "batch_rng", "crop_box", "mix_batch", "sample_rng"]
