"""Training data at scale: time and memory to load a generated 1,000,000-row text-pair JSONL, vembed vs `datasets`.

    python bench/data_scale.py                    # 1 M rows (~320 MB, made once under /tmp), 3 rounds
    python bench/data_scale.py --rows 20000 --rounds 1 --smoke   # does it run?
    python bench/data_scale.py --baseline DIR     # also the load of another checkout (e.g. `git archive` of main)

Each measurement is a fresh Python process (so its RSS is its own), timed from just before the load call, after
the imports (which cost the same to every system):
- `datasets cold`: `datasets.load_dataset("json")` into an empty cache: what building the Arrow cache costs;
- `vembed cold`: `load_rows(data.train)` into an empty cache: the Arrow cache plus the row checks;
- `vembed warm`: the same again, as a second launch finds it: both caches mapped;
- `vembed 2 ranks`: two processes (LOCAL_RANK 0 and 1) start the cold load together: one builds under the node's
  file lock, the other waits and maps; the figure is the slower of the two;
- `baseline` (with --baseline): `load_examples` of another checkout (the JSONL read into Python objects).

RSS growth is VmRSS after the load minus before it, split into anonymous memory (the process's own: Python objects,
arrays) and file-backed pages (the memory-mapped Arrow file; shared by every rank of a node, and dropped by the
kernel when memory is short). After the load, 2,000 random records are fetched, as training would.
- `datasets warm`: `datasets.load_dataset("json")` again, its cache built: a second launch's load by `datasets`.

Then the whole launch (issue 22): `python -m vembed.entrypoints.train` with the demo recipe (a tiny CLIP) on the
text pairs, from process start to its first optimizer step (bench/startup.py's hook), as wall and CPU seconds and the
training process's peak RSS (VmHWM, with its private and file-backed parts at that step):
- `launch 2k`: a 2,000-row file of the same pairs (read with the standard library: no `datasets` import);
- `launch cold`: the N-row file, empty caches (the Arrow cache and the row checks built);
- `launch warm`: the same again, caches built (what every later launch, and every rank but one, pays).

Targets (issue 15): RSS growth per rank <= 300 MB; a second launch's load <= 3 s; the first <= 1.5x datasets' cold
load. Issue 22, of the whole launch: a warm 1 M-row launch <= 3 s and <= 150 MB of peak RSS more than a 2k-row one;
at any size, a launch's extra seconds over the 2k-row launch <= 2x `datasets`' own load of the file, cold and warm.
Results in bench/results/data_scale.json (data_scale_<rows>.json for other sizes; `_launches` added with
--launches-only) and docs/benchmarks.md; the data and caches go under a temporary folder, never into the
repository.

    python bench/data_scale.py --rows 5000000 --rounds 1 --launches-only   # the launch at 5 M rows only
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import string
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORKER = r'''
import json, os, sys, time
def memory():
    found = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            found[key] = int(value.split()[0]) / 1024
    # File-backed pages of the memory-mapped Arrow files, apart from those of libraries' code
    arrow, name = 0, ""
    for line in open("/proc/self/smaps"):
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and ":" in head[3]:
            name = head[5] if len(head) > 5 else ""
        elif head and head[0] == "Rss:" and name.endswith(".arrow"):
            arrow += int(head[1])
    found["ArrowMapped"] = arrow / 1024
    return found
mode, path, cache = sys.argv[1], sys.argv[2], sys.argv[3]
os.environ["HF_DATASETS_CACHE"] = cache
import datasets
datasets.config.HF_DATASETS_CACHE = cache
datasets.disable_progress_bars()
if mode == "datasets":
    before, start = memory(), time.perf_counter()
    table = datasets.load_dataset("json", data_files=path, split="train", cache_dir=cache)
    seconds, rows = time.perf_counter() - start, table.num_rows
    fetch = lambda i: table[i]
else:
    from vembed.recipe import DataConfig
    from vembed.data import sources
    config = DataConfig(train=path)
    load = sources.load_rows if hasattr(sources, "load_rows") else sources.load_examples
    before, start = memory(), time.perf_counter()
    table, report = load(config, "train")
    seconds, rows = time.perf_counter() - start, len(table)
    fetch = lambda i: table[i]
after_load = memory()
import random
rng = random.Random(0)
for _ in range(2000):
    fetch(rng.randrange(rows))
after = memory()
print(json.dumps({"seconds": seconds, "rows": rows, "before": before, "after_load": after_load, "after_fetch": after}))
'''


def make_pairs(path: Path, rows: int, seed: int = 0) -> None:
    """`rows` text pairs: an 8-word query and a 40-word document from a 20,000-word made-up vocabulary."""
    if path.is_file() and path.with_suffix(".done").is_file():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    vocabulary = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 8))) for _ in range(20000)]
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as handle:
        for _ in range(rows):
            query, document = " ".join(rng.choices(vocabulary, k=8)), " ".join(rng.choices(vocabulary, k=40))
            handle.write(json.dumps({"query": query, "positive": document}) + "\n")
    tmp.replace(path)
    path.with_suffix(".done").write_text(str(rows))


def run(mode: str, data: Path, cache: Path, root: Path = ROOT, local_rank: int | None = None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(root), HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
    if local_rank is not None:
        env["LOCAL_RANK"] = str(local_rank)
    return subprocess.Popen([sys.executable, "-c", WORKER, mode, str(data), str(cache)], env=env, cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result(process: subprocess.Popen) -> dict:
    out, err = process.communicate(timeout=3600)
    if process.returncode != 0:
        raise RuntimeError(f"measurement failed ({process.returncode}):\n{err[-3000:]}")
    found = json.loads(out.strip().splitlines()[-1])
    for stage in ("after_load", "after_fetch"):
        found[f"growth_{stage}"] = {key: found[stage][key] - found["before"][key] for key in found["before"]}
    return found


def launch(data: Path, work: Path, cache: Path, root: Path = ROOT) -> dict:
    """One launch of the demo recipe on `data` (text pairs; no validation or test split): seconds to the first
    optimizer step and the memory of the training process then."""
    sys.path.insert(0, str(ROOT / "bench"))
    import startup

    memory: dict[str, int] = {}
    overrides = [f"data.train={data}", "data.validation=null", "data.test=null",
                 f"tokenizer_name={work / 'digits' / 'tokenizer'}", f"output_dir={cache / 'run'}",
                 "overwrite_output_dir=true", "max_steps=2"]
    command = [*startup.LAUNCHES[startup.ONE_PROCESS], str(ROOT / "configs" / "demo_clip.yaml"), "--config_override",
               *overrides]
    env = {"HF_DATASETS_CACHE": str(cache), "VEMBED_IMAGE_CACHE_DIR": str(cache / "images"), "WANDB_MODE": "offline",
           "HF_DATASETS_OFFLINE": "1"}
    seconds, cpu = startup.time_to_first_step(command, work, root=root, env=env, memory=memory, timeout=3600)
    if seconds is None or "VmHWM" not in memory:
        raise RuntimeError(f"the launch on {data} did not reach its first step")
    return {"seconds": seconds, "cpu_seconds": cpu, "peak_rss_mb": memory["VmHWM"] / 1024,
            "rss_private_mb": memory["RssAnon"] / 1024, "rss_file_backed_mb": memory["RssFile"] / 1024}


def prepare_launches(work: Path) -> None:
    """The demo's tokenizer (the digits data set) and the first-step hook, under `work`."""
    sys.path.insert(0, str(ROOT / "bench"))
    import startup

    from vembed.data.synthetic import make_digits_dataset

    make_digits_dataset(work / "digits")
    (work / "site").mkdir(exist_ok=True)
    (work / "site" / "sitecustomize.py").write_text(startup.SITECUSTOMIZE)


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary["median_seconds"])
    growth = summary["median_rss_growth_mb"]["after_load"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    axes[0].bar(range(len(names)), [summary["median_seconds"][n] for n in names], color="tab:blue")
    axes[0].set_title("seconds to load (median)", fontsize=9)
    private = [growth[n]["RssAnon"] for n in names]
    shared = [growth[n]["RssFile"] for n in names]
    axes[1].bar(range(len(names)), private, color="tab:orange", label="private (anonymous)")
    axes[1].bar(range(len(names)), shared, bottom=private, color="tab:gray", label="file-backed (mapped, shared)")
    axes[1].axhline(300, color="tab:red", linestyle="--", linewidth=1, label="target 300 MB")
    axes[1].set_title("RSS growth of the load, MB (median)", fontsize=9)
    axes[1].legend(fontsize=7)
    for ax in axes:
        ax.set_xticks(range(len(names)), [n.replace(" ", "\n", 1) for n in names], fontsize=7)
    fig.suptitle(f"{summary['rows']:,} text pairs ({summary['file_mb']:.0f} MB JSONL), {summary['rounds']} rounds",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data", default=None, help="where the generated JSONL goes (default: /tmp)")
    parser.add_argument("--baseline", help="another vembed checkout whose load_examples is timed alongside")
    parser.add_argument("--smoke", action="store_true", help="write nothing under bench/results")
    parser.add_argument("--launches-only", action="store_true", help="time the whole launches, not the loads alone")
    parser.add_argument("--no-launches", action="store_true", help="time the loads alone")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args(argv)
    data = Path(args.data or Path(tempfile.gettempdir()) / "vembed-data-scale" / f"pairs_{args.rows}.jsonl")
    print(f"data: {data} ({args.rows} rows)", flush=True)
    make_pairs(data, args.rows)
    small = data.with_name("pairs_2000.jsonl")
    make_pairs(small, 2000)
    work = Path(tempfile.mkdtemp(prefix="vembed-data-scale-"))
    measured: dict[str, list[dict]] = {}
    launches: dict[str, list[dict]] = {}
    if not args.no_launches:
        prepare_launches(work)

    def launched(name: str, found: dict) -> None:
        launches.setdefault(name, []).append(found)
        print(f"  {name:<24} {found['seconds']:7.2f} s to the first step ({found['cpu_seconds']:6.2f} CPU s), peak RSS "
              f"{found['peak_rss_mb']:7.1f} MB (at the step: private {found['rss_private_mb']:6.1f}, file-backed "
              f"{found['rss_file_backed_mb']:6.1f})", flush=True)

    def record(name: str, found: dict) -> None:
        measured.setdefault(name, []).append(found)
        for stage in ("after_load", "after_fetch"):
            growth = found[f"growth_{stage}"]
            print(f"  {name if stage == 'after_load' else '':<16} {stage:<11} "
                  f"{found['seconds'] if stage == 'after_load' else float('nan'):7.2f} s  RSS +{growth['VmRSS']:6.1f} "
                  f"MB (anonymous +{growth['RssAnon']:6.1f}, file-backed +{growth['RssFile']:6.1f}, of which mapped "
                  f"Arrow +{growth['ArrowMapped']:6.1f})", flush=True)

    try:
        for round_index in range(args.rounds):
            print(f"[round {round_index + 1}/{args.rounds}] load average {os.getloadavg()[0]:.2f}", flush=True)
            cache = work / f"cache-{round_index}"
            record("datasets cold", result(run("datasets", data, work / f"datasets-{round_index}")))
            record("datasets warm", result(run("datasets", data, work / f"datasets-{round_index}")))
            if not args.launches_only:
                record("vembed cold", result(run("vembed", data, cache)))
                record("vembed warm", result(run("vembed", data, cache)))
                pair = [run("vembed", data, work / f"ranks-{round_index}", local_rank=rank) for rank in (0, 1)]
                ranks = [result(process) for process in pair]
                record("vembed 2 ranks", max(ranks, key=lambda found: found["seconds"]))
                measured.setdefault("vembed 2 ranks, each", []).append(ranks)
            if args.baseline and not args.launches_only:
                record("baseline", result(run("vembed", data, work / f"base-{round_index}", Path(args.baseline))))
            roots = {"": ROOT, **({", baseline": Path(args.baseline).resolve()} if args.baseline else {})}
            for suffix, root in ({} if args.no_launches else roots).items():
                launched(f"launch 2k{suffix}", launch(small, work, work / f"launch-small{suffix}-{round_index}", root))
                big = work / f"launch{suffix}-{round_index}"
                launched(f"launch cold{suffix}", launch(data, work, big, root))
                launched(f"launch warm{suffix}", launch(data, work, big, root))
            for path in work.iterdir():
                if path.name.startswith(("cache-", "datasets-", "ranks-", "base-", "launch")):
                    shutil.rmtree(path, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def median(name: str, key: str, field: str | None = None) -> float:
        values = [m[key] if field is None else m[key][field] for m in measured[name]]
        return statistics.median(values)

    summary = {"rows": args.rows, "file_mb": data.stat().st_size / 2**20, "rounds": args.rounds,
               "machine": {"cpus": os.cpu_count(), "load_average_after": os.getloadavg()},
               "measured": measured, "launches": launches,
               "median_launch": {name: {key: statistics.median(found[key] for found in runs) for key in runs[0]}
                                 for name, runs in launches.items()},
               "median_seconds": {name: median(name, "seconds") for name in measured if name != "vembed 2 ranks, each"},
               "median_rss_growth_mb": {stage: {name: {field: median(name, f"growth_{stage}", field)
                                                       for field in ("VmRSS", "RssAnon", "RssFile", "ArrowMapped")}
                                                for name in measured if name != "vembed 2 ranks, each"}
                                        for stage in ("after_load", "after_fetch")}}
    seconds, growth = summary["median_seconds"], summary["median_rss_growth_mb"]
    summary["targets"] = {}
    if launches:
        runs = summary["median_launch"]
        extra = {kind: runs[f"launch {kind}"]["seconds"] - runs["launch 2k"]["seconds"] for kind in ("cold", "warm")}
        extra_rss = runs["launch warm"]["peak_rss_mb"] - runs["launch 2k"]["peak_rss_mb"]
        # over the 2k-row launch; CPU seconds as well: wall seconds on a shared machine move with other load
        summary["launch_extra_over_2k"] = {kind: {key: runs[f"launch {kind}"][key] - runs["launch 2k"][key]
                                                  for key in runs["launch 2k"]} for kind in ("cold", "warm")}
        own = {kind: seconds[f"datasets {kind}"] for kind in ("cold", "warm")}  # datasets' own load of the file
        summary["targets"].update({
            f"launch_extra_seconds_{kind}_le_2x_datasets_{kind}_load": {
                "value": extra[kind] / own[kind], "met": extra[kind] <= 2 * own[kind]}
            for kind in ("cold", "warm")})
        if args.rows == 1_000_000:
            summary["targets"]["launch_warm_extra_seconds_le_3s"] = {"value": extra["warm"], "met": extra["warm"] <= 3}
            summary["targets"]["launch_warm_extra_peak_rss_le_150mb"] = {"value": extra_rss, "met": extra_rss <= 150}
    vembed = [name for name in ("vembed cold", "vembed warm", "vembed 2 ranks") if name in measured]
    if not vembed:
        return _report(summary, args)
    worst_growth = max(growth["after_load"][name]["VmRSS"] for name in vembed)
    worst_private = max(growth["after_fetch"][name]["RssAnon"] for name in vembed)
    summary["targets"].update({
        # the load's growth of the whole RSS, for the rank that builds (cold), one that waits, and a second launch
        "rss_growth_per_rank_le_300mb": {"value": worst_growth, "met": worst_growth <= 300},
        # after 2,000 random fetches the mapped file adds shared, file-backed pages (datasets' own the same); the
        # rank's private memory stays put
        "private_memory_after_fetches_le_300mb": {"value": worst_private, "met": worst_private <= 300},
        "second_launch_le_3s": {"value": seconds["vembed warm"], "met": seconds["vembed warm"] <= 3},
        "first_launch_le_1.5x_datasets": {"value": seconds["vembed cold"] / seconds["datasets cold"],
                                          "met": seconds["vembed cold"] <= 1.5 * seconds["datasets cold"]},
    })
    return _report(summary, args)


def _report(summary: dict, args: argparse.Namespace) -> int:
    for name, found in summary["median_launch"].items():
        print(f"{name:<24} median {found['seconds']:.2f} s, peak RSS {found['peak_rss_mb']:.0f} MB")
    for name, target in summary["targets"].items():
        print(f"{name}: {target['value']:.2f} -> {'met' if target['met'] else 'MISSED'}")
    if not args.smoke:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = ("data_scale" if args.rows == 1_000_000 else f"data_scale_{args.rows}") + (
            "_launches" if args.launches_only else "")
        (out / f"{name}.json").write_text(json.dumps(summary, indent=2))
        if "vembed cold" in summary["median_seconds"]:
            plot(summary, out / f"{name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
