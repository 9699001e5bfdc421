"""Where vembed's and open_clip's CLIP training steps spend their time on a GPU: the GPU check's clip_speed job
(ViT-B/32 shapes, batch 256, bf16, the same tensors), each system's step profiled once after the timed rounds.

    python bench/profile_clip.py --out DIR             # on a GPU: profile_clip.txt and profile_clip.json in DIR
    python bench/profile_clip.py --out DIR --dry-run   # toy sizes on CPU

Per system: samples/s (as clip_speed measures it), one profiled step's kernel time and host (CPU) op time, and its
busiest kernels (torch.profiler).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    import gpu_check as check
    import torch
    from profile_packing import footer_ms

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profiles: dict[str, dict] = {}
    text: list[str] = []
    race = check._race

    def race_then_profile(systems, shape, ctx):
        measured = race(systems, shape, ctx)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if not ctx.dry_run:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        for name, system in systems.items():
            with torch.profiler.profile(activities=activities) as profile:
                seconds = check._timed(system.step, ctx, 1)
            events = profile.key_averages()
            sort = "self_cpu_time_total" if ctx.dry_run else "self_device_time_total"
            table = events.table(sort_by=sort, row_limit=14, max_name_column_width=60)
            kernel_ms, host_ms = footer_ms(table, "CUDA"), footer_ms(table, "CPU")
            profiles[name] = {"profiled_step_ms": seconds * 1e3, "kernel_ms": kernel_ms, "host_ms": host_ms}
            text.extend([f"=== {name}: profiled step {seconds * 1e3:.1f} ms; GPU kernels {kernel_ms:.1f} ms, host ops "
                         f"{host_ms:.1f} ms", table])
        return measured

    check._race = race_then_profile
    with tempfile.TemporaryDirectory() as tmp:
        ctx = check.Context(dry_run=args.dry_run, work=Path(tmp), budget_s=300)
        try:
            result = check.clip_speed(ctx)
        except check.Skipped as skip:  # open_clip missing: vembed's profile alone
            result = {"skipped": str(skip)}
    report = {"clip_speed": result.get("summary") or result.get("skipped"), "profiles": profiles}
    (out / "profile_clip.txt").write_text("\n".join(text))
    (out / "profile_clip.json").write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
