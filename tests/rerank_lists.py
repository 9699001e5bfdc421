"""Tiny reranking data and model config shared by tests/reranking (a plain module: `conftest` is ambiguous across test
folders)."""

from __future__ import annotations

import json

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


def write_first_stage_run(split, path, left_out: dict | None = None):
    """A poor first stage as a TREC run: 12 candidates per judged query of `split` (a CorpusSplit), its relevant
    documents 4th and 9th from the top; `left_out`: {query: a relevant document it misses}."""
    lines = []
    for query, judged in split.qrels.items():
        relevant = [d for d, grade in judged.items() if grade > 0]
        others = [d for d in split.corpus.ids if d not in judged][:12 - len(relevant)]
        ranked = others[:3] + relevant[:1] + others[3:7] + relevant[1:] + others[7:]
        ranked = [d for d in ranked if d != (left_out or {}).get(query)]
        lines += [f"{query} Q0 {d} {rank} {100 - rank} first" for rank, d in enumerate(ranked, start=1)]
    path.write_text("\n".join(lines) + "\n")
    return path


QWEN_RERANK_VOCAB = 600  # the tiny Qwen models' text vocab_size in the reranker tests


def train_qwen_rerank_tokenizer(path) -> str:
    """A byte-level Qwen tokenizer (chat and vision tokens) whose vocabulary holds "yes" and "no" as single tokens:
    the rows the Qwen-VL reranker reads."""
    from vembed.data.tokenizer import train_qwen_tokenizer
    from vembed.reranking.qwen_vl_reranker import DEFAULT_INSTRUCTION, JUDGE

    # The template's own sentences too, so that its pairs stay short (a few dozen tokens, not hundreds of bytes).
    texts = [" ".join(WORDS)] * 8 + ["yes", "no"] * 100 + [JUDGE, DEFAULT_INSTRUCTION, "<Query>:", "\n<Document>:"] * 20
    train_qwen_tokenizer(texts, path, vocab_size=QWEN_RERANK_VOCAB)
    return str(path)


def write_images(folder, count: int = 4) -> list[str]:
    """`count` small random PNGs of different sizes (file names relative to `folder`)."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for i in range(count):
        size = (16 + 8 * (i % 3), 16 + 8 * (i % 2))
        pixels = np.random.default_rng(i).integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"img{i}.png")
        names.append(f"img{i}.png")
    return names


def write_image_lists(path, count: int = 6, seed: int = 0):
    """Lists whose documents are `{"text"}` and `{"text", "image"}` objects (images beside the file), the positive
    first."""
    import random

    rng = random.Random(seed)
    images = write_images(path.parent)
    with open(path, "w") as handle:
        for i in range(count):
            documents = [{"text": " ".join(rng.choices(WORDS, k=rng.randint(1, 4))), "image": images[(i + j) % 4]}
                         if (i + j) % 2 else {"text": " ".join(rng.choices(WORDS, k=rng.randint(2, 6)))}
                         for j in range(3)]
            handle.write(json.dumps({"query": f"a photo of a {WORDS[i % 6]}", "documents": documents,
                                     "labels": [1.0, 0.0, 0.0]}) + "\n")
    return path


def qwen_reranker_config(backbone: str) -> dict:
    """A tiny Qwen-VL config (tests/tiny_models.py) with room for the reranker tests' tokenizer."""
    import copy

    from tiny_models import QWEN_BACKBONES

    config = {"model_type": backbone, **copy.deepcopy(QWEN_BACKBONES[backbone])}
    config["text_config"]["vocab_size"] = QWEN_RERANK_VOCAB
    return config
