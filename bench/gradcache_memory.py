"""GradCache memory and speed against plain batches: same model, data and batch, one run, each point in a fresh process.

    python bench/gradcache_memory.py                      # CPU: peak RSS above the built model; GPU: max allocated
    python bench/gradcache_memory.py --batches 32,256 --steps 2 --out /tmp/gc   # quicker

For every batch size B, a plain step (one forward of B per side) and a GradCache step (chunks of `--chunk`) run on the
same pre-collated batch through the Trainer's own step function (`Trainer.train_step`): the path training takes.
Peak memory is measured over the timed steps, above the memory held once model, data and optimizer are built (on CPU:
peak RSS minus RSS before the first step; on CUDA: max_memory_allocated minus memory_allocated before it). Step time
is the median of `--steps` steps after one warm-up step. Writes results.json, a markdown table and a PNG plot.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A small CLIP whose activations, not weights, dominate at large batches: 4+4 layers, 128-d, 64x64 images (64 patches).
MODEL = {
    "projection_dim": 128,
    "text_config": {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 4,
                    "num_attention_heads": 4, "max_position_embeddings": 32, "pad_token_id": 0, "bos_token_id": 2,
                    "eos_token_id": 3},
    "vision_config": {"image_size": 64, "patch_size": 8, "hidden_size": 128, "intermediate_size": 512,
                      "num_hidden_layers": 4, "num_attention_heads": 4},
}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def worker(data: Path, mode: str, batch: int, chunk: int, steps: int) -> dict:
    import torch
    from accelerate.utils import send_to_device

    from vembed.recipe import recipe_from_dict
    from vembed.training.loop import Trainer

    raw = {"model_type": "clip", "model_config": MODEL, "tokenizer_name": str(data / "tokenizer"),
           "data": {"train": str(data / "train.jsonl"), "num_hard_negatives": 0}, "batch_size": batch,
           "output_dir": str(data / "run"), "seed": 0, "eval_before_training": False, "learnable_temperature": True}
    if mode == "gradcache":
        raw.update(use_gradient_cache=True, gradient_cache_chunk_size=chunk)
    trainer = Trainer(recipe_from_dict(raw))
    trainer._build()
    device = trainer.accelerator.device
    batch_data = send_to_device(trainer.loader.collate_fn([trainer.dataset[i] for i in range(batch)]), device)

    def step() -> None:
        trainer.train_step(batch_data)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_bytes()
    times = []
    for i in range(steps + 1):
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        if i:  # the first step allocates optimizer state and warms caches: not timed
            times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated() if cuda else _peak_rss_bytes()) - base
    step_s = statistics.median(times)
    return {"mode": mode, "batch": batch, "chunk": chunk if mode == "gradcache" else None, "peak_mib": peak / 2**20,
            "step_s": step_s, "samples_per_s": batch / step_s, "device": str(device)}


def _run_point(data: Path, mode: str, batch: int, chunk: int, steps: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    command = [sys.executable, __file__, "--worker", mode, str(batch), "--data", str(data), "--chunk", str(chunk),
               "--steps", str(steps)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"{mode} batch {batch} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _report(results: list[dict], out: Path, chunk: int) -> str:
    by = {(r["mode"], r["batch"]): r for r in results}
    batches = sorted({r["batch"] for r in results})
    lines = ["| batch | plain peak MiB | GradCache peak MiB | plain samples/s | GradCache samples/s | GC/plain time |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for b in batches:
        p, g = by.get(("plain", b)), by.get(("gradcache", b))
        ratio = f"{g['step_s'] / p['step_s']:.2f}x" if p and g else "-"
        lines.append(f"| {b} | {p['peak_mib']:.0f} | {g['peak_mib']:.0f} | {p['samples_per_s']:.0f} | "
                     f"{g['samples_per_s']:.0f} | {ratio} |" if p and g else f"| {b} | - | - | - | - | - |")
    smallest, largest = batches[0], batches[-1]
    memory_ratio = by[("gradcache", largest)]["peak_mib"] / by[("plain", smallest)]["peak_mib"]
    time_ratios = [by[("gradcache", b)]["step_s"] / by[("plain", b)]["step_s"] for b in batches if b > chunk]
    lines += ["", f"- GradCache peak at batch {largest} / plain peak at batch {smallest}: {memory_ratio:.2f}x "
              f"(target <= 1.25x: {'met' if memory_ratio <= 1.25 else 'missed'})"]
    if time_ratios:
        worst = max(time_ratios)
        lines.append(f"- GradCache / plain step time above the chunk size: {min(time_ratios):.2f}x to {worst:.2f}x "
                     f"(target <= 1.4x: {'met' if worst <= 1.4 else 'missed'})")
    table = "\n".join(lines)
    (out / "gradcache_memory.md").write_text(table + "\n")
    _plot(results, out / "gradcache_memory.png", chunk)
    return table


def _plot(results: list[dict], path: Path, chunk: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, label in (("plain", "plain batch"), ("gradcache", f"GradCache (chunk {chunk})")):
        rows = sorted((r for r in results if r["mode"] == mode), key=lambda r: r["batch"])
        xs = [r["batch"] for r in rows]
        left.plot(xs, [r["peak_mib"] for r in rows], marker="o", label=label)
        right.plot(xs, [r["samples_per_s"] for r in rows], marker="o", label=label)
    for axis, title in ((left, "peak memory above the built model (MiB)"), (right, "samples/s")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("contrastive batch")
        axis.set_title(title)
        axis.legend()
        axis.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="32,64,128,256,512,1024")
    parser.add_argument("--chunk", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per point (after one warm-up step)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--worker", nargs=2, metavar=("MODE", "BATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(Path(args.data), args.worker[0], int(args.worker[1]), args.chunk, args.steps)))
        return

    from tqdm.auto import tqdm

    from vembed.data.synthetic import make_dummy_dataset

    batches = [int(b) for b in args.batches.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        make_dummy_dataset(data, int(max(batches) / 0.68) + 16, seed=0, image_size=64)  # ~70% lands in train
        points = [(mode, b) for b in batches for mode in ("plain", "gradcache")]  # interleaved: drift hits both
        results = [_run_point(data, mode, b, args.chunk, args.steps) for mode, b in tqdm(points, desc="points")]
    (out / "gradcache_memory.json").write_text(json.dumps(results, indent=2))
    print(_report(results, out, args.chunk))


if __name__ == "__main__":
    main()
