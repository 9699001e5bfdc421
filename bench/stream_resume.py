"""What exact resume of a stream costs: replaying a slot to its checkpointed position (tar bytes read and shuffled,
nothing decoded) against reading it for training (images decoded, texts tokenised, batches collated):

    python bench/stream_resume.py            # 2048 dummy samples (32-px PNGs) in 8 shards, 3 interleaved rounds
    python bench/stream_resume.py --smoke    # 256 samples, 1 round, into a temp folder: does it run?

One process, one slot (data.num_workers 0), the demo's tiny CLIP processor (configs/demo_clip.yaml), buffer 1000.
Resuming at a fraction f of an epoch costs f x (epoch samples) / (replay samples/s) before the first batch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from outputs import output_dir  # noqa: E402


def _stream(data: dict, batch_size: int):
    import yaml

    from vembed.components import recipe_from_dict
    from vembed.data.collate import PairCollator
    from vembed.data.stream_samples import SampleDecoder
    from vembed.data.streaming import ShardStream, open_stream
    from vembed.models import MODELS

    raw = yaml.safe_load((ROOT / "configs" / "demo_clip.yaml").read_text())
    raw.update(tokenizer_name=data["tokenizer"], data={"train": data["train"], "shuffle_buffer": 1000})
    recipe = recipe_from_dict(raw)
    adapter = MODELS.get("clip").from_recipe(recipe)
    backend, shards = open_stream(recipe.data)
    decoder = SampleDecoder(recipe.data.columns.model_dump(), None, 0, 1)
    return ShardStream(backend, shards, decoder, PairCollator(adapter), batch_size=batch_size, seed=0,
                       shuffle_buffer=1000)


def _train_read(stream) -> tuple[int, float]:
    stream.start_epoch(0)
    start, samples = time.perf_counter(), 0
    for _, batch in stream:
        samples += 0 if batch is None else stream.batch_size
    return samples, time.perf_counter() - start


def _replay(stream) -> tuple[int, float]:
    stream.start_epoch(0)
    start = time.perf_counter()
    drawn = sum(1 for _ in stream.slot_samples(0, lambda file, exn: None))
    return drawn, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    from vembed.data.shard_writer import write_webdataset

    samples, rounds = (256, 1) if args.smoke else (2926, 3)  # dummy: 70 % of these are the training split
    work = Path(tempfile.mkdtemp(prefix="vembed-bench-stream-"))
    data = write_webdataset(work / "wds", "dummy", num_samples=samples, shard_size=256)
    stream = _stream(data, batch_size=64)
    results: dict[str, list[float]] = {"train_read": [], "replay": []}
    for _ in range(rounds):  # interleaved, so a slow phase of the VM hits both
        for name, fn in (("train_read", _train_read), ("replay", _replay)):
            count, seconds = fn(stream)
            results[name].append(count / seconds)
    summary = {name: statistics.median(values) for name, values in results.items()}
    summary["replay_over_train_read"] = summary["replay"] / summary["train_read"]
    record = {"samples": data["samples"], "shards": data["shards"], "rounds": rounds,
              "samples_per_second": results, "median": summary}
    out = output_dir(args.out, args.smoke) / "stream_resume.json"
    out.write_text(json.dumps(record, indent=2))
    print(f"training read {summary['train_read']:.0f} samples/s; replay {summary['replay']:.0f} samples/s "
          f"({summary['replay_over_train_read']:.1f}x); {out}")


if __name__ == "__main__":
    main()
