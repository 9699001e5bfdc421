"""Where a packed text step's time goes on a GPU, against the padded step (the GPU check's text_speed job: MiniLM-L6
shapes, random init, uneven texts, bf16), and how the gap moves with the batch.

    python bench/profile_packing.py --out DIR            # on a GPU: profile.txt and profile_packing.json in DIR
    python bench/profile_packing.py --out DIR --dry-run  # toy sizes on CPU (does it run?)

For each layout and batch (256, 1024): samples/s (median of synchronised steps), then one profiled step's busiest
kernels (torch.profiler, CUDA time), its kernel time and its host (CPU) op time: a step whose kernels take less than
its host work is bound by launching them, not by the GPU; and the planner's
estimate given the batch's real lengths (`tokens_per_role`: the padded width, or the mean length when packed) beside
the measured peak.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def footer_ms(table: str, what: str) -> float:
    """A profiler table's own total ("Self CUDA time total: 63.242ms"): kernels counted once, unlike a sum over its
    rows, where an op and the kernels it launched both carry the time."""
    found = re.search(rf"Self {what} time total: ([0-9.]+)(us|ms|s)", table)
    if found is None:
        return 0.0
    return float(found.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[found.group(2)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--compile-only", action="store_true",
                        help="only `compile: true` against eager, padded and packed, at the first batch size")
    args = parser.parse_args(argv)
    import gpu_check as check
    import torch
    from accelerate.utils import send_to_device

    from vembed.components import recipe_from_dict
    from vembed.planning import estimate_line

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    batches = (16, 32) if args.dry_run else (256, 1024)
    report, text = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        ctx = check.Context(dry_run=args.dry_run, work=Path(tmp), budget_s=300)
        throughput = check._bench_module("throughput")
        rows = throughput._uneven_rows(max(batches) * 2)
        throughput._write_jsonl(ctx.work / "train.jsonl", rows)
        model_dir = check._minilm_folder(ctx, rows)
        if args.compile_only:
            report = compiled_rates(ctx, check, model_dir, batches[0], args.dry_run)
            (out / "compile_packing.json").write_text(json.dumps(report, indent=2, default=str))
            print(json.dumps(report, indent=1, default=str))
            return 0
        for batch_size in batches:
            for layout in ("padded", "packed"):
                raw = {"model_type": "text", "model_name": model_dir, "pooling": "mean", "symmetric_loss": False,
                       "data": {"train": str(ctx.work / "train.jsonl"), "num_hard_negatives": 0},
                       "batch_size": batch_size, "max_length": 64 if args.dry_run else 256, "learning_rate": 2e-5,
                       "mixed_precision": "no" if args.dry_run else "bf16", "packing": layout == "packed",
                       **({} if layout == "packed" else {"attn_implementation": "sdpa"})}
                trainer = check._trainer({**raw, "output_dir": str(ctx.work / f"{layout}{batch_size}")})
                batch = send_to_device(trainer.collate([trainer.dataset[i] for i in range(batch_size)]),
                                       trainer.accelerator.device)
                masks = {side: batch[side]["attention_mask"] for side in ("query", "positive")}
                tokens = {role: int(masks[side].sum(1).float().mean()) if layout == "packed" else masks[side].shape[1]
                          for role, side in (("query", "query"), ("document", "positive"))}
                step = lambda trainer=trainer, batch=batch: check._optimizer_step(trainer, batch)  # noqa: E731
                check._timed(step, ctx, 3)
                if not args.dry_run:
                    torch.cuda.reset_peak_memory_stats()
                seconds = check._timed(step, ctx, 8)
                peak = torch.cuda.max_memory_allocated() / 2**30 if not args.dry_run else None
                planner = estimate_line(recipe_from_dict({**raw, "output_dir": str(ctx.work / "x")}), "single", 1,
                                        device=ctx.device, tokens_per_role=tokens)
                activities = [torch.profiler.ProfilerActivity.CPU]
                if not args.dry_run:
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                with torch.profiler.profile(activities=activities) as profile:
                    wall = check._timed(step, ctx, 1)
                events = profile.key_averages()
                sort = "self_cpu_time_total" if args.dry_run else "self_device_time_total"
                table = events.table(sort_by=sort, row_limit=14, max_name_column_width=60)
                device_us = footer_ms(table, "CUDA") * 1e3
                key = f"{layout} batch {batch_size}"
                report[key] = {"samples_per_second": batch_size / seconds, "step_seconds": seconds,
                               "kernel_ms": device_us / 1e3, "profiled_step_ms": wall * 1e3,
                               "host_ms": footer_ms(table, "CPU"), "peak_gib": peak,
                               "planner": planner.strip(), "planner_tokens": tokens}
                text += [f"=== {key}: {batch_size / seconds:.0f} samples/s, step {seconds * 1e3:.1f} ms; in a profiled "
                         f"step GPU kernels {device_us / 1e3:.1f} ms, host (CPU) ops "
                         f"{report[key]['host_ms']:.1f} ms; peak {peak} GiB; "
                         f"{planner.strip()} (tokens {tokens})",
                         table]
                del trainer
                if not args.dry_run:
                    torch.cuda.empty_cache()
        for batch_size in batches:
            padded, packed = (report[f"{layout} batch {batch_size}"] for layout in ("padded", "packed"))
            report[f"packed / padded at {batch_size}"] = packed["samples_per_second"] / padded["samples_per_second"]
    (out / "profile.txt").write_text("\n".join(text))
    (out / "profile_packing.json").write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps({k: (v if not isinstance(v, dict) else {x: v[x] for x in ("samples_per_second",
                                                                             "kernel_ms", "peak_gib")})
                      for k, v in report.items()}, indent=1, default=str))
    return 0


def compiled_rates(ctx, check, model_dir: str, batch_size: int, dry_run: bool) -> dict:
    """Samples/s of eager and `compile: true`, padded and packed, over two alternating batches of different lengths
    (as training meets them: a compiled tower must take a new packed length without recompiling every step); the
    first steps' seconds (compilation) apart."""
    import time

    from accelerate.utils import send_to_device

    report = {}
    for layout in ("padded", "packed"):
        for compiled in (False, True):
            raw = {"model_type": "text", "model_name": model_dir, "pooling": "mean", "symmetric_loss": False,
                   "data": {"train": str(ctx.work / "train.jsonl"), "num_hard_negatives": 0},
                   "batch_size": batch_size, "max_length": 64 if dry_run else 256, "learning_rate": 2e-5,
                   "mixed_precision": "no" if dry_run else "bf16", "packing": layout == "packed",
                   "compile": compiled, "output_dir": str(ctx.work / f"c{layout}{compiled}")}
            trainer = check._trainer(raw)
            batches = [send_to_device(trainer.collate([trainer.dataset[i] for i in range(start, start + batch_size)]),
                                      trainer.accelerator.device) for start in (0, batch_size)]
            turn = iter(range(10**6))

            def step(trainer=trainer, batches=batches, turn=turn):
                check._optimizer_step(trainer, batches[next(turn) % 2])

            start = time.perf_counter()
            check._timed(step, ctx, 4)  # compiles both lengths (and marks the length dynamic) when compiled
            first = time.perf_counter() - start
            seconds = check._timed(step, ctx, 10)
            report[f"{layout}{' compiled' if compiled else ''}"] = {
                "samples_per_second": batch_size / seconds, "first_four_steps_seconds": first}
    return report


if __name__ == "__main__":
    sys.exit(main())
