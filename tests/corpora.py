"""A tiny text corpus folder (BEIR layout) and a tiny text model recipe for the corpus evaluation and training tests.

Words come from the test tokenizer's captions (tests/conftest.py), so every text tokenizes to known pieces."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

COLOURS = ["red", "blue", "green", "yellow", "black", "white"]
SHAPES = ["square", "circle", "triangle", "star", "page", "digit"]


def make_corpus_folder(root: Path) -> Path:
    """36 documents (`a {colour} {shape} on {ground}`), 18 queries (`a photo of a {colour} {shape}`); qrels: the
    document of the same colour and shape is grade 2, same shape other colour grade 1 (a few), one all-0 query.
    train / dev / test judge different queries."""
    from vembed.data.corpus import write_corpus_folder

    documents, queries = {}, {}
    for i, (colour, shape) in enumerate(itertools.product(COLOURS, SHAPES)):
        documents[f"d{i}"] = {"title": shape, "text": f"a {colour} {shape} on {COLOURS[(i + 1) % 6]}"}
    splits: dict[str, dict[str, dict[str, int]]] = {"train": {}, "dev": {}, "test": {}}
    for i, (colour, shape) in enumerate(itertools.product(COLOURS, SHAPES)):
        if i % 2:
            continue
        query = f"q{i}"
        queries[query] = {"text": f"a photo of a {colour} {shape}"}
        judged = {f"d{i}": 2}
        if i % 3 == 0:
            judged[f"d{(i + 6) % 36}"] = 1  # the same shape, another colour
        splits[("train", "train", "dev", "test")[i // 2 % 4]][query] = judged
    splits["dev"]["q0"] = {"d1": 0}  # judged, nothing relevant: left out of the means
    queries.setdefault("q0", {"text": "a photo of a red square"})
    return write_corpus_folder(root, documents, queries, splits)


def write_pairs(folder: Path, path: Path) -> Path:
    """The corpus's train judgements as a pairs JSONL (query, positive text), for runs that train on pairs."""
    from vembed.data.corpus import load_corpus_split

    split = load_corpus_split(folder, "train")
    rows = [{"query": split.queries.sides[split.queries.index[q]].text,
             "positive": split.corpus.sides[split.corpus.index[d]].text}
            for q, judged in split.qrels.items() for d, grade in judged.items() if grade > 0]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def text_model_keys(tokenizer_dir: str) -> dict:
    """Recipe keys of a tiny random-init BERT text embedder on the test tokenizer."""
    from transformers import AutoTokenizer

    from vembed.data.tokenizer import special_token_ids

    ids = special_token_ids(AutoTokenizer.from_pretrained(tokenizer_dir))
    config = {"model_type": "bert", "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2,
              "num_attention_heads": 4, "max_position_embeddings": 32, "hidden_dropout_prob": 0.0,
              "attention_probs_dropout_prob": 0.0, **ids}
    return {"model_type": "text", "model_config": config, "tokenizer_name": tokenizer_dir}


def write_negatives(path: Path) -> Path:
    """Mined negatives in the `mine` branch's schema: q0's per positive (one of them judged relevant: dropped), the
    other train queries' per query (`positive_ids`, or no positive: every positive of the query)."""
    rows = [{"query_id": "q0", "positive_id": "d0", "negative_ids": ["d6", "d1", "d3", "d5"]},  # d6: relevant to q0
            {"query_id": "q0", "positive_id": "d6", "negative_ids": ["d7", "d9"]},
            {"query_id": "q18", "positive_ids": ["d18", "d24"], "negative_ids": ["d19", "d20", "d21"]}]
    rows += [{"query_id": f"q{i}", "negative_ids": [f"d{(i + 1) % 36}", f"d{(i + 3) % 36}"]}
             for i in (2, 8, 10, 16, 24, 26, 32, 34)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
