"""Shared test set-up: offline, deterministic, small."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

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
