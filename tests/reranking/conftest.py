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
