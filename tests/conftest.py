"""Shared test set-up: offline, deterministic, small."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# ranx (fusion) compiles its numba functions on first use: 40-80 s on a fresh install such as CI's, for runs of a few
# queries that its same functions, run as Python, fuse in milliseconds. Set before anything imports numba.
os.environ.setdefault("NUMBA_DISABLE_JIT", "1")
if "VEMBED_IMAGE_CACHE_DIR" not in os.environ:  # the image cache of test runs stays out of the user's ~/.cache
    import tempfile

    os.environ["VEMBED_IMAGE_CACHE_DIR"] = _IMAGE_CACHE = tempfile.mkdtemp(prefix="vembed-test-image-cache-")

    def pytest_unconfigure(config):
        import shutil

        shutil.rmtree(_IMAGE_CACHE, ignore_errors=True)

import pytest  # noqa: E402

CAPTIONS = [
    "a photo of a red square",
    "a photo of a blue circle",
    "a handwritten digit seven",
    "the number three written by hand",
    "a green triangle on white",
    "a small yellow star",
    "two black lines crossing",
    "an empty white page",
]


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    """A BPE tokenizer trained offline on a few captions, saved as a transformers tokenizer folder."""
    from vembed.data.tokenizer import train_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(CAPTIONS * 4, path, vocab_size=300, max_length=16)
    return str(path)


@pytest.fixture(scope="session")
def mask_tokenizer_dir(tiny_tokenizer_dir, tmp_path_factory):
    """The tiny tokenizer with a mask token (what ColBERT's query expansion needs), id 300."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    tokenizer.add_special_tokens({"mask_token": "[MASK]"})
    path = tmp_path_factory.mktemp("mask_tokenizer")
    tokenizer.save_pretrained(path)
    return str(path)


from tiny_models import TINY_CLIP_CONFIG  # noqa: E402  (importable by tests: conftest names clash)


@pytest.fixture(scope="session")
def dummy_data_dir(tmp_path_factory):
    """Coloured-shape images with captions (train/validation/test JSONL, images/, tokenizer/)."""
    from vembed.data.synthetic import make_dummy_dataset

    path = tmp_path_factory.mktemp("dummy") / "data"
    make_dummy_dataset(path, 96, seed=0, image_size=32)
    return path


@pytest.fixture
def tiny_clip_recipe(dummy_data_dir, tmp_path):
    """A recipe dict for a tiny random-init CLIP on the dummy data, writing into a fresh output_dir."""
    return {
        "model_type": "clip",
        "model_config": TINY_CLIP_CONFIG,
        "tokenizer_name": str(dummy_data_dir / "tokenizer"),
        "data": {
            "train": str(dummy_data_dir / "train.jsonl"),
            "validation": str(dummy_data_dir / "validation.jsonl"),
            "test": str(dummy_data_dir / "test.jsonl"),
        },
        "output_dir": str(tmp_path / "run"),
        "batch_size": 8,
        "learning_rate": 1e-3,
        "epochs": 1,
        "logging_steps": 1,
        "save_steps": 100,
        "seed": 0,
        "eval_before_training": False,
    }
