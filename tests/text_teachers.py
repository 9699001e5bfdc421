"""A tiny text teacher for embedding distillation (loss_type embedding_mse): a random one-layer BERT saved by vembed,
translation pairs for it, and its embeddings of them extracted as `vembed extract --teacher` writes them."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

HIDDEN = 32


def tiny_text_recipe(tokenizer_dir: str, hidden: int = HIDDEN) -> dict:
    return {"model_type": "text", "pooling": "mean", "tokenizer_name": tokenizer_dir,
            "model_config": {"model_type": "bert", "vocab_size": 512, "hidden_size": hidden, "intermediate_size": 37,
                             "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 32,
                             "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}}


def save_text_teacher(folder: Path, tokenizer_dir: str, hidden: int = HIDDEN, seed: int = 3) -> str:
    import torch

    from vembed.components import recipe_from_dict
    from vembed.models import MODELS

    torch.manual_seed(seed)
    MODELS.get("text").from_recipe(recipe_from_dict(tiny_text_recipe(tokenizer_dir, hidden))).save(folder)
    return str(folder)


def write_translations(path: Path, n: int = 16) -> Path:
    """n rows `{"en": source, "de": its translation}`, JSONL."""
    rows = [{"en": f"question {i} about shape {i % 5}", "de": f"frage {i} zur form {i % 5}"} for i in range(n)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def distill_recipe(tokenizer_dir: str, train: Path, teacher_embeddings: Path, output_dir: Path, **keys) -> dict:
    """A student of the teacher's size trained with embedding_mse on `train` (en -> query, de -> positive)."""
    return {**tiny_text_recipe(tokenizer_dir), "loss_type": "embedding_mse",
            "teacher_embeddings": str(teacher_embeddings),
            "data": {"train": str(train), "columns": {"query": "en", "positive": "de"}},
            "output_dir": str(output_dir), "batch_size": 8, "max_steps": 2, "save_steps": None,
            "eval_before_training": False, "seed": 0, **keys}


def extract_teacher(teacher: str, recipe: dict, recipe_path: Path) -> Path:
    """The teacher's embeddings of the recipe's training rows, at its teacher_embeddings folder."""
    from vembed.extraction import extract_teacher_embeddings

    recipe_path.write_text(yaml.safe_dump(recipe))
    extract_teacher_embeddings(teacher=teacher, recipe=recipe_path, out=recipe["teacher_embeddings"], shard_size=5,
                               batch_size=4)
    return Path(recipe["teacher_embeddings"])
