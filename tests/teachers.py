"""A fixed, tiny teacher pair for the BLIP3-o tests: two random ViTs saved as transformers folders, and images.

Teacher A ("EVA", 64-d) and teacher B ("CLIP", 32-d) see the same 32×32 image as a 4×4 grid of 8×8 patches, so
B's tokens are a fixed function of the image that A's tokens determine: a DiT can learn to reproduce them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

IMAGE_SIZE, PATCH = 32, 8
EVA_DIM, CLIP_DIM, NUM_TOKENS = 64, 32, (IMAGE_SIZE // PATCH) ** 2


def save_teacher(path: Path, hidden: int, seed: int) -> Path:
    import torch
    from transformers import ViTConfig, ViTImageProcessor, ViTModel

    torch.manual_seed(seed)
    config = ViTConfig(image_size=IMAGE_SIZE, patch_size=PATCH, hidden_size=hidden, num_hidden_layers=1,
                       num_attention_heads=2, intermediate_size=2 * hidden, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0)
    ViTModel(config, add_pooling_layer=False).eval().save_pretrained(path)
    ViTImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, do_normalize=True).save_pretrained(path)
    return path


def save_teachers(root: Path) -> tuple[str, str]:
    return (str(save_teacher(root / "teacher_eva", EVA_DIM, seed=1)),
            str(save_teacher(root / "teacher_clip", CLIP_DIM, seed=2)))


def write_images(directory: Path, n: int, seed: int, start: int = 0) -> Path:
    """n smooth random RGB images (a few coloured low-frequency waves each), as PNGs named by number."""
    from PIL import Image

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:IMAGE_SIZE, 0:IMAGE_SIZE] / IMAGE_SIZE
    for i in range(n):
        image = np.zeros((IMAGE_SIZE, IMAGE_SIZE, 3))
        for _ in range(3):
            fx, fy, phase = rng.uniform(0, 3, size=2).tolist() + [rng.uniform(0, 2 * np.pi)]
            image += np.sin(2 * np.pi * (fx * x + fy * y) + phase)[..., None] * rng.uniform(0, 1, size=3)
        image = (image - image.min()) / (np.ptp(image) + 1e-6) * 255
        Image.fromarray(image.astype(np.uint8)).save(directory / f"{start + i:05d}.png")
    return directory
