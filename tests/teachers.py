"""A fixed, tiny teacher pair for the BLIP3-o tests: two random ViTs saved as transformers folders, and images.

Each teacher is a random ViT with no transformer layer (patch embedding, positions, final layer norm), so a token
depends on its own patch only. Both see the 16×16 image as a 4×4 grid of 4×4 patches; a 48-value patch fits in the
64 dims of teacher A ("EVA"), so A's token fixes B's ("CLIP", 32-d) token at the same place through a fixed nonlinear
(layer-normed) map, which a DiT can learn.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

IMAGE_SIZE = 16
EVA_DIM, CLIP_DIM, NUM_TOKENS = 64, 32, 16


def save_teacher(path: Path, hidden: int, seed: int, image_size: int, patch: int) -> Path:
    import torch
    from transformers import ViTConfig, ViTImageProcessor, ViTModel

    torch.manual_seed(seed)
    config = ViTConfig(image_size=image_size, patch_size=patch, hidden_size=hidden, num_hidden_layers=0,
                       num_attention_heads=2, intermediate_size=2 * hidden, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0)
    ViTModel(config, add_pooling_layer=False).eval().save_pretrained(path)
    ViTImageProcessor(size={"height": image_size, "width": image_size}, do_normalize=True).save_pretrained(path)
    return path


def save_teachers(root: Path) -> tuple[str, str]:
    return (str(save_teacher(root / "teacher_eva", EVA_DIM, seed=1, image_size=16, patch=4)),
            str(save_teacher(root / "teacher_clip", CLIP_DIM, seed=2, image_size=16, patch=4)))


def write_images(directory: Path, n: int, seed: int, start: int = 0, noise: float = 0.1) -> Path:
    """n random RGB images (a few coloured low-frequency waves plus pixel noise of std `noise` × range), as PNGs."""
    from PIL import Image

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:IMAGE_SIZE, 0:IMAGE_SIZE] / IMAGE_SIZE
    for i in range(n):
        image = np.zeros((IMAGE_SIZE, IMAGE_SIZE, 3))
        for _ in range(3):
            fx, fy, phase = rng.uniform(0, 3, size=2).tolist() + [rng.uniform(0, 2 * np.pi)]
            image += np.sin(2 * np.pi * (fx * x + fy * y) + phase)[..., None] * rng.uniform(0, 1, size=3)
        image = (image - image.min()) / (np.ptp(image) + 1e-6)
        image = np.clip(image + noise * rng.standard_normal(image.shape), 0, 1) * 255
        Image.fromarray(image.astype(np.uint8)).save(directory / f"{start + i:05d}.png")
    return directory
