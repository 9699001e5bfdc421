"""Held-out check of the scored-pair losses (issue 24): on synthetic graded caption pairs, does CoSENT beat InfoNCE on
Spearman? Offline and small (a tiny BERT from scratch, CPU), so the number says which loss uses the grades, not how
good either model is.

    python bench/heldout_scored.py [--steps 300] [--out runs/heldout_scored]

Captions are "<size> <colour> <shape> at the <place>"; a pair's gold score is how many of the four attributes the two
captions share (0-4). CoSENT trains on every pair with its score; InfoNCE on the same pairs, positives being those
scoring 3 or 4 (what a pair loss can use of graded data). Both are evaluated on held-out pairs of unseen attribute
combinations: Spearman and Pearson of cosine vs gold (vembed/evaluation/scored.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SIZES = ["tiny", "small", "large", "huge"]
COLOURS = ["red", "blue", "green", "yellow", "black", "white", "purple", "orange"]
SHAPES = ["circle", "square", "triangle", "star", "hexagon", "cross", "ring", "arrow"]
PLACES = ["top", "bottom", "left", "right"]


def caption(attributes: tuple[str, ...]) -> str:
    size, colour, shape, place = attributes
    return f"a {size} {colour} {shape} at the {place}"


def pairs(rng: random.Random, n: int, held_out: bool) -> list[dict]:
    """n pairs with scores spread over 0-4; held-out pairs use combinations whose shape index is odd."""
    rows = []
    while len(rows) < n:
        first = (rng.choice(SIZES), rng.choice(COLOURS), rng.choice(SHAPES), rng.choice(PLACES))
        if (SHAPES.index(first[2]) % 2 == 1) != held_out:
            continue
        keep = rng.randint(0, 4)
        changed = rng.sample(range(4), 4 - keep)
        second = list(first)
        for slot in changed:
            options = [SIZES, COLOURS, SHAPES, PLACES][slot]
            second[slot] = rng.choice([o for o in options if o != first[slot]])
        rows.append({"query": caption(first), "positive": caption(tuple(second)), "score": float(keep)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default="runs/heldout_scored")
    args = parser.parse_args()
    from vembed.components import recipe_from_dict
    from vembed.data.tokenizer import train_tokenizer
    from vembed.training.loop import Trainer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    train, held_out = pairs(rng, 4000, False), pairs(rng, 1000, True)
    positives = [row for row in train if row["score"] >= 3]
    for name, rows in (("train", train), ("positives", positives), ("heldout", held_out)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    texts = [row[side] for row in train + held_out for side in ("query", "positive")]
    train_tokenizer(texts, out / "tokenizer", vocab_size=256, max_length=16)
    results = {}
    for loss, data in (("cosent", "train"), ("infonce", "positives")):
        recipe = recipe_from_dict({
            "model_type": "text", "pooling": "mean", "tokenizer_name": str(out / "tokenizer"),
            "model_config": {"model_type": "bert", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                             "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 32},
            "data": {"train": str(out / f"{data}.jsonl"), "validation": str(out / "heldout.jsonl")},
            "loss_type": loss, "output_dir": str(out / loss), "overwrite_output_dir": True, "batch_size": 32,
            "learning_rate": 1e-3, "max_steps": args.steps, "warmup_ratio": 0.1, "seed": 0, "save_steps": 10**6,
            "eval_steps": args.steps, "eval_before_training": True, "logging_steps": 50,
            "metric_for_best_model": "similarity/spearman_cosine" if loss == "cosent" else "q2d/accuracy@1",
        })
        trainer = Trainer(recipe)
        trainer.build()
        before = trainer.evaluate(trainer.eval_examples)
        trainer.run()
        after = trainer.evaluate(trainer.eval_examples)
        results[loss] = {"train_pairs": len(train if data == "train" else positives),
                         "before": {k: before[k] for k in ("similarity/spearman_cosine", "similarity/pearson_cosine")},
                         "after": {k: after[k] for k in ("similarity/spearman_cosine", "similarity/pearson_cosine")}}
        print(loss, json.dumps(results[loss]))
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
