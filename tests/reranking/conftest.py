"""The tiny random-init BERT cross-encoder recipe (no downloads) of the reranking tests."""

from __future__ import annotations

import pytest
from rerank_lists import TINY_BERT, write_lists


@pytest.fixture
def rerank_recipe(tiny_tokenizer_dir, tmp_path):
    train = write_lists(tmp_path / "lists.jsonl")
    return {
        "model_type": "cross_encoder", "loss_type": "lambdaloss",
        "model_config": TINY_BERT, "tokenizer_name": tiny_tokenizer_dir, "max_length": 32,
        "data": {"train": str(train)}, "output_dir": str(tmp_path / "run"),
        "batch_size": 4, "learning_rate": 1e-3, "epochs": 1, "logging_steps": 1, "save_steps": 100, "seed": 0,
        "eval_before_training": False,
    }


@pytest.fixture(scope="session")
def qwen_rerank_tokenizer(tmp_path_factory):
    from rerank_lists import train_qwen_rerank_tokenizer

    return train_qwen_rerank_tokenizer(tmp_path_factory.mktemp("qwen_rerank_tokenizer"))


@pytest.fixture
def qwen_rerank_recipe(qwen_rerank_tokenizer, tmp_path):
    """The rerank recipe on a tiny random-init Qwen3-VL reranker, lists with text and image documents."""
    from rerank_lists import qwen_reranker_config, write_image_lists
    from tiny_models import QWEN_PIXELS

    train = write_image_lists(tmp_path / "data" / "lists.jsonl")
    return {
        "model_type": "qwen_vl_reranker", "loss_type": "lambdaloss", "model_config": qwen_reranker_config("qwen3_vl"),
        "tokenizer_name": qwen_rerank_tokenizer, **QWEN_PIXELS, "train_vision_tower": True,
        "data": {"train": str(train)}, "output_dir": str(tmp_path / "run"),
        "batch_size": 3, "learning_rate": 1e-3, "epochs": 1, "logging_steps": 1, "save_steps": 100, "seed": 0,
        "eval_before_training": False, "mixed_precision": "no",
    }

