"""The GPU check: one command for a lent GPU machine (no network there) that runs vembed's GPU paths and writes what it
saw to one JSON and a short Markdown table. `scripts/gpu_check.sh` (and `make gpu-check`) is the thin wrapper.

    scripts/gpu_check.sh --out DIR                # on the GPU machine: about 5 minutes on one H100, at most 8
    scripts/gpu_check.sh --cpu-dry-run --out DIR  # every step at toy size on CPU, in under 2 minutes (a test)
    make gpu-wheels                               # here, before: what the GPU machine lacks, as wheels (gpu-wheels/)

Steps (each in its own process with its own time budget: a failure or an overrun is recorded with its error line, and
the next step runs):
- environment: installs the wheels of gpu-wheels/ whose distributions the machine lacks (`--no-deps`, vembed too),
  and records the card and the versions.
- gpu_tests: `pytest -m gpu tests/gpu/` (bf16 training, GradCache under bf16; the 2-GPU NCCL launches where 2 GPUs
  exist, else skipped, and the skip reasons are recorded).
- clip_speed: CLIP ViT-B/32 shapes (random init), batch 256, bf16, sdpa: vembed's training step against open_clip's
  (the model, ClipLoss and AdamW as open_clip_train's step uses them) on the same tensors, one process, interleaved.
- qwen_memory: Qwen3-VL-2B shapes (bench/configs/qwen3_vl_2b.json, random init) with LoRA r32 + GradCache, batch
  1024, chunk 32, the shipped 2B recipe otherwise: peak memory and step time, and the planner's estimate for it.
- length_encoding: MiniLM-L6 shapes on texts of uneven length: training samples/s padded, with `length_chunks`, and
  with flash-attention's unpadded kernels when flash-attn is installed; embeddings checked against a reference
  without any padding (each text alone) to bf16 tolerance.

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
    import torch
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
    systems: dict[str, Callable[[], None]] = {"vembed": lambda: _optimizer_step(trainer, batch)}
    try:
        import open_clip
    except Exception as error:  # noqa: BLE001 - ImportError, or torchvision's RuntimeError on a mismatched torch
        open_clip, reason = None, f"{OPEN_CLIP_UNAVAILABLE}: {type(error).__name__}: {error}".splitlines()[0]
    if open_clip is not None:
        systems["open_clip"] = _open_clip_step(open_clip_model(config), batch, ctx)
    seconds: dict[str, list[float]] = {name: [] for name in systems}
    names = list(systems)
    for round_index in range(shape["rounds"]):  # interleaved and rotated: drift hits every system alike
        for name in names[round_index % len(names):] + names[:round_index % len(names)]:
            _timed(systems[name], ctx, shape["warmup"])
            seconds[name].append(_timed(systems[name], ctx, shape["steps"]))
    result = {name: {"samples_per_second": shape["batch"] / statistics.median(s), "round_seconds": s}
              for name, s in seconds.items()}
    result["shape"] = {**shape, "text_tokens": tokens, "image_size": config["vision_config"]["image_size"]}
    vembed_rate = result["vembed"]["samples_per_second"]
    if open_clip is None:
        raise Skipped(f"{reason} (vembed alone: {vembed_rate:.0f} samples/s)")
    ratio = statistics.median(o / v for v, o in zip(seconds["vembed"], seconds["open_clip"]))
    result["vembed_over_open_clip"] = ratio
    peer_rate = result["open_clip"]["samples_per_second"]
    result["summary"] = (f"vembed {vembed_rate:.0f} samples/s, open_clip {peer_rate:.0f} samples/s: {ratio:.2f}x "
                         f"(batch {shape['batch']})")
    return result


def _open_clip_step(model, batch: dict[str, Any], ctx: Context) -> Callable[[], None]:
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

    return step


# --- step: Qwen3-VL-2B memory and the planner ------------------------------------------------------------------------
QWEN = {"batch": 1024, "chunk": 32, "image_size": 256}  # 256 px: 256 patches of 16 px, 64 image tokens
QWEN_DRY = {"batch": 8, "chunk": 2, "image_size": 32}


def qwen_memory(ctx: Context) -> dict[str, Any]:
    import torch
    import yaml
    from accelerate.utils import send_to_device

    from vembed.components import recipe_from_dict
    from vembed.data.synthetic import make_dummy_dataset
    from vembed.data.tokenizer import train_qwen_tokenizer
    from vembed.models.qwen_vl import VISION_TOKEN_IDS
    from vembed.planning import estimate_line

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
    estimate = estimate_line(recipe_from_dict(raw), "ddp+gradcache", 1, device=ctx.device)
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
    estimated_gib = float(estimate.split()[2]) * (1 if " GiB " in estimate else 1 / 1024)  # the line's own unit
    measured_gib = peak / 2**30
    return {"peak_gib": measured_gib, "peak_measured_as": what, "step_seconds": step_s,
            "samples_per_second": shape["batch"] / step_s, "planner": estimate.strip(), "planner_gib": estimated_gib,
            "planner_over_measured": estimated_gib / measured_gib, "mean_tokens": tokens, "shape": shape,
            "summary": f"peak {measured_gib:.2f} GiB ({what}), planner {estimated_gib:.2f} GiB "
                       f"({estimated_gib / measured_gib:.2f}x); step {step_s:.1f} s (batch {shape['batch']}, "
                       f"chunk {shape['chunk']})"}


def _rss_peak() -> Callable[[], int]:
    process_memory = _bench_module("process_memory")
    process_memory.reset_peak_rss()
    return process_memory.peak_rss_bytes


# --- step: length-aware encoding -------------------------------------------------------------------------------------
LENGTH = {"batch": 256, "chunks": 4, "warmup": 2, "steps": 5, "rounds": 2, "max_length": 256}
LENGTH_DRY = {"batch": 16, "chunks": 4, "warmup": 1, "steps": 1, "rounds": 1, "max_length": 64}


def length_encoding(ctx: Context) -> dict[str, Any]:
    import importlib.util

    import torch
    from accelerate.utils import send_to_device

    shape = LENGTH_DRY if ctx.dry_run else LENGTH
    throughput = _bench_module("throughput")
    rows = throughput._uneven_rows(shape["batch"] * 2)
    throughput._write_jsonl(ctx.work / "train.jsonl", rows)
    model_dir = _minilm_folder(ctx, rows)
    raw = {"model_type": "text", "model_name": model_dir, "pooling": "mean", "symmetric_loss": False,
           "data": {"train": str(ctx.work / "train.jsonl"), "num_hard_negatives": 0},
           "output_dir": str(ctx.work / "run"), "batch_size": shape["batch"], "max_length": shape["max_length"],
           "mixed_precision": "bf16", "attn_implementation": "sdpa", "length_chunks": shape["chunks"],
           "learning_rate": 2e-5}
    if ctx.dry_run:
        raw["mixed_precision"] = "no"
    sdpa = _trainer(raw)
    batch = send_to_device(sdpa.collate([sdpa.dataset[i] for i in range(shape["batch"])]), sdpa.accelerator.device)
    runs = {"padded": (sdpa, 1), f"length_chunks={shape['chunks']}": (sdpa, shape["chunks"])}
    flash = importlib.util.find_spec("flash_attn") is not None and not ctx.dry_run
    if flash:
        varlen = _trainer({**raw, "attn_implementation": "flash_attention_2", "output_dir": str(ctx.work / "fa")})
        varlen.objective.load_state_dict(sdpa.objective.state_dict())
        runs["flash_attention_2 (unpadded)"] = (varlen, 1)
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for round_index in range(shape["rounds"]):
        for name, (trainer, chunks) in runs.items():
            trainer.objective.length_chunks = chunks

            def step(trainer=trainer):
                _optimizer_step(trainer, batch)

            _timed(step, ctx, shape["warmup"])
            seconds[name].append(_timed(step, ctx, shape["steps"]))
    # Exactness after training moved the weights apart: compare each path on one copy of them.
    for trainer, _ in runs.values():
        if trainer is not sdpa:
            trainer.objective.load_state_dict(sdpa.objective.state_dict())
    queries = batch["query"]
    reference = _embed_each_alone(sdpa, queries, ctx)
    agreement = {}
    for name, (trainer, chunks) in runs.items():
        trainer.objective.length_chunks = chunks
        embeddings = _embed(trainer, queries, ctx)
        agreement[name] = torch.nn.functional.cosine_similarity(embeddings, reference).min().item()
    mask = queries["attention_mask"]
    result = {name: {"samples_per_second": shape["batch"] / statistics.median(s), "round_seconds": s,
                     "min_cosine_to_unpadded": agreement[name]} for name, s in seconds.items()}
    result["flash_attention_2"] = "measured" if flash else (
        "not installed" if not ctx.dry_run else "not tried (CPU dry run)")
    result["query_tokens"] = {"mean": mask.sum(1).float().mean().item(), "max": mask.shape[1]}
    result["shape"] = shape
    off = {name: a for name, a in agreement.items() if a < BF16_COSINE}
    if off:
        raise RuntimeError(f"embeddings differ from the unpadded reference beyond bf16 tolerance: {off}")
    rates = ", ".join(f"{name} {r['samples_per_second']:.0f}" for name, r in result.items()
                      if isinstance(r, dict) and "samples_per_second" in r)
    result["summary"] = (f"samples/s: {rates}; all within bf16 of unpadded (min cosine "
                         f"{min(agreement.values()):.4f}); flash-attn {result['flash_attention_2']}")
    return result


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
                    max_length=LENGTH["max_length"])
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


# --- the run ---------------------------------------------------------------------------------------------------------
STEPS: dict[str, Step] = {
    "gpu_tests": Step(gpu_tests, budget_s=90, dry_budget_s=180),
    "clip_speed": Step(clip_speed, budget_s=75, dry_budget_s=180),
    "qwen_memory": Step(qwen_memory, budget_s=200, dry_budget_s=180),
    "length_encoding": Step(length_encoding, budget_s=60, dry_budget_s=180),
}
ENVIRONMENT_BUDGET_S = 40  # with the budgets above: 465 s, under 8 minutes


def _worker(name: str, work: Path, dry_run: bool, budget_s: float) -> None:
    """Run one step in this process; its outcome is the last stdout line, after RESULT_MARK."""
    ctx = Context(dry_run=dry_run, work=work, budget_s=budget_s)
    try:
        outcome = {"status": "ok", "results": STEPS[name].run(ctx)}
    except Skipped as skip:
        outcome = {"status": "skipped", "reason": str(skip)}
    print(RESULT_MARK + json.dumps(outcome, default=str), flush=True)


def run_step(name: str, dry_run: bool, work_root: Path, logs: Path) -> dict[str, Any]:
    """One step in a fresh process, within its budget; a crash, an error or an overrun becomes a failed record."""
    step = STEPS[name]
    budget = step.dry_budget_s if dry_run else step.budget_s
    work = work_root / name
    work.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, __file__, "--worker", name, "--work", str(work), "--budget", str(budget)]
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
    try:
        results = environment(Context(dry_run, work_root, ENVIRONMENT_BUDGET_S), wheels)
        record = {"status": "ok", "results": results}
    except Exception as error:  # noqa: BLE001 - recorded; the steps after it still run and say what they lack
        detail = getattr(error, "stderr", None) or ""
        line = (detail.strip().splitlines() or [f"{type(error).__name__}: {error}"])[-1]
        record = {"status": "failed", "error": line}
    return {**record, "seconds": time.perf_counter() - start, "budget_s": ENVIRONMENT_BUDGET_S}


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
    parser.add_argument("--steps", default=",".join(STEPS), help=f"a subset of {','.join(STEPS)}")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker, Path(args.work), args.cpu_dry_run, args.budget)
        return 0
    if not args.out:
        parser.error("--out DIR is required")
    unknown = [s for s in args.steps.split(",") if s not in STEPS]
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
        for name in args.steps.split(","):
            print(f"[gpu-check] {name} ...", flush=True)
            report["steps"][name] = record = run_step(name, args.cpu_dry_run, work_root, out / "logs")
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
