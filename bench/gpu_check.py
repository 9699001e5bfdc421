"""The GPU check: one command for a lent GPU machine (no network there) that runs vembed's GPU paths and writes what it
saw to one JSON and a short Markdown table. `scripts/gpu_check.sh` (and `make gpu-check`) is the thin wrapper.

    scripts/gpu_check.sh --out DIR                # on the GPU machine: about 3 minutes on one H100, at most 7
    scripts/gpu_check.sh --cpu-dry-run --out DIR  # every step at toy size on CPU, in about 2 minutes (a test)
    scripts/gpu_check.sh --out DIR --steps qwen_memory   # a step left out of the default run
    make gpu-wheels                               # here, before: what the GPU machine lacks, as wheels (gpu-wheels/)

Steps (each in its own process with its own time budget: a failure or an overrun is recorded with its error line, and
the next step runs). The speed steps time each system's optimizer step on one batch, held on the device (warm-up
steps first, the median of the timed steps per round, rounds interleaved and rotated), and report per system
samples/s, MFU (one step's model FLOPs, counted by vembed/models/flops.py as the training loop does and given to a
peer doing the same work too, over the step's time and the card's bf16 peak from vembed's table of accelerators; in a
dry run the CPU's measured float32 ceiling) and peak CUDA memory (what the system keeps resident plus the most its
own steps allocate; none in a dry run):
- environment: installs the wheels of gpu-wheels/ whose distributions the machine lacks (`--no-deps`, vembed too),
  and records the card and the versions.
- gpu_tests: `pytest -m gpu tests/gpu/` (bf16 training, GradCache under bf16; the 2-GPU NCCL launches where 2 GPUs
  exist, else skipped, and the skip reasons are recorded).
- clip_speed: CLIP ViT-B/32 shapes (random init), batch 256, bf16, sdpa: vembed's training step against open_clip's
  (the model, ClipLoss and AdamW as open_clip_train's step uses them) on the same tensors.
- text_speed: MiniLM-L6 shapes (random init) on texts of uneven length, batch 256, bf16: vembed padded, with
  `length_chunks: 4`, packed (`packing: true`; recorded as "not available: <the recipe error>" where this vembed has
  no such key), on flash-attention's unpadded kernels where flash-attn is installed, and sentence-transformers'
  MultipleNegativesRankingLoss step on the same folder and texts; the ratios packed/padded and
  packed/sentence-transformers, the planner's estimate beside each vembed path's peak, and every vembed path's
  embeddings checked against each text encoded alone (no padding anywhere) to bf16 tolerance.
- cross_encoder_speed: bench/rerank_vs_st.py's job (MiniLM-L6 shapes, pointwise BCE), 64 lists of 4 pairs: vembed's
  reranker step against sentence-transformers' CrossEncoder step.
- colbert_speed: bench/colbert_vs_pylate.py's job (MiniLM-L6 shapes, MaxSim contrastive with a hard negative), batch
  128: vembed's ColBERT step against PyLate's, PyLate in a child process on its own pinned stack
  (gpu-wheels/pylate-stack/, installed with `--target` into the step's folder, never over the machine's packages).
- levers (bench/gpu_levers.py): the loop's real step (its per-step host sync for the NaN check) against the bare
  step, fused against foreach AdamW (packed MiniLM shapes), and compiled against eager CLIP ViT-B/32 (GPU only).
- qwen_memory (not in the default run: measured twice, identical): Qwen3-VL-2B shapes (bench/configs/qwen3_vl_2b.json,
  random init) with LoRA r32 + GradCache, batch 1024, chunk 32, the shipped 2B recipe otherwise: peak memory and step
  time, and the planner's estimate for it.

A step returns its numbers and a one-line `summary` for the table; it raises `Skipped` when it cannot run here (the
reason is recorded), anything else is a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
WHEELS = ROOT / "gpu-wheels"
RESULT_MARK = "GPU_CHECK_RESULT "
# The one reason the speed step may be skipped by: open_clip cannot be imported (not installed, or its torchvision
# does not load, as PyPI's CUDA torchvision does not on a CPU-only torch). The dry-run test accepts only this.
OPEN_CLIP_UNAVAILABLE = "open_clip not importable"
BF16_COSINE = 0.995  # embeddings agree to bf16 tolerance: cosine similarity of each pair at least this


class Skipped(Exception):
    """This step cannot run on this machine; the message says why."""


@dataclass
class Context:
    dry_run: bool
    work: Path  # this step's scratch folder
    budget_s: float
    wheels: Path = WHEELS  # gpu-wheels/: the colbert step installs PyLate's stack from it

    @property
    def device(self) -> str:
        return "cpu" if self.dry_run else "cuda"

    def sync(self) -> None:
        if not self.dry_run:
            import torch

            torch.cuda.synchronize()


@dataclass(frozen=True)
class Step:
    run: Callable[[Context], dict[str, Any]]
    budget_s: int  # on the GPU machine
    dry_budget_s: int  # a guard against hangs: a dry step takes 10-30 s on 2 idle cores, several times that when shared


# --- shared helpers --------------------------------------------------------------------------------------------------
def _env() -> dict[str, str]:
    # NVIDIA_TF32_OVERRIDE stays as it is: bf16 runs are what these steps time.
    return dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false",
                TRANSFORMERS_VERBOSITY="error", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                                                     os.environ.get("PYTHONPATH")])))


def _bench_module(name: str):
    sys.path.insert(0, str(BENCH))
    import importlib

    return importlib.import_module(name)


def _trainer(raw: dict[str, Any]):
    """A built Trainer (model, optimizer, accelerator) for `raw`; steps are driven by hand, as bench/ does."""
    from vembed.components import recipe_from_dict
    from vembed.training.loop import Trainer

    trainer = Trainer(recipe_from_dict({"seed": 0, "eval_before_training": False, "save_steps": None,
                                        "scheduler_type": "constant", **raw}))
    trainer.build()
    return trainer


def _optimizer_step(trainer, batch) -> None:
    trainer.train_step(batch)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)


def _timed(step: Callable[[], None], ctx: Context, steps: int) -> float:
    """Median seconds of `steps` calls of `step`, each synchronised."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        ctx.sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@dataclass
class Contender:
    """One system of a speed step: its training step (a closure over its batch) and what it keeps resident between
    steps (its model's parameters and buffers, its optimizer's state)."""
    step: Callable[[], None]
    model: Any
    optimizer: Any

    def resident_bytes(self) -> int:
        import torch

        state = [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        tensors = [*self.model.parameters(), *self.model.buffers(), *state]
        return sum(t.numel() * t.element_size() for t in tensors if t.device.type == "cuda")


def _race(systems: dict[str, Contender], shape: dict[str, Any], ctx: Context) -> dict[str, dict[str, Any]]:
    """Each system's median step seconds per round (warm-up steps first), interleaved and rotated so drift hits every
    system alike; and its peak CUDA memory (None on the CPU): what it keeps resident plus the most its own steps
    allocated above what was allocated when they began (every system lives in this one process, so the process peak
    would count the others' models too)."""
    import torch

    measured = {name: {"round_seconds": [], "peak_bytes": None} for name in systems}
    names = list(systems)
    for round_index in range(shape["rounds"]):
        for name in names[round_index % len(names):] + names[:round_index % len(names)]:
            system = systems[name]
            _timed(system.step, ctx, shape["warmup"])
            if not ctx.dry_run:
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            measured[name]["round_seconds"].append(_timed(system.step, ctx, shape["steps"]))
            if not ctx.dry_run:
                peak = system.resident_bytes() + torch.cuda.max_memory_allocated() - before
                measured[name]["peak_bytes"] = max(measured[name]["peak_bytes"] or 0, peak)
    return measured


def _training_flops(adapter, batch: dict[str, Any]) -> float:
    """Model FLOPs of one training step on `batch`: 3x the forward FLOPs of every side (vembed/models/flops.py), as
    the loop's MFU counts them. A peer doing the same work (same model, same tokens) is given the same count. Adapters
    without `forward_flops` (the cross-encoder) are counted by the same dense rule over all their weights."""
    from vembed.models.flops import TRAINING_FLOPS_PER_FORWARD, matmul_weights, text_flops

    count = getattr(adapter, "forward_flops", None)
    if count is None:
        weights = matmul_weights(adapter)

        def count(inputs):
            return text_flops(inputs, weights)

    return TRAINING_FLOPS_PER_FORWARD * sum(float(count(inputs)) for inputs in batch.values()
                                            if isinstance(inputs, dict))


def _peak_flops(ctx: Context) -> tuple[float, str]:
    """The device's peak FLOP/s at the steps' precision and where it came from: vembed's table of accelerators by
    card name (bf16), or on the CPU (dry run, float32) a measured matmul ceiling (vembed/training/throughput.py)."""
    import torch

    from vembed.training.throughput import peak_flops

    return peak_flops(torch.device(ctx.device), "no" if ctx.dry_run else "bf16")


def _speed_rows(measured: dict[str, dict[str, Any]], samples: int, flops: float, ctx: Context) -> dict[str, Any]:
    """Per system: samples/s of the median round, MFU (one step's model FLOPs over its time, over the peak) and peak
    memory in GiB; with the FLOPs and the peak they came from."""
    peak, source = _peak_flops(ctx)
    rows: dict[str, Any] = {}
    for name, m in measured.items():
        seconds = statistics.median(m["round_seconds"])
        rows[name] = {"samples_per_second": samples / seconds, "round_seconds": m["round_seconds"],
                      "mfu": flops / seconds / peak,
                      "peak_gib": None if m["peak_bytes"] is None else m["peak_bytes"] / 2**30}
    rows["training_flops_per_step"] = flops
    rows["peak_flops"] = {"flops_per_second": peak, "source": source}
    return rows


def _rate_line(rows: dict[str, Any]) -> str:
    """`name N samples/s (MFU x%, y GiB)` for every measured system of `rows`."""
    parts = []
    for name, row in rows.items():
        if isinstance(row, dict) and "samples_per_second" in row:
            memory = "" if row["peak_gib"] is None else f", {row['peak_gib']:.2f} GiB"
            parts.append(f"{name} {row['samples_per_second']:.0f} samples/s (MFU {row['mfu']:.1%}{memory})")
    return "; ".join(parts)


def _ratio(rows: dict[str, Any], ours: str, theirs: str) -> float:
    return rows[ours]["samples_per_second"] / rows[theirs]["samples_per_second"]


def _adamw(model, ctx: Context, **settings):
    """AdamW as a peer's trainer builds it (transformers' Trainer picks the fused kernel on CUDA)."""
    import torch

    return torch.optim.AdamW(model.parameters(), fused=not ctx.dry_run, **settings)


# --- step: environment -----------------------------------------------------------------------------------------------
VERSIONS = ("torch", "transformers", "accelerate", "peft", "sentence-transformers", "datasets", "pydantic",
            "open_clip_torch", "flash_attn", "pytest", "vembed")


def _installed(distribution: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def missing_wheels(folder: Path) -> list[Path]:
    """The wheels of `folder` whose distributions are not installed, and vembed's always (this checkout's code)."""
    import re

    return [wheel for wheel in sorted(folder.glob("*.whl"))
            if (name := wheel.name.split("-")[0]) == "vembed" or _installed(re.sub(r"[-_.]+", "-", name)) is None]


def install_missing_wheels(folder: Path, timeout: float) -> list[str]:
    """`pip install --no-deps` the missing wheels of `folder` (no index: the machine has no network); their names."""
    wanted = missing_wheels(folder)
    if wanted:
        env = dict(_env(), PIP_BREAK_SYSTEM_PACKAGES="1")  # a lent machine is handed back bare afterwards
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--force-reinstall",
                        *map(str, wanted)], check=True, env=env, capture_output=True, text=True, timeout=timeout)
    return [wheel.name for wheel in wanted]


def environment(ctx: Context, wheels: Path | None) -> dict[str, Any]:
    installed, deadline = [], time.monotonic() + ctx.budget_s
    if wheels is not None and not ctx.dry_run:
        if not wheels.is_dir():
            raise RuntimeError(f"no wheel folder {wheels}: run `make gpu-wheels` first and carry gpu-wheels/")
        installed = install_missing_wheels(wheels, ctx.budget_s)
    # After the install, in a fresh interpreter: this one has already looked at what was there before.
    probe = ("import json, torch; from importlib.metadata import version, PackageNotFoundError\n"
             "def v(d):\n try: return version(d)\n except PackageNotFoundError: return None\n"
             f"print(json.dumps({{'versions': {{d: v(d) for d in {list(VERSIONS)!r}}}, "
             "'cuda': torch.version.cuda, 'gpus': torch.cuda.device_count(), "
             "'card': torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu'}))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=_env(),
                          timeout=max(deadline - time.monotonic(), 5))
    if done.returncode:
        raise RuntimeError(done.stderr.strip().splitlines()[-1])
    found = json.loads(done.stdout.strip().splitlines()[-1])
    missing = [d for d in ("torch", "transformers", "accelerate", "peft", "pydantic", "datasets", "pytest")
               if found["versions"][d] is None]
    if missing:
        raise RuntimeError(f"missing {', '.join(missing)}: add them to gpu-wheels/ (make gpu-wheels)")
    found["installed_wheels"] = installed
    versions = ", ".join(f"{d} {found['versions'][d]}" for d in ("torch", "transformers", "accelerate"))
    found["summary"] = f"{found['gpus']} GPU(s), CUDA {found['cuda']}; {versions}; {len(installed)} wheels installed"
    return found


def _samples_for(batch: int) -> int:
    """How many synthetic samples fill one training batch: make_dummy_dataset keeps ~70% for training."""
    return int(batch / 0.68) + 16


# --- step: tests/gpu -------------------------------------------------------------------------------------------------
def gpu_tests(ctx: Context) -> dict[str, Any]:
    import xml.etree.ElementTree as ET

    report = ctx.work / "junit.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", f"--junitxml={report}",
               str(ROOT / "tests" / "gpu")]
    done = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=max(ctx.budget_s - 10, 10))
    print(done.stdout, done.stderr, sep="\n")  # the whole pytest report goes to this step's log
    if not report.is_file():  # pytest never ran: say why in the table, not as a FileNotFoundError of its report
        if "No module named pytest" in done.stderr:
            raise RuntimeError("pytest is not installed: pip install -e '.[dev]' here, or make gpu-wheels for the "
                               "GPU machine")
        raise RuntimeError(f"pytest wrote no report: {(done.stderr.strip().splitlines() or ['no output'])[-1]}")
    cases = ET.parse(report).getroot().iter("testcase")
    passed, failed, skipped = [], [], {}
    for case in cases:
        name = case.get("name")
        outcome = next(iter(case), None)
        if outcome is None:
            passed.append(name)
        elif outcome.tag == "skipped":
            skipped[name] = (outcome.get("message") or "").removeprefix("Skipped: ")
        else:  # the assertion's own line, so the table says what broke
            failed.append(f"{name}: {(outcome.get('message') or outcome.tag).splitlines()[0][:200]}")
    if failed or done.returncode not in (0, 5):
        tail = done.stdout.strip().splitlines()[-1:] or done.stderr.strip().splitlines()[-1:]
        raise RuntimeError(f"{len(failed)} failed ({'; '.join(failed)}): {' '.join(tail)}")
    reasons = sorted(set(skipped.values()))
    return {"passed": passed, "skipped": skipped,
            "summary": f"{len(passed)} passed, {len(skipped)} skipped" + (f" ({'; '.join(reasons)})" if reasons
                                                                           else "")}


# --- step: CLIP speed against open_clip ------------------------------------------------------------------------------
CLIP_SHAPES = {"batch": 256, "warmup": 3, "steps": 10, "rounds": 3}
CLIP_DRY = {"batch": 8, "warmup": 1, "steps": 2, "rounds": 2}
TINY_CLIP_SHAPE = {  # ViT-B/32's layout at toy size: the same code paths
    "projection_dim": 16,
    "text_config": {"vocab_size": 49408, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                    "num_attention_heads": 2, "max_position_embeddings": 77, "hidden_act": "quick_gelu"},
    "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                      "image_size": 64, "patch_size": 32, "num_channels": 3, "hidden_act": "quick_gelu"},
}


def open_clip_model(config: dict[str, Any]):
    """open_clip's CLIP with the shapes of an HF CLIPConfig dict (the same file builds both sides)."""
    import open_clip

    text, vision = config["text_config"], config["vision_config"]
    return open_clip.CLIP(
        embed_dim=config["projection_dim"],
        vision_cfg={"image_size": vision["image_size"], "layers": vision["num_hidden_layers"],
                    "width": vision["hidden_size"], "patch_size": vision["patch_size"],
                    "head_width": vision["hidden_size"] // vision["num_attention_heads"],
                    "mlp_ratio": vision["intermediate_size"] / vision["hidden_size"]},
        text_cfg={"context_length": text["max_position_embeddings"], "vocab_size": text["vocab_size"],
                  "width": text["hidden_size"], "heads": text["num_attention_heads"],
                  "layers": text["num_hidden_layers"], "mlp_ratio": text["intermediate_size"] / text["hidden_size"]},
        quick_gelu=text.get("hidden_act") == "quick_gelu",
    )


def clip_speed(ctx: Context) -> dict[str, Any]:
    from accelerate.utils import send_to_device
    from transformers import AutoTokenizer

    from vembed.data.synthetic import make_dummy_dataset
    from vembed.data.tokenizer import special_token_ids

    shape = CLIP_DRY if ctx.dry_run else CLIP_SHAPES
    config = TINY_CLIP_SHAPE if ctx.dry_run else json.loads((BENCH / "configs/clip_vit_base_patch32.json").read_text())
    config = json.loads(json.dumps(config))
    tokens = config["text_config"]["max_position_embeddings"]  # open_clip's text tower takes exactly its context
    make_dummy_dataset(ctx.work / "data", _samples_for(shape["batch"]), seed=0,
                       image_size=config["vision_config"]["image_size"])
    config["text_config"].update(special_token_ids(AutoTokenizer.from_pretrained(ctx.work / "data" / "tokenizer")))
    trainer = _trainer({"model_type": "clip", "model_config": config,
                        "tokenizer_name": str(ctx.work / "data/tokenizer"),
                        "data": {"train": str(ctx.work / "data/train.jsonl"), "num_hard_negatives": 0},
                        "output_dir": str(ctx.work / "run"), "batch_size": shape["batch"], "max_length": tokens,
                        "mixed_precision": "no" if ctx.dry_run else "bf16", "attn_implementation": "sdpa",
                        "learning_rate": 1e-4})
    side = _bench_module("planner_accuracy").synthetic_side
    adapter = trainer.objective.adapter
    batch = send_to_device({"query": side(adapter, "text", shape["batch"], tokens),
                            "positive": side(adapter, "image", shape["batch"], 0), "num_negatives": 0},
                           trainer.accelerator.device)
    systems = {"vembed": _vembed_contender(trainer, batch)}
    try:
        import open_clip
    except Exception as error:  # noqa: BLE001 - ImportError, or torchvision's RuntimeError on a mismatched torch
        open_clip, reason = None, f"{OPEN_CLIP_UNAVAILABLE}: {type(error).__name__}: {error}".splitlines()[0]
    if open_clip is not None:
        systems["open_clip"] = _open_clip_step(open_clip_model(config), batch, ctx)
    measured = _race(systems, shape, ctx)
    result = _speed_rows(measured, shape["batch"], _training_flops(adapter, batch), ctx)
    result["shape"] = {**shape, "text_tokens": tokens, "image_size": config["vision_config"]["image_size"]}
    if open_clip is None:
        raise Skipped(f"{reason} (vembed alone: {_rate_line(result)})")
    seconds = {name: m["round_seconds"] for name, m in measured.items()}
    ratio = statistics.median(o / v for v, o in zip(seconds["vembed"], seconds["open_clip"]))
    result["vembed_over_open_clip"] = ratio
    result["summary"] = f"{_rate_line(result)}: {ratio:.2f}x open_clip (batch {shape['batch']})"
    return result


def _vembed_contender(trainer, batch: dict[str, Any]) -> Contender:
    return Contender(lambda: _optimizer_step(trainer, batch), trainer.objective, trainer.optimizer)


def _open_clip_step(model, batch: dict[str, Any], ctx: Context) -> Contender:
    """open_clip_train's step on vembed's tensors: autocast bf16, model(images, texts), ClipLoss, AdamW (its betas and
    eps), logit scale clamped."""
    import math

    import torch
    from open_clip.loss import ClipLoss

    from vembed.models.batch import PIXEL_VALUES

    device = torch.device(ctx.device)
    model = model.to(device).train()
    images, texts = batch["positive"][PIXEL_VALUES], batch["query"]["input_ids"]
    loss_fn = ClipLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-6)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=not ctx.dry_run):
            image_features, text_features, logit_scale = model(images, texts)[:3]
            loss = loss_fn(image_features, text_features, logit_scale)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))

    return Contender(step, model, optimizer)


# --- step: Qwen3-VL-2B memory and the planner ------------------------------------------------------------------------
QWEN = {"batch": 1024, "chunk": 32, "image_size": 256}  # 256 px: 256 patches of 16 px, 64 image tokens
QWEN_DRY = {"batch": 8, "chunk": 2, "image_size": 32}


def qwen_memory(ctx: Context) -> dict[str, Any]:
    import torch
    import yaml
    from accelerate.utils import send_to_device

    from vembed.data.synthetic import make_dummy_dataset
    from vembed.data.tokenizer import train_qwen_tokenizer
    from vembed.models.qwen_vl import VISION_TOKEN_IDS

    shape = QWEN_DRY if ctx.dry_run else QWEN
    recipe_file = yaml.safe_load((ROOT / "configs/qwen3_vl_embedding_2b.yaml").read_text())
    model_config = (yaml.safe_load((ROOT / "configs/qwen3_vl_tiny.yaml").read_text())["model_config"] if ctx.dry_run
                    else json.loads((BENCH / "configs/qwen3_vl_2b.json").read_text()))
    for name in VISION_TOKEN_IDS:  # the released ids do not exist in the small trained tokenizer: take its ids
        model_config.pop(name, None)
    data = ctx.work / "data"
    make_dummy_dataset(data, _samples_for(shape["batch"]), seed=0, image_size=shape["image_size"])
    rows = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    train_qwen_tokenizer([r["query"] for r in rows] + [recipe_file["query_instruction"],
                                                       recipe_file["document_instruction"]], data / "tokenizer")
    pixels = shape["image_size"] ** 2
    raw = {**recipe_file, "model_name": None, "model_config": model_config, "tokenizer_name": str(data / "tokenizer"),
           "data": {"train": str(data / "train.jsonl"), "image_root": str(data), "num_hard_negatives": 0},
           "output_dir": str(ctx.work / "run"), "batch_size": shape["batch"], "use_gradient_cache": True,
           "gradient_cache_chunk_size": shape["chunk"], "use_lora": True, "lora_r": 32, "min_pixels": pixels,
           "max_pixels": pixels, "eval_steps": None, "epochs": 1, "train_vision_tower": ctx.dry_run}
    if ctx.dry_run:
        raw.update(mixed_precision="no", mrl_dims=[32, 16])
    estimate, estimated_gib = _planner(raw, "ddp+gradcache", ctx)
    trainer = _trainer(raw)
    batch = send_to_device(trainer.collate([trainer.dataset[i] for i in range(shape["batch"])]),
                           trainer.accelerator.device)
    tokens = {side: int(batch[side]["attention_mask"].sum(1).float().mean()) for side in ("query", "positive")}
    _optimizer_step(trainer, batch)  # warm-up: AdamW's state, allocator caches
    ctx.sync()
    if ctx.dry_run:
        peak_reader = _rss_peak()
    else:
        torch.cuda.reset_peak_memory_stats()
    step_s = _timed(lambda: _optimizer_step(trainer, batch), ctx, 1)
    if ctx.dry_run:
        peak, what = peak_reader(), "peak RSS (CPU)"
    else:
        peak, what = torch.cuda.max_memory_allocated(), "max_memory_allocated"
    measured_gib = peak / 2**30
    return {"peak_gib": measured_gib, "peak_measured_as": what, "step_seconds": step_s,
            "samples_per_second": shape["batch"] / step_s, "planner": estimate, "planner_gib": estimated_gib,
            "planner_over_measured": estimated_gib / measured_gib, "mean_tokens": tokens, "shape": shape,
            "summary": f"peak {measured_gib:.2f} GiB ({what}), planner {estimated_gib:.2f} GiB "
                       f"({estimated_gib / measured_gib:.2f}x); step {step_s:.1f} s (batch {shape['batch']}, "
                       f"chunk {shape['chunk']})"}


def _planner(raw: dict[str, Any], strategy: str, ctx: Context) -> tuple[str, float]:
    """The planner's line for the recipe `raw` on one device (what a run prints at its start) and its total in GiB."""
    from vembed.components import recipe_from_dict
    from vembed.planning import estimate_line

    line = estimate_line(recipe_from_dict(raw), strategy, 1, device=ctx.device).strip()
    return line, float(line.split()[2]) * (1 if " GiB " in line else 1 / 1024)  # the line's own unit


def _rss_peak() -> Callable[[], int]:
    process_memory = _bench_module("process_memory")
    process_memory.reset_peak_rss()
    return process_memory.peak_rss_bytes


# --- step: text speed against sentence-transformers ------------------------------------------------------------------
TEXT = {"batch": 256, "chunks": 4, "warmup": 2, "steps": 5, "rounds": 2, "max_length": 256}
TEXT_DRY = {"batch": 16, "chunks": 4, "warmup": 1, "steps": 1, "rounds": 1, "max_length": 64}
PACKED = "vembed packed"
ST = "sentence-transformers"


def text_speed(ctx: Context) -> dict[str, Any]:
    from accelerate.utils import send_to_device

    shape = TEXT_DRY if ctx.dry_run else TEXT
    throughput = _bench_module("throughput")
    rows = throughput._uneven_rows(shape["batch"] * 2)
    throughput._write_jsonl(ctx.work / "train.jsonl", rows)
    model_dir = _minilm_folder(ctx, rows)
    raw = {"model_type": "text", "model_name": model_dir, "pooling": "mean", "symmetric_loss": False,
           "temperature": 0.05, "data": {"train": str(ctx.work / "train.jsonl"), "num_hard_negatives": 0},
           "output_dir": str(ctx.work / "run"), "batch_size": shape["batch"], "max_length": shape["max_length"],
           "mixed_precision": "no" if ctx.dry_run else "bf16", "attn_implementation": "sdpa", "learning_rate": 2e-5}
    padded = _trainer(raw)
    batch = send_to_device(padded.collate([padded.dataset[i] for i in range(shape["batch"])]),
                           padded.accelerator.device)
    chunked = f"vembed length_chunks={shape['chunks']}"
    vembed_runs = {"vembed padded": (padded, 1, raw), chunked: (padded, shape["chunks"],
                                                                {**raw, "length_chunks": shape["chunks"]})}
    packed, unavailable = _packed_trainer(raw, ctx)
    if packed is not None:
        packed.objective.load_state_dict(padded.objective.state_dict())
        vembed_runs[PACKED] = (packed, 1, {**raw, "packing": True})
    flash = _flash_trainer(raw, padded, ctx)
    if flash is not None:
        vembed_runs["vembed flash_attention_2 (unpadded)"] = (flash, 1, {**raw, "attn_implementation":
                                                                          "flash_attention_2"})
    systems = {name: _chunked_contender(trainer, chunks, batch) for name, (trainer, chunks, _) in vembed_runs.items()}
    systems[ST] = _st_mnrl_step(model_dir, rows[:shape["batch"]], shape["max_length"], ctx)
    result = _speed_rows(_race(systems, shape, ctx), shape["batch"],
                         _training_flops(padded.objective.adapter, batch), ctx)
    for name, (trainer, chunks, recipe) in vembed_runs.items():
        result[name]["planner"], result[name]["planner_gib"] = _planner(recipe, "single", ctx)
        if result[name]["peak_gib"]:
            result[name]["planner_over_measured"] = result[name]["planner_gib"] / result[name]["peak_gib"]
    result[PACKED] = result.get(PACKED) or f"not available: {unavailable}"
    result["agreement"] = _check_unpadded(vembed_runs, padded, batch["query"], ctx)
    mask = batch["query"]["attention_mask"]
    result["query_tokens"] = {"mean": mask.sum(1).float().mean().item(), "max": mask.shape[1]}
    result["shape"] = shape
    result["ratios"] = {"vembed padded / sentence-transformers": _ratio(result, "vembed padded", ST)}
    if packed is not None:
        result["ratios"].update({"packed / padded": _ratio(result, PACKED, "vembed padded"),
                                 "packed / sentence-transformers": _ratio(result, PACKED, ST)})
    off = {name: a for name, a in result["agreement"].items() if a < BF16_COSINE}
    if off:  # a failure, with the speeds it measured kept: in the error line, and whole in the step's log
        print(json.dumps(result, default=str))
        raise RuntimeError(f"embeddings differ from the unpadded reference beyond bf16 tolerance: {off} (speeds: "
                           f"{_rate_line(result)})")
    ratios = ", ".join(f"{name} {value:.2f}x" for name, value in result["ratios"].items())
    planner = result["vembed padded"]
    result["summary"] = (f"{_rate_line(result)}; {ratios}; packed: {'measured' if packed else result[PACKED]}; "
                         f"planner (padded) {planner['planner_gib']:.2f} GiB; all vembed paths within bf16 of each "
                         f"text alone (min cosine {min(result['agreement'].values()):.4f})")
    return result


def _packed_trainer(raw: dict[str, Any], ctx: Context):
    """vembed with `packing: true` (every text of a side in one row, no padding), or None and the one line saying why
    this vembed cannot build it (the key is new: a recipe error names it)."""
    from vembed.errors import RecipeError

    try:
        return _trainer({**raw, "packing": True, "output_dir": str(ctx.work / "packed")}), None
    except RecipeError as error:
        return None, str(error).splitlines()[0]


def _flash_trainer(raw: dict[str, Any], padded, ctx: Context):
    """vembed on flash-attention's unpadded kernels where flash-attn is installed (never in a dry run), else None."""
    import importlib.util

    if ctx.dry_run or importlib.util.find_spec("flash_attn") is None:
        return None
    trainer = _trainer({**raw, "attn_implementation": "flash_attention_2", "output_dir": str(ctx.work / "fa")})
    trainer.objective.load_state_dict(padded.objective.state_dict())
    return trainer


def _chunked_contender(trainer, chunks: int, batch: dict[str, Any]) -> Contender:
    """`trainer`'s step with its sides encoded in `chunks` length-sorted groups (one trainer serves padded and
    chunked: the setting is read at every step)."""
    def step() -> None:
        trainer.objective.length_chunks = chunks
        _optimizer_step(trainer, batch)

    return Contender(step, trainer.objective, trainer.optimizer)


def _st_mnrl_step(model_dir: str, rows: list[dict[str, str]], max_length: int, ctx: Context) -> Contender:
    """sentence-transformers' training step on the same folder and texts: Transformer + mean Pooling,
    MultipleNegativesRankingLoss(scale=20) (one direction: vembed's temperature 0.05, `symmetric_loss: false`), bf16
    autocast, AdamW; its texts tokenised before the step, as its data collator does."""
    import torch
    from accelerate.utils import send_to_device
    from sentence_transformers import SentenceTransformer, losses, models

    transformer = models.Transformer(model_dir, max_seq_length=max_length)
    model = SentenceTransformer(modules=[transformer, models.Pooling(transformer.get_word_embedding_dimension(),
                                                                     "mean")], device=ctx.device)
    features = [send_to_device(dict(model.tokenize([r[column] for r in rows])), torch.device(ctx.device))
                for column in ("query", "positive")]
    loss_fn = losses.MultipleNegativesRankingLoss(model, scale=20.0)
    optimizer = _adamw(model, ctx, lr=2e-5)

    def step() -> None:
        with torch.autocast(ctx.device, dtype=torch.bfloat16, enabled=not ctx.dry_run):
            loss = loss_fn(features, None)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return Contender(step, model, optimizer)


def _check_unpadded(runs: dict[str, tuple[Any, int, Any]], padded, queries: dict[str, Any], ctx: Context
                    ) -> dict[str, float]:
    """The smallest cosine of each vembed path's embeddings to the exact reference (each text alone, no padding), on
    one copy of the weights (training moved them apart)."""
    import torch

    for trainer, _, _ in runs.values():
        if trainer is not padded:
            trainer.objective.load_state_dict(padded.objective.state_dict())
    reference = _embed_each_alone(padded, queries, ctx)
    agreement = {}
    for name, (trainer, chunks, _) in runs.items():
        trainer.objective.length_chunks = chunks
        embeddings = _embed(trainer, queries, ctx)
        agreement[name] = torch.nn.functional.cosine_similarity(embeddings, reference).min().item()
    return agreement


def _minilm_folder(ctx: Context, rows: list[dict[str, str]]) -> str:
    """A BERT folder with MiniLM-L6's shape (bench/configs), random init; bench/throughput.py's toy one in a dry run."""
    throughput = _bench_module("throughput")
    return throughput._text_model(ctx.work, rows, smoke=True) if ctx.dry_run else _random_minilm(ctx.work, rows)


def _random_minilm(work: Path, rows: list[dict[str, str]]) -> str:
    import torch
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    from vembed.data.tokenizer import train_tokenizer

    folder = work / "minilm"
    train_tokenizer([r["query"] for r in rows] + [r["positive"] for r in rows], folder, vocab_size=512,
                    max_length=TEXT["max_length"])
    tokenizer = AutoTokenizer.from_pretrained(folder)
    shape = json.loads((BENCH / "configs/all_minilm_l6_v2.json").read_text())
    config = AutoConfig.for_model(shape.pop("model_type"), **{**shape, "pad_token_id": tokenizer.pad_token_id or 0})
    torch.manual_seed(0)
    AutoModel.from_config(config).save_pretrained(folder)
    return str(folder)


def _embed(trainer, inputs: dict[str, Any], ctx: Context):
    import torch

    objective = trainer.objective.eval()
    with torch.no_grad(), trainer.accelerator.autocast():
        embeddings = objective.encode_side(inputs).float()
    objective.train()
    return embeddings


def _embed_each_alone(trainer, inputs: dict[str, Any], ctx: Context):
    """Each text encoded on its own, trimmed to its length: no padding anywhere (the exact reference)."""
    import torch

    from vembed.models.length_chunks import select_rows, trim_padding

    objective = trainer.objective.eval()
    rows = []
    with torch.no_grad(), trainer.accelerator.autocast():
        for row in range(len(inputs["attention_mask"])):
            one = trim_padding(select_rows(inputs, torch.tensor([row], device=inputs["attention_mask"].device)))
            rows.append(objective.adapter(one).float())
    objective.train()
    return torch.cat(rows)


# --- step: cross-encoder speed against sentence-transformers ------------------------------------------------------
CROSS = {"lists": 64, "negatives": 3, "warmup": 2, "steps": 5, "rounds": 2}  # 256 pairs a step
CROSS_DRY = {"lists": 4, "negatives": 3, "warmup": 1, "steps": 1, "rounds": 1}
RERANK_HELDOUT = 4  # bench/rerank_vs_st.py's job also writes held-out queries; this step does not judge them


def cross_encoder_speed(ctx: Context) -> dict[str, Any]:
    """bench/rerank_vs_st.py's job (MiniLM-L6 shapes, random init, a fresh one-logit head; pointwise BCE) at step
    level: vembed's reranker step against sentence-transformers' CrossEncoder step on the same lists, interleaved."""
    from accelerate.utils import send_to_device

    shape = CROSS_DRY if ctx.dry_run else CROSS
    rerank = _bench_module("rerank_vs_st")
    spec = {**rerank.prepare(ctx.work / "job", shape["lists"], RERANK_HELDOUT, shape["negatives"], shape["lists"],
                             smoke=ctx.dry_run, minilm_shapes=not ctx.dry_run),
            "loss": "bce", "device": ctx.device, "learning_rate": 1e-4, "num_workers": 0, "tag": "gpu-check"}
    raw = {**rerank.vembed_recipe(spec), "scheduler_type": "constant", "warmup_ratio": 0.0}
    trainer = _trainer(raw)
    lists = spec["order"][:shape["lists"]]
    batch = send_to_device(trainer.collate([trainer.dataset[i] for i in lists]), trainer.accelerator.device)
    systems = {"vembed": _vembed_contender(trainer, batch),
               ST: _st_cross_encoder_step(spec, rerank.ordered_lists(spec)[:shape["lists"]], rerank, ctx)}
    packed, unavailable = _packed_trainer(raw, ctx)
    if packed is not None:  # the same weights, the encoder stack run packed under the score head
        packed.objective.load_state_dict(trainer.objective.state_dict())
        systems[PACKED] = _vembed_contender(packed, batch)
    pairs = shape["lists"] * (shape["negatives"] + 1)
    result = _speed_rows(_race(systems, shape, ctx), pairs, _training_flops(trainer.objective.adapter, batch), ctx)
    result["vembed_over_sentence_transformers"] = _ratio(result, "vembed", ST)
    result[PACKED] = result.get(PACKED) or f"not available: {unavailable}"
    if packed is not None:
        result["packed_over_sentence_transformers"] = _ratio(result, PACKED, ST)
    result["shape"] = {**shape, "pairs": pairs, "max_length": rerank.MAX_LENGTH, "model": spec["model"]}
    packed_line = (f", packed {result['packed_over_sentence_transformers']:.2f}x" if packed is not None
                   else f" (packed {result[PACKED]})")
    result["summary"] = (f"pairs/s: {_rate_line(result).replace(' samples/s', '')}; "
                         f"{result['vembed_over_sentence_transformers']:.2f}x sentence-transformers{packed_line} "
                         f"({pairs} pairs a step; theirs tokenises inside its step, as its CrossEncoder losses do)")
    return result


def _st_cross_encoder_step(spec: dict[str, Any], rows: list[dict[str, Any]], rerank, ctx: Context) -> Contender:
    """sentence-transformers' CrossEncoder step on the same lists as pairs (bench/rerank_vs_st.py's columns and loss):
    the loss tokenises the pairs and scores them, backward, clipping at 1.0, AdamW with weight decay 0.01."""
    import torch
    from sentence_transformers.cross_encoder import CrossEncoder

    model = CrossEncoder(spec["start"], device=ctx.device)
    pairs = rerank.pointwise_pairs(rows)
    labels = torch.tensor(pairs["label"], device=ctx.device)
    loss_fn = rerank.LOSSES[spec["loss"]][1](model)
    optimizer = _adamw(model, ctx, lr=spec["learning_rate"], weight_decay=rerank.WEIGHT_DECAY)

    def step() -> None:
        with torch.autocast(ctx.device, dtype=torch.bfloat16, enabled=not ctx.dry_run):
            loss = loss_fn([pairs["query"], pairs["document"]], labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return Contender(step, model, optimizer)


# --- step: ColBERT speed against PyLate ------------------------------------------------------------------------------
COLBERT = {"batch": 128, "warmup": 2, "steps": 5, "rounds": 2}  # a query, its positive and a hard negative a row
COLBERT_DRY = {"batch": 8, "warmup": 1, "steps": 1, "rounds": 1}
# The one reason the ColBERT step may be skipped by: no PyLate stack (PyLate 1.6 pins sentence-transformers 5.3 and
# transformers <= 5.3, so it runs on its own stack, never the machine's). The dry-run test accepts only this.
PYLATE_UNAVAILABLE = "PyLate's stack not found"
PYLATE_STACK = "pylate-stack"  # gpu-wheels/pylate-stack/: its wheels (scripts/gpu_wheels.py)


def colbert_speed(ctx: Context) -> dict[str, Any]:
    """bench/colbert_vs_pylate.py's job (MiniLM-L6 shapes, random init; in-batch contrastive over MaxSim with one hard
    negative) at step level: vembed's step in this process, then PyLate's (bench/colbert_vs_pylate.py's
    `time_pylate_steps`) in a child on PyLate's own stack (it cannot share a process with the machine's transformers,
    so its rounds follow vembed's instead of interleaving)."""
    from accelerate.utils import send_to_device

    shape = COLBERT_DRY if ctx.dry_run else COLBERT
    stack = _pylate_stack(ctx)
    colbert = _bench_module("colbert_vs_pylate")
    minilm = None if ctx.dry_run else json.loads((BENCH / "configs/all_minilm_l6_v2.json").read_text())
    spec = {**colbert.prepare(ctx.work / "job", shape["batch"], shape["batch"], ctx.dry_run,
                              colbert.SMOKE["documents"] if ctx.dry_run else None, colbert.LEARNING_RATE, minilm),
            "device": ctx.device, "tag": "gpu-check", **{k: shape[k] for k in ("warmup", "steps", "rounds")}}
    raw = colbert.vembed_recipe(spec)
    trainer = _trainer(raw)
    batch = send_to_device(trainer.collate([trainer.dataset[i] for i in spec["order"][:shape["batch"]]]),
                           trainer.accelerator.device)
    systems = {"vembed": _vembed_contender(trainer, batch)}
    packed, unavailable = _packed_trainer(raw, ctx)
    if packed is not None:
        packed.objective.load_state_dict(trainer.objective.state_dict())
        systems[PACKED] = _vembed_contender(packed, batch)
    measured = _race(systems, shape, ctx)
    pylate = colbert.run_in_child(colbert.__file__, "pylate_steps", spec, str(stack), "PyLate")
    measured["pylate"] = {"round_seconds": pylate["round_seconds"], "peak_bytes": pylate["peak_bytes"]}
    result = _speed_rows(measured, shape["batch"], _training_flops(trainer.objective.adapter, batch), ctx)
    result["vembed_over_pylate"] = _ratio(result, "vembed", "pylate")
    result[PACKED] = result.get(PACKED) or f"not available: {unavailable}"
    if packed is not None:
        result["packed_over_pylate"] = _ratio(result, PACKED, "pylate")
    result["pylate_version"] = pylate["pylate"]
    result["shape"] = {**shape, "query_length": colbert.QUERY_LENGTH, "document_length": colbert.DOCUMENT_LENGTH,
                       "model": spec["model"]}
    packed_line = (f", packed {result['packed_over_pylate']:.2f}x" if packed is not None
                   else f" (packed {result[PACKED]})")
    result["summary"] = (f"{_rate_line(result)}: {result['vembed_over_pylate']:.2f}x{packed_line} PyLate "
                         f"{pylate['pylate']} "
                         f"(batch {shape['batch']} rows of query, positive, hard negative; PyLate in its own process "
                         "after vembed)")
    return result


def _pylate_stack(ctx: Context) -> Path:
    """A folder PyLate's pinned stack imports from, put in front of the machine's packages by PyLate's process only:
    gpu-wheels/pylate-stack/ installed into this step's folder (`--target`: the machine's own packages stay as they
    are), else a development checkout's (bench/pylate_runner.py's STACK: scripts/setup.sh dev). Skipped without."""
    folder = ctx.wheels / PYLATE_STACK
    wheels = sorted(folder.glob("*.whl"))
    if wheels:
        target = ctx.work / PYLATE_STACK
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                               str(target), *map(str, wheels)], capture_output=True, text=True, env=_env(),
                              timeout=max(ctx.budget_s / 2, 10))
        if done.returncode:
            raise RuntimeError(f"installing {folder}: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
        return target
    stack = _bench_module("pylate_runner").STACK
    if (stack / "pylate").is_dir():
        return stack
    raise Skipped(f"{PYLATE_UNAVAILABLE}: no wheels in {folder} (make gpu-wheels) and no {stack} "
                  "(scripts/setup.sh dev)")


# --- step: GPU levers (bench/gpu_levers.py) -------------------------------------------------------------------------
def levers(ctx: Context) -> dict[str, Any]:
    return _bench_module("gpu_levers").levers(ctx)


# --- the run ---------------------------------------------------------------------------------------------------------
STEPS: dict[str, Step] = {
    "gpu_tests": Step(gpu_tests, budget_s=75, dry_budget_s=180),  # measured 29-35 s before the packing tests
    "clip_speed": Step(clip_speed, budget_s=60, dry_budget_s=180),  # measured 30-35 s
    "text_speed": Step(text_speed, budget_s=75, dry_budget_s=180),
    "cross_encoder_speed": Step(cross_encoder_speed, budget_s=60, dry_budget_s=180),
    "colbert_speed": Step(colbert_speed, budget_s=110, dry_budget_s=240),
    "levers": Step(levers, budget_s=150, dry_budget_s=240),  # CLIP's compilation: ~60 s of it (estimate)
    "qwen_memory": Step(qwen_memory, budget_s=200, dry_budget_s=180),
}
# A GPU run's steps unless --steps names others (a dry run runs them all, so none rots): qwen_memory measured 11.83 GiB
# twice (H200, H100; docs/benchmarks.md) in 124-149 s, a third of the device time a task is lent.
DEFAULT_STEPS = ("gpu_tests", "clip_speed", "text_speed", "cross_encoder_speed", "colbert_speed", "levers")
# A dry run's guard against hangs only: its probe (a fresh interpreter importing torch) overran 40 s on 2 shared cores
# while the suite ran two workers (seen twice), and the table then read "unknown" for the card.
ENVIRONMENT_DRY_BUDGET_S = 180
ENVIRONMENT_BUDGET_S = 40  # with the default steps' budgets: 570 s at most (expected ~300 s), in the 15
# minutes a lent machine gives, start-up included


def _worker(name: str, work: Path, dry_run: bool, budget_s: float, wheels: Path) -> None:
    """Run one step in this process; its outcome is the last stdout line, after RESULT_MARK."""
    ctx = Context(dry_run=dry_run, work=work, budget_s=budget_s, wheels=wheels)
    try:
        outcome = {"status": "ok", "results": STEPS[name].run(ctx)}
    except Skipped as skip:
        outcome = {"status": "skipped", "reason": str(skip)}
    print(RESULT_MARK + json.dumps(outcome, default=str), flush=True)


def run_step(name: str, dry_run: bool, work_root: Path, logs: Path, wheels: Path = WHEELS) -> dict[str, Any]:
    """One step in a fresh process, within its budget; a crash, an error or an overrun becomes a failed record."""
    step = STEPS[name]
    budget = step.dry_budget_s if dry_run else step.budget_s
    work = work_root / name
    work.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, __file__, "--worker", name, "--work", str(work), "--budget", str(budget), "--wheels",
               str(wheels)]
    if dry_run:
        command.append("--cpu-dry-run")
    # One thread in a dry run: on a small shared CPU, two threads contending with neighbours make a toy step 20x slower.
    env = dict(_env(), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1") if dry_run else _env()
    start = time.perf_counter()
    log = logs / f"{name}.txt"
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=budget, cwd=ROOT)
    except subprocess.TimeoutExpired as timeout:
        _write_log(log, timeout.stdout, timeout.stderr)
        return {"status": "failed", "seconds": time.perf_counter() - start, "budget_s": budget,
                "error": f"over its {budget} s budget (stopped); log: {log}"}
    _write_log(log, done.stdout, done.stderr)
    record = {"seconds": time.perf_counter() - start, "budget_s": budget}
    marked = [line for line in done.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if done.returncode == 0 and marked:
        return {**json.loads(marked[-1][len(RESULT_MARK):]), **record}
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    return {"status": "failed", **record, "error": lines[-1] if lines else f"exit code {done.returncode}",
            "log": str(log)}


def _write_log(path: Path, stdout: str | bytes | None, stderr: str | bytes | None) -> None:
    text = [part.decode(errors="replace") if isinstance(part, bytes) else (part or "") for part in (stdout, stderr)]
    path.write_text(f"--- stdout\n{text[0]}\n--- stderr\n{text[1]}")


def _run_environment(dry_run: bool, wheels: Path | None, work_root: Path) -> dict[str, Any]:
    start = time.perf_counter()
    budget = ENVIRONMENT_DRY_BUDGET_S if dry_run else ENVIRONMENT_BUDGET_S
    try:
        results = environment(Context(dry_run, work_root, budget), wheels)
        record = {"status": "ok", "results": results}
    except Exception as error:  # noqa: BLE001 - recorded; the steps after it still run and say what they lack
        detail = getattr(error, "stderr", None) or ""
        line = (detail.strip().splitlines() or [f"{type(error).__name__}: {error}"])[-1]
        record = {"status": "failed", "error": line}
    return {**record, "seconds": time.perf_counter() - start, "budget_s": budget}


def markdown(report: dict[str, Any]) -> str:
    """One row per step: status, seconds against its budget, the key numbers (or the error / skip reason), the card."""
    card = report["card"]
    lines = [f"GPU check{' (CPU dry run, toy sizes)' if report['dry_run'] else ''}: {card}, "
             f"{report['seconds']:.0f} s in all",
             "", "| step | status | seconds (budget) | key numbers | card |", "| --- | --- | ---: | --- | --- |"]
    for name, record in report["steps"].items():
        detail = (record.get("results", {}).get("summary") if record["status"] == "ok"
                  else record.get("reason") or record.get("error", ""))
        detail = str(detail).replace("|", "\\|")
        lines.append(f"| {name} | {record['status']} | {record['seconds']:.0f} ({record['budget_s']}) | {detail} "
                     f"| {card} |")
    return "\n".join(lines) + "\n"


def _save(report: dict[str, Any], out: Path) -> None:
    from vembed.files import replace_atomically

    replace_atomically(out / "gpu_check.json", lambda tmp: tmp.write_text(json.dumps(report, indent=2, default=str)))
    replace_atomically(out / "gpu_check.md", lambda tmp: tmp.write_text(markdown(report)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="folder for gpu_check.json, gpu_check.md and logs/ (required)")
    parser.add_argument("--cpu-dry-run", action="store_true", help="every step at toy size on CPU")
    parser.add_argument("--wheels", default=str(WHEELS), help="wheel folder to install from (default gpu-wheels/)")
    parser.add_argument("--steps", help=f"the steps to run after environment, any of {','.join(STEPS)} (default: "
                                         f"{','.join(DEFAULT_STEPS)}; every step in a dry run)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker, Path(args.work), args.cpu_dry_run, args.budget, Path(args.wheels))
        return 0
    if not args.out:
        parser.error("--out DIR is required")
    steps = args.steps.split(",") if args.steps else list(STEPS if args.cpu_dry_run else DEFAULT_STEPS)
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        print(f"error: --steps: unknown step {', '.join(unknown)}; choose from {', '.join(STEPS)}", file=sys.stderr)
        return 2
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)  # each step's stdout and stderr
    start = time.perf_counter()
    report: dict[str, Any] = {"dry_run": args.cpu_dry_run, "card": "?", "started": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                              time.gmtime()),
                              "seconds": 0.0, "steps": {}}
    with tempfile.TemporaryDirectory(prefix="vembed-gpu-check-") as tmp:
        work_root = Path(tmp)
        report["steps"]["environment"] = _run_environment(args.cpu_dry_run, Path(args.wheels), work_root)
        report["card"] = report["steps"]["environment"].get("results", {}).get("card", "unknown")
        for name in steps:
            print(f"[gpu-check] {name} ...", flush=True)
            report["steps"][name] = record = run_step(name, args.cpu_dry_run, work_root, out / "logs",
                                                      Path(args.wheels))
            report["seconds"] = time.perf_counter() - start
            _save(report, out)  # after every step: a machine taken back mid-run still leaves what was measured
            print(f"[gpu-check] {name}: {record['status']} in {record['seconds']:.0f} s "
                  f"{record.get('error') or record.get('reason') or ''}", flush=True)
    report["seconds"] = time.perf_counter() - start
    _save(report, out)
    print(markdown(report))
    return 1 if any(r["status"] == "failed" for r in report["steps"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
