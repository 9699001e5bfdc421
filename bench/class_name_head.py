"""Does `head_init: class_names` start classification where CLIP's zero-shot is, and does that help after a few steps?
Offline and small (CPU): a tiny CLIP is first trained contrastively on the synthetic coloured shapes (captions like
"a picture of a red circle"), so its zero-shot is above chance; then the classification task fine-tunes its image
side on the same shapes' labels (12 classes: 3 shapes x 4 colours), once from a head of class-name text embeddings
("a red circle", ...) and once from a random head. The numbers say what the initialisation buys on this toy, not how
good either model is.

    python bench/class_name_head.py [--clip-steps 400] [--steps 30] [--work runs/class_name_head] [--smoke]

Data and runs go under --work; the figures to bench/results/class_name_head.json (docs/notes.md cites them).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CLIP_CONFIG = {
    "projection_dim": 32,
    "text_config": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "max_position_embeddings": 32, "pad_token_id": 0, "bos_token_id": 2,
                    "eos_token_id": 3},
    "vision_config": {"image_size": 32, "patch_size": 8, "num_channels": 3, "hidden_size": 64,
                      "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4},
}
METRICS = ("accuracy", "macro_f1")


def labelled_csv(data: Path, split: str) -> Path:
    """The split's images with their class name as written in a prompt ("red circle"), for the classification task."""
    path = data.parent / f"{split}_labels.csv"
    rows = ["image,label"]
    for line in (data / f"{split}.jsonl").read_text().splitlines():
        record = json.loads(line)
        shape, colour = record["label"].split("-")
        rows.append(f"{record['positive_image']},{colour} {shape}")
    path.write_text("\n".join(rows) + "\n")
    return path


def run(recipe_dict: dict) -> dict:
    """Train a recipe; its validation metrics before the first step and after the last."""
    from vembed.components import recipe_from_dict
    from vembed.training.loop import Trainer

    trainer = Trainer(recipe_from_dict(recipe_dict))
    trainer.build()
    before = trainer.evaluate(trainer.eval_examples)
    trainer.run()
    after = trainer.evaluate(trainer.eval_examples)
    return {"before": before, "after": after}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clip-steps", type=int, default=400)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--samples", type=int, default=1200)
    parser.add_argument("--work", default=None, help="data and runs (default: runs/class_name_head; smoke: temporary)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--smoke", action="store_true", help="a few steps, to check the script runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.clip_steps, args.steps, args.samples = 4, 2, 120
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.outputs import output_dir
    from vembed.data.synthetic import make_dummy_dataset

    results_dir = output_dir(args.out, args.smoke)
    out = Path(args.work or (results_dir / "work" if args.smoke else "runs/class_name_head"))
    data = out / "data"
    make_dummy_dataset(data, args.samples, seed=0, image_size=32)
    common = {"output_dir": None, "overwrite_output_dir": True, "batch_size": 32, "seed": 0, "save_steps": 10**6,
              "eval_before_training": False, "logging_steps": 50, "warmup_ratio": 0.1}
    clip = run({**common, "model_type": "clip", "model_config": CLIP_CONFIG, "tokenizer_name": str(data / "tokenizer"),
                "data": {"train": str(data / "train.jsonl"), "validation": str(data / "validation.jsonl")},
                "output_dir": str(out / "clip"), "learning_rate": 1e-3, "max_steps": args.clip_steps})
    splits = {split: str(labelled_csv(data, split)) for split in ("train", "validation")}
    results = {"dataset": {"samples": args.samples, "classes": 12, "chance": 1 / 12,
                           "validation_images": sum(1 for _ in open(splits["validation"])) - 1},
               "clip": {"steps": args.clip_steps,
                        "validation_q2d_accuracy@1": {k: clip[k].get("q2d/accuracy@1") for k in ("before", "after")}},
               "classification": {"steps": args.steps}}
    for head_init in ("class_names", "random"):
        measured = run({**common, "model_type": "vision", "model_name": str(out / "clip" / "final"),
                        "head_init": head_init, "class_name_template": "a {}", "loss_type": "cross_entropy",
                        "metric_for_best_model": "accuracy", "data": {**splits, "image_root": str(data)},
                        "output_dir": str(out / f"head_{head_init}"), "learning_rate": 1e-4,
                        "max_steps": args.steps})
        results["classification"][head_init] = {when: {k: measured[when][k] for k in METRICS}
                                                for when in ("before", "after")}
        print(head_init, json.dumps(results["classification"][head_init]))
    (results_dir / "class_name_head.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
