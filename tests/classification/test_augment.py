"""Training-time image augmentation: crops and flips drawn per (seed, epoch, sample), mixup/cutmix with the soft
targets that match the pixels, and the training collator and sampler that carry the epoch to DataLoader workers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from vembed.classification.augment import augment_image, batch_rng, crop_box, mix_batch, sample_rng
from vembed.recipe import AugmentationConfig


def test_draws_are_a_function_of_seed_epoch_and_sample():
    assert sample_rng(0, 1, 5).random() == sample_rng(0, 1, 5).random()
    draws = {sample_rng(*key).random() for key in [(0, 1, 5), (0, 2, 5), (0, 1, 6), (1, 1, 5)]}
    assert len(draws) == 4  # another epoch, sample or seed: another crop
    assert batch_rng(0, [(0, 1), (0, 2)]).random() != batch_rng(0, [(0, 1), (0, 3)]).random()


@pytest.mark.parametrize("size", [(64, 48), (31, 90)])
def test_crops_cover_the_asked_area_and_aspect_ratio(size):
    width, height = size
    scale, ratio = (0.3, 0.6), (3 / 4, 4 / 3)
    for index in range(200):
        left, top, right, bottom = crop_box(width, height, scale, ratio, sample_rng(0, 0, index))
        assert 0 <= left < right <= width and 0 <= top < bottom <= height
        w, h = right - left, bottom - top
        # rounding to whole pixels moves the area and ratio by at most a pixel's worth
        assert scale[0] * width * height - (w + h + 1) <= w * h <= scale[1] * width * height + (w + h + 1)
        assert ratio[0] - 1.5 / h <= w / h <= ratio[1] + 1.5 / h


def test_an_impossible_crop_falls_back_to_the_central_crop_within_the_ratio():
    # a 100x10 strip cannot hold a crop of ratio <= 4/3 covering half its area: the widest central crop that keeps
    # the ratio is taken
    assert crop_box(100, 10, (0.5, 1.0), (3 / 4, 4 / 3), sample_rng(0, 0, 0)) == (43, 0, 56, 10)
    assert crop_box(20, 20, (1.0, 1.0), (3 / 4, 4 / 3), sample_rng(0, 0, 0)) == (0, 0, 20, 20)


def test_flip_probability_and_crop_reach_the_image():
    from PIL import Image

    pixels = np.arange(12 * 8 * 3, dtype=np.uint8).reshape(8, 12, 3)
    image = Image.fromarray(pixels)
    always = AugmentationConfig(horizontal_flip=1.0)
    assert np.array_equal(np.asarray(augment_image(image, always, sample_rng(0, 0, 0))), pixels[:, ::-1])
    assert np.array_equal(np.asarray(augment_image(image, AugmentationConfig(), sample_rng(0, 0, 0))), pixels)
    flips = [np.array_equal(np.asarray(augment_image(image, AugmentationConfig(horizontal_flip=0.5),
                                                     sample_rng(0, 0, i))), pixels[:, ::-1]) for i in range(400)]
    assert 0.4 < np.mean(flips) < 0.6
    cropped = augment_image(image, AugmentationConfig(crop_scale=(0.25, 0.25)), sample_rng(0, 0, 3))
    box = crop_box(12, 8, (0.25, 0.25), (3 / 4, 4 / 3), sample_rng(0, 0, 3))
    assert np.array_equal(np.asarray(cropped), pixels[box[1]:box[3], box[0]:box[2]])


def test_mixup_targets_carry_the_weight_of_the_pixels():
    pixels = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 1, 2, 1])
    mixed, targets = mix_batch(pixels, labels, 3, AugmentationConfig(mixup_alpha=0.4), np.random.default_rng(1))
    lam = float(targets[0, 0])  # image 0 (class 0) is mixed with image 3 (class 1)
    assert 0 < lam < 1 and torch.allclose(targets.sum(1), torch.ones(4))
    assert torch.allclose(mixed[0], lam * pixels[0] + (1 - lam) * pixels[3], atol=1e-6)
    assert torch.allclose(targets[0], torch.tensor([lam, 1 - lam, 0.0]))


def test_cutmix_targets_are_the_share_of_pixels_kept():
    pixels = torch.zeros(2, 1, 10, 10)
    pixels[1] = 1.0
    labels = torch.tensor([0, 1])
    for seed in range(20):
        mixed, targets = mix_batch(pixels, labels, 2, AugmentationConfig(cutmix_alpha=1.0),
                                   np.random.default_rng(seed))
        pasted = float(mixed[0].mean())  # image 0 is all zeros: its mean is the pasted share of image 1
        assert targets[0, 1] == pytest.approx(pasted, abs=1e-6)
        assert targets[1, 0] == pytest.approx(pasted, abs=1e-6)


def test_without_mixing_the_targets_are_one_hot():
    labels = torch.tensor([2, 0])
    _, targets = mix_batch(torch.zeros(2, 1, 2, 2), labels, 3, AugmentationConfig(), np.random.default_rng(0))
    assert torch.equal(targets, torch.tensor([[0.0, 0, 1], [1, 0, 0]]))


def test_the_sampler_tags_each_index_with_its_epoch_in_the_same_order():
    from vembed.data.sampler import EpochShuffleSampler

    plain, tagged = EpochShuffleSampler(10, seed=3), EpochShuffleSampler(10, seed=3, tags_epochs=True)
    for epoch in (0, 1):
        plain.set_epoch(epoch)
        tagged.set_epoch(epoch)
        assert list(tagged) == [(epoch, index) for index in plain]


def test_crop_scale_and_ratio_must_be_ordered_ranges():
    with pytest.raises(ValueError, match="low <= high <= 1"):
        AugmentationConfig(crop_scale=(0.5, 0.2))
    with pytest.raises(ValueError, match="low <= high <= 1"):
        AugmentationConfig(crop_scale=(0.5, 1.5))
    with pytest.raises(ValueError, match="0 < low <= high"):
        AugmentationConfig(crop_ratio=(0.0, 1.0))
    assert not AugmentationConfig().enabled and AugmentationConfig(cutmix_alpha=1.0).enabled
    assert math.isclose(AugmentationConfig().crop_ratio[1], 4 / 3)


# --- TrivialAugment and random erasing ----------------------------------------------------------------------------


def _photo():
    """A 40x40 RGB image with structure in every channel and a narrow value range (autocontrast and equalize act)."""
    from PIL import Image

    y, x = np.mgrid[0:40, 0:40]
    pixels = np.stack([60 + x * 2, 70 + y * 2, 80 + (x + y) % 30], axis=-1).astype(np.uint8)
    return Image.fromarray(pixels)


def test_trivial_augment_offers_torchvisions_wide_operation_set():
    from vembed.classification.augment import TRIVIAL_AUGMENT_BINS, TRIVIAL_AUGMENT_OPERATIONS

    assert TRIVIAL_AUGMENT_BINS == 31
    assert set(TRIVIAL_AUGMENT_OPERATIONS) == {
        "identity", "shear_x", "shear_y", "translate_x", "translate_y", "rotate", "brightness", "color", "contrast",
        "sharpness", "posterize", "solarize", "autocontrast", "equalize"}


@pytest.mark.parametrize("name", ["shear_x", "shear_y", "translate_x", "translate_y", "rotate", "brightness", "color",
                                  "contrast", "sharpness", "posterize", "solarize", "autocontrast", "equalize"])
def test_each_operation_changes_the_image_at_full_strength_and_ranged_ones_do_nothing_at_zero(name):
    from vembed.classification.augment import trivial_operation

    image = _photo()
    strong = np.asarray(trivial_operation(image, name, 30, sample_rng(0, 0, 0)))
    assert strong.shape == (40, 40, 3) and not np.array_equal(strong, np.asarray(image)), name
    if name not in ("autocontrast", "equalize"):  # the two without a strength
        assert np.array_equal(np.asarray(trivial_operation(image, name, 0, sample_rng(0, 0, 0))), np.asarray(image))


def test_trivial_augment_draws_one_operation_per_sample_and_replays_it():
    config = AugmentationConfig(trivial_augment=True)
    image = _photo()
    first = [np.asarray(augment_image(image, config, sample_rng(3, 1, i))).tobytes() for i in range(60)]
    again = [np.asarray(augment_image(image, config, sample_rng(3, 1, i))).tobytes() for i in range(60)]
    assert first == again  # a function of (seed, epoch, sample): resume and workers replay it
    assert len(set(first)) > 30  # operations and strengths vary across samples
    untouched = sum(view == np.asarray(image).tobytes() for view in first)
    assert untouched < 15  # identity (1 in 14) or a zero strength (1 in 31) leave an image as it was
    assert not AugmentationConfig().trivial_augment and config.enabled


def test_random_erasing_fills_one_rectangle_and_leaves_the_rest():
    image = _photo()
    original = np.asarray(image)
    erased = np.asarray(augment_image(image, AugmentationConfig(random_erasing=1.0), sample_rng(0, 0, 5)))
    changed = np.argwhere((erased != original).any(-1))
    assert len(changed) > 0
    top, left = changed.min(0)
    bottom, right = changed.max(0) + 1
    area = (bottom - top) * (right - left)
    assert 0.02 * 1600 * 0.8 <= area <= 1600 / 3 * 1.2  # one rectangle of 2-33% of the image
    assert len(changed) >= 0.9 * area  # filled (a random colour equals the original only by chance)
    outside = np.ones((40, 40), bool)
    outside[top:bottom, left:right] = False
    assert np.array_equal(erased[outside], original[outside])
    assert np.array_equal(np.asarray(augment_image(image, AugmentationConfig(random_erasing=0.0),
                                                   sample_rng(0, 0, 5))), original)
