"""A tiny random-init BERT cross-encoder recipe (no downloads) and list data for the reranking tests."""

from __future__ import annotations

import json

import pytest

TINY_BERT = {"model_type": "bert", "vocab_size": 320, "hidden_size": 32, "intermediate_size": 37,
             "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 64,
             "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "pad_token_id": 0}

WORDS = ["red", "blue", "green", "square", "circle", "star", "a", "photo", "of", "on", "white", "page"]


def write_lists(path, count: int = 8, length: int = 4, seed: int = 0):
    import random

    rng = random.Random(seed)
    with open(path, "w") as handle:
        for i in range(count):
            documents = [" ".join(rng.choices(WORDS, k=rng.randint(2, 6))) for _ in range(length)]
            labels = [1.0] + [0.0] * (length - 1)
            handle.write(json.dumps({"query": f"a photo of a {WORDS[i % 6]}", "documents": documents,
                                     "labels": labels}) + "\n")
    return path


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
