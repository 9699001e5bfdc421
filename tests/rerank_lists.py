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
