"""Where a vembed training step's time goes, against the minimal loop's step, in one process with the two interleaved.

    python bench/step_overhead.py --scenario clip     # tiny CLIP, batch 64 (the scenarios of throughput.py)
    python bench/step_overhead.py --scenario vit      # ViT-B/16-sized vision tower, batch 8
    python bench/step_overhead.py --smoke             # tiny, into a temp folder: checks that it runs

`throughput.py` compares whole runs in separate processes. On a shared VM whose speed drifts in phases lasting
seconds (steps 20-50% slower for a while, then not), three rounds of that leave ratios uncertain by ~15%. Here vembed
and the minimal loop train side by side in one process, alternating in blocks of a few steps, so a slow phase hits
both; and vembed's step is split in two:
- data: the wait for the next batch from vembed's DataLoader (reading and decoding files, tokenising, image
  processing; with `--num-workers N` that work runs in worker processes and only the wait is left);
- model step: `Trainer.train_on_batch`, everything the loop does with a batch (forward, loss, backward, the
  gradient-norm check, the optimizer step);
against the minimal loop's step (`throughput.build_minimal`: same model shape and weights, batches preprocessed in
advance). Each figure is the median over all measured steps.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput  # noqa: E402  (the shared scenarios, data and minimal loop)
from outputs import output_dir  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _forever(loader: Any) -> Any:
    """Batches of vembed's loader, epoch after epoch (the bench runs more steps than one epoch holds)."""
    for epoch in itertools.count():
        loader.set_epoch(epoch)
        yield from loader


def measure(scenario: str, blocks: int, block_steps: int, smoke: bool, num_workers: int = 0,
            batch_size: int | None = None, cache_off_too: bool = False) -> dict[str, Any]:
    """Medians of vembed's data wait, model step and whole step against the minimal loop's step. `cache_off_too`:
    a second vembed Trainer with `data.image_cache: false` (every image decoded and processed per batch, as before
    the image cache) takes its turn in every block too; its figures carry the prefix `no_cache_`."""
    from vembed.components import recipe_from_dict
    from vembed.training.checkpoint import TrainerState
    from vembed.training.loop import Trainer

    spec = throughput.prepare(scenario, Path(tempfile.mkdtemp(prefix=f"vembed-overhead-{scenario}-")), smoke,
                              batch_size)
    runs = {"": True, "no_cache_": False} if cache_off_too else {"": True}
    vembed = {}
    for prefix, image_cache in runs.items():
        recipe = throughput.vembed_recipe({**spec, "image_cache": image_cache})
        recipe["data"]["num_workers"] = num_workers
        trainer = Trainer(recipe_from_dict(recipe))
        trainer.build()
        trainer.model.train()
        vembed[prefix] = (trainer, TrainerState(), _forever(trainer.loader), [], [])
    minimal_batches, minimal_step = throughput.build_minimal(spec)
    minimal_batches = itertools.cycle(minimal_batches)

    minimal = []
    for block in range(blocks + 1):  # block 0 is warm-up for both (first-call allocations, lazy initialisation)
        for trainer, state, batches, data, model_step in vembed.values():
            for _ in range(block_steps):
                start = time.perf_counter()
                batch = next(batches)
                loaded = time.perf_counter()
                trainer.train_on_batch(batch, state)
                done = time.perf_counter()
                if block:
                    data.append(loaded - start)
                    model_step.append(done - loaded)
        for _ in range(block_steps):
            start = time.perf_counter()
            minimal_step(*next(minimal_batches))
            if block:
                minimal.append(time.perf_counter() - start)
    for trainer, *_ in vembed.values():
        trainer.accelerator.end_training()

    def ms(values: list[float]) -> float:
        return 1000 * statistics.median(values)

    result = {
        "scenario": scenario, "batch_size": spec["batch_size"], "blocks": blocks, "block_steps": block_steps,
        "smoke": smoke, "num_workers": num_workers, "minimal_step_ms": ms(minimal),
    }
    for prefix, (_, _, _, data, model_step) in vembed.items():
        whole = [a + b for a, b in zip(data, model_step)]
        result.update({f"{prefix}data_ms": ms(data), f"{prefix}model_step_ms": ms(model_step),
                       f"{prefix}vembed_step_ms": ms(whole)})
        result[f"{prefix}vembed_vs_minimal"] = result["minimal_step_ms"] / result[f"{prefix}vembed_step_ms"]
        result[f"{prefix}model_step_vs_minimal"] = result["minimal_step_ms"] / result[f"{prefix}model_step_ms"]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=["clip", "vit", "text"], default="clip")
    parser.add_argument("--blocks", type=int, default=8, help="measured blocks per system (after one warm-up block)")
    parser.add_argument("--block-steps", type=int, default=5, help="steps per block")
    parser.add_argument("--num-workers", type=int, default=0,
                        help="vembed's data.num_workers (>0: collation in worker processes, overlapping the step)")
    parser.add_argument("--batch-size", type=int, help="instead of the scenario's batch size")
    parser.add_argument("--cache-off-too", action="store_true",
                        help="clip/vit: a second vembed with data.image_cache false takes its turn in every block")
    parser.add_argument("--smoke", action="store_true", help="tiny models and two short blocks: checks that it runs")
    parser.add_argument("--out", help="where the JSON result goes (default: bench/results, or a temporary folder for "
                                      "--smoke)")
    args = parser.parse_args(argv)
    blocks, block_steps = (1, 2) if args.smoke else (args.blocks, args.block_steps)
    result = measure(args.scenario, blocks, block_steps, args.smoke, args.num_workers, args.batch_size,
                     args.cache_off_too)
    out = output_dir(args.out, args.smoke)
    suffix = f"_workers{args.num_workers}" if args.num_workers else ""
    suffix += f"_b{args.batch_size}" if args.batch_size else ""
    suffix += "_cache_on_off" if args.cache_off_too else ""
    (out / f"step_overhead_{args.scenario}{suffix}.json").write_text(json.dumps(result, indent=2))
    print(f"{args.scenario}, batch {result['batch_size']}, data.num_workers {args.num_workers}, "
          f"medians of {blocks * block_steps} steps each:\n"
          f"  vembed data (loader)     {result['data_ms']:8.1f} ms\n"
          f"  vembed model step        {result['model_step_ms']:8.1f} ms\n"
          f"  vembed whole step        {result['vembed_step_ms']:8.1f} ms\n"
          f"  minimal loop step        {result['minimal_step_ms']:8.1f} ms\n"
          f"  vembed / minimal throughput: {result['vembed_vs_minimal']:.2f}x "
          f"(model step alone {result['model_step_vs_minimal']:.2f}x)")
    if args.cache_off_too:
        print(f"  without the image cache: data {result['no_cache_data_ms']:.1f} ms, model step "
              f"{result['no_cache_model_step_ms']:.1f} ms, whole {result['no_cache_vembed_step_ms']:.1f} ms, "
              f"{result['no_cache_vembed_vs_minimal']:.2f}x the minimal loop")
    print(f"result in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
