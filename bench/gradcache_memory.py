"""GradCache memory and speed against plain batches: same model, data and batch, one run, each point in a fresh process.

    python bench/gradcache_memory.py                      # batches 32..1024, chunk 32, 3 rounds
    python bench/gradcache_memory.py --batches 32,256 --rounds 1 --steps 2 --out /tmp/gc   # quicker

For every batch size B, a plain step (one forward of B per side) and a GradCache step (chunks of `--chunk`) run on the
same pre-collated batch through the Trainer's own step function (`Trainer.train_step`, the path training takes) plus
AdamW's step. Each point runs in its own process, twice, because memory and time want different allocators:

- **time**: the default allocator; `--steps` timed steps after one warm-up step, median. Points run in `--rounds`
  rounds, plain and GradCache alternating and the order rotated each round, so a slow spell of a shared machine hits
  both; the GradCache/plain ratio is the median of the per-round ratios.
- **memory**: what a step needs above the steady state (model, AdamW state, the batch), over 2 steps after a warm-up
  step: on CPU the high-water RSS after resetting it (`/proc/self/clear_refs`) minus the RSS before, with glibc
  returning every block above 64 KiB at once (MALLOC_MMAP_THRESHOLD_) so the RSS follows live tensors; on CUDA
  max_memory_allocated minus memory_allocated.

Writes gradcache_memory.json/.md/.png under `--out`.
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
sys.path.insert(0, str(Path(__file__).resolve().parent))  # for process_memory, however this file is loaded
from process_memory import peak_rss_bytes, reset_peak_rss, rss_bytes  # noqa: E402

# A small CLIP whose activations, not weights, dominate at large batches: 4+4 layers, 128-d, 64x64 images (64 patches).
MODEL = {
    "projection_dim": 128,
    "text_config": {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 4,
                    "num_attention_heads": 4, "max_position_embeddings": 32, "pad_token_id": 0, "bos_token_id": 2,
                    "eos_token_id": 3},
    "vision_config": {"image_size": 64, "patch_size": 8, "hidden_size": 128, "intermediate_size": 512,
                      "num_hidden_layers": 4, "num_attention_heads": 4},
}
MODES = ("plain", "gradcache")


def worker(data: Path, mode: str, batch: int, chunk: int, steps: int, measure: str) -> dict:
    import torch
    from accelerate.utils import send_to_device

    from vembed.components import recipe_from_dict
    from vembed.training.loop import Trainer

    raw = {"model_type": "clip", "model_config": MODEL, "tokenizer_name": str(data / "tokenizer"),
           "data": {"train": str(data / "train.jsonl"), "num_hard_negatives": 0}, "batch_size": batch,
           "output_dir": str(data / "run"), "seed": 0, "eval_before_training": False, "learnable_temperature": True}
    if mode == "gradcache":
        raw.update(use_gradient_cache=True, gradient_cache_chunk_size=chunk)
    trainer = Trainer(recipe_from_dict(raw))
    trainer.build()
    device = trainer.accelerator.device
    batch_data = send_to_device(trainer.loader.collate_fn([trainer.dataset[i] for i in range(batch)]), device)
    cuda = device.type == "cuda"

    def step() -> None:
        trainer.train_step(batch_data)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()

    step()  # warm-up: allocates AdamW's state and warms caches; neither timed nor in the peak
    row = {"mode": mode, "batch": batch, "chunk": chunk if mode == "gradcache" else None, "device": str(device)}
    if measure == "memory":
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            reset_peak_rss()
            base = rss_bytes()
        for _ in range(2):
            step()
        peak = (torch.cuda.max_memory_allocated() if cuda else peak_rss_bytes()) - base
        return {**row, "peak_mib": peak / 2**20}
    wall, cpu = [], []
    for _ in range(steps):
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        step()
        wall.append(time.perf_counter() - start_wall)
        cpu.append(time.process_time() - start_cpu)
    return {**row, "step_s": statistics.median(wall), "cpu_step_s": statistics.median(cpu)}


def _run_point(data: Path, mode: str, batch: int, chunk: int, steps: int, measure: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    if measure == "memory":  # glibc serves blocks above 64 KiB by mmap: a freed tensor leaves the RSS at once
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    command = [sys.executable, __file__, "--worker", mode, str(batch), measure, "--data", str(data),
               "--chunk", str(chunk), "--steps", str(steps)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"{mode} batch {batch} ({measure}) failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def summarise(timings: list[dict], memory: list[dict], chunk: int) -> list[dict]:
    """One row per batch: peak memory of each mode, median samples/s, and the median of the per-round time ratios."""
    rows = []
    for batch in sorted({t["batch"] for t in timings}):
        per_mode = {mode: [t for t in timings if t["batch"] == batch and t["mode"] == mode] for mode in MODES}
        rounds = sorted({t["round"] for t in per_mode["plain"]} & {t["round"] for t in per_mode["gradcache"]})

        def in_round(mode: str, r: int, key: str) -> float:
            return next(t[key] for t in per_mode[mode] if t["round"] == r)

        row = {"batch": batch, "chunk": chunk}
        for mode in MODES:
            row[f"{mode}_peak_mib"] = next(m["peak_mib"] for m in memory if m["batch"] == batch and m["mode"] == mode)
            row[f"{mode}_samples_per_s"] = batch / statistics.median(t["step_s"] for t in per_mode[mode])
        row["time_ratio"] = statistics.median(in_round("gradcache", r, "step_s") / in_round("plain", r, "step_s")
                                              for r in rounds)
        row["cpu_time_ratio"] = statistics.median(
            in_round("gradcache", r, "cpu_step_s") / in_round("plain", r, "cpu_step_s") for r in rounds)
        row["round_ratios"] = [round(in_round("gradcache", r, "step_s") / in_round("plain", r, "step_s"), 3)
                               for r in rounds]
        rows.append(row)
    return rows


def report(rows: list[dict], out: Path) -> str:
    lines = ["| batch | plain peak MiB | GradCache peak MiB | plain samples/s | GradCache samples/s | "
             "GradCache/plain step time (per round) | CPU time ratio |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        per_round = ", ".join(f"{x:.2f}" for x in r["round_ratios"])
        lines.append(f"| {r['batch']} | {r['plain_peak_mib']:.0f} | {r['gradcache_peak_mib']:.0f} | "
                     f"{r['plain_samples_per_s']:.0f} | {r['gradcache_samples_per_s']:.0f} | "
                     f"**{r['time_ratio']:.2f}x** ({per_round}) | {r['cpu_time_ratio']:.2f}x |")
    smallest, largest, chunk = rows[0], rows[-1], rows[0]["chunk"]
    memory_ratio = largest["gradcache_peak_mib"] / smallest["plain_peak_mib"]
    above_chunk = [r["time_ratio"] for r in rows if r["batch"] > chunk]
    lines += ["", f"- GradCache peak at batch {largest['batch']} / plain peak at batch {smallest['batch']}: "
              f"{memory_ratio:.2f}x (target <= 1.25x: {'met' if memory_ratio <= 1.25 else 'missed'})"]
    if above_chunk:
        lines.append(f"- GradCache / plain step time at batches above the chunk ({chunk}): {min(above_chunk):.2f}x to "
                     f"{max(above_chunk):.2f}x, median {statistics.median(above_chunk):.2f}x "
                     f"(target <= 1.4x: {'met' if max(above_chunk) <= 1.4 else 'missed'})")
    table = "\n".join(lines)
    (out / "gradcache_memory.md").write_text(table + "\n")
    plot(rows, out / "gradcache_memory.png")
    return table


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chunk = rows[0]["chunk"]
    batches = [r["batch"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, label in (("plain", "plain batch"), ("gradcache", f"GradCache (chunk {chunk})")):
        left.plot(batches, [r[f"{mode}_peak_mib"] for r in rows], marker="o", label=label)
        right.plot(batches, [r[f"{mode}_samples_per_s"] for r in rows], marker="o", label=label)
    left.axhline(1.25 * rows[0]["plain_peak_mib"], color="gray", linestyle=":", label="1.25 x plain at smallest batch")
    for axis, title in ((left, "peak memory of a step above the steady state (MiB)"), (right, "samples/s")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("contrastive batch")
        axis.set_title(title)
        axis.legend()
        axis.grid(alpha=0.3)
    left.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="32,64,128,256,512,1024")
    parser.add_argument("--chunk", type=int, default=32)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per point (after one warm-up step)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the timing runs")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--worker", nargs=3, metavar=("MODE", "BATCH", "MEASURE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        mode, batch, measure = args.worker
        print(json.dumps(worker(Path(args.data), mode, int(batch), args.chunk, args.steps, measure)))
        return

    from tqdm.auto import tqdm

    from vembed.data.synthetic import make_dummy_dataset

    batches = [int(b) for b in args.batches.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    points = [("memory", mode, b, 0) for b in batches for mode in MODES]
    for r in range(args.rounds):  # rotate which mode goes first, so neither always runs after the other
        points += [("time", mode, b, r) for b in batches for mode in (MODES if (r + b // 32) % 2 == 0 else MODES[::-1])]
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        make_dummy_dataset(data, int(max(batches) / 0.68) + 16, seed=0, image_size=64)  # ~70% lands in train
        timings, memory = [], []
        for measure, mode, b, r in tqdm(points, desc="points"):
            result = _run_point(data, mode, b, args.chunk, args.steps, measure)
            (memory if measure == "memory" else timings).append({**result, "round": r})
    rows = summarise(timings, memory, args.chunk)
    (out / "gradcache_memory.json").write_text(json.dumps({"rows": rows, "timings": timings, "memory": memory},
                                                          indent=2))
    print(report(rows, out))


if __name__ == "__main__":
    main()
