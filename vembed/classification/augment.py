"""Training-time image augmentation for the image-only tasks (recipe key `augmentation:`): random resized crop,
horizontal flip, TrivialAugment (one random photometric or geometric operation at a random strength, Müller and
Hutter 2021, with torchvision's "wide" operation set and magnitudes) and random erasing on each decoded image, before
the adapter's processor resizes it to the model's size; mixup and cutmix on the processed batch, with soft targets.

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
    """The crop (if `crop_scale` is set), the flip (with probability `horizontal_flip`), one TrivialAugment
    operation (`trivial_augment`), then random erasing (with probability `random_erasing`), in that order."""
    from PIL import Image

    if config.crop_scale is not None:
        image = image.crop(crop_box(image.width, image.height, config.crop_scale, config.crop_ratio, rng))
    if config.horizontal_flip and rng.random() < config.horizontal_flip:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    if config.trivial_augment:
        name = TRIVIAL_AUGMENT_OPERATIONS[int(rng.integers(len(TRIVIAL_AUGMENT_OPERATIONS)))]
        image = trivial_operation(image.convert("RGB"), name, int(rng.integers(TRIVIAL_AUGMENT_BINS)), rng)
    if config.random_erasing and rng.random() < config.random_erasing:
        image = erase_box(image.convert("RGB"), rng)
    return image


# TrivialAugmentWide (torchvision's `TrivialAugmentWide`): each image gets one operation, uniformly chosen, at one of
# 31 strengths, uniformly chosen; signed operations take a random sign. Strength s in 0..30 maps to each operation's
# range below (its value at s = 30).
TRIVIAL_AUGMENT_BINS = 31
TRIVIAL_AUGMENT_OPERATIONS = ("identity", "shear_x", "shear_y", "translate_x", "translate_y", "rotate", "brightness",
                              "color", "contrast", "sharpness", "posterize", "solarize", "autocontrast", "equalize")
_LARGEST = {"shear_x": 0.99, "shear_y": 0.99, "translate_x": 32.0, "translate_y": 32.0, "rotate": 135.0,
            "brightness": 0.99, "color": 0.99, "contrast": 0.99, "sharpness": 0.99}
_SIGNED = set(_LARGEST)  # every ranged operation but posterize and solarize goes either way


def trivial_operation(image: "Image.Image", name: str, strength: int, rng: np.random.Generator) -> "Image.Image":
    """`image` (RGB) under operation `name` at `strength` (0..30); a signed operation's sign is drawn from `rng`."""
    from PIL import Image, ImageEnhance, ImageOps

    fraction = strength / (TRIVIAL_AUGMENT_BINS - 1)
    value = _LARGEST.get(name, 0.0) * fraction
    if name in _SIGNED and rng.random() < 0.5:
        value = -value
    fill = (128, 128, 128)
    if name == "identity":
        return image
    if name in ("shear_x", "shear_y"):
        matrix = (1, value, 0, 0, 1, 0) if name == "shear_x" else (1, 0, 0, value, 1, 0)
        return image.transform(image.size, Image.Transform.AFFINE, matrix, Image.Resampling.NEAREST, fillcolor=fill)
    if name in ("translate_x", "translate_y"):
        matrix = (1, 0, value, 0, 1, 0) if name == "translate_x" else (1, 0, 0, 0, 1, value)
        return image.transform(image.size, Image.Transform.AFFINE, matrix, Image.Resampling.NEAREST, fillcolor=fill)
    if name == "rotate":
        return image.rotate(value, resample=Image.Resampling.NEAREST, fillcolor=fill)
    enhancers = {"brightness": ImageEnhance.Brightness, "color": ImageEnhance.Color,
                 "contrast": ImageEnhance.Contrast, "sharpness": ImageEnhance.Sharpness}
    if name in enhancers:
        return enhancers[name](image).enhance(1.0 + value)
    if name == "posterize":
        return ImageOps.posterize(image, 8 - int(round(6 * fraction)))  # 8 bits (none) down to 2
    if name == "solarize":
        return ImageOps.solarize(image, int(round(255 * (1 - fraction))))  # 255 (none) down to 0
    if name == "autocontrast":
        return ImageOps.autocontrast(image)
    if name == "equalize":
        return ImageOps.equalize(image)
    raise ValueError(f"unknown TrivialAugment operation {name!r}")


def erase_box(image: "Image.Image", rng: np.random.Generator, scale: tuple[float, float] = (0.02, 1 / 3),
              ratio: tuple[float, float] = (0.3, 3.3)) -> "Image.Image":
    """Random erasing (Zhong et al. 2017, timm's and torchvision's defaults): a rectangle of `scale` of the area with
    aspect ratio in `ratio` (log-uniform) filled with per-pixel random colours; unchanged after 10 misses."""
    from PIL import Image

    width, height = image.size
    for _ in range(10):
        area = width * height * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1])))
        w, h = int(round(math.sqrt(area * aspect))), int(round(math.sqrt(area / aspect)))
        if 0 < w < width and 0 < h < height:
            left, top = int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1))
            pixels = np.array(image)
            pixels[top:top + h, left:left + w] = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
            return Image.fromarray(pixels)
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


__all__ = ["TRIVIAL_AUGMENT_OPERATIONS", "augment_image", "batch_rng", "crop_box", "erase_box", "mix_batch",
           "sample_rng", "trivial_operation"]
