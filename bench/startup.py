"""Process start to first optimizer step, for the demo recipe (configs/demo_clip.yaml), through every door a user has:

    python bench/startup.py                 # every door, 3 interleaved rounds, median
    python bench/startup.py --profile       # also: where the time goes (cProfile of the one-process launch)
    python bench/startup.py --smoke         # one round of the one-process launch, into a temp folder: does it run?
    python bench/startup.py --baseline DIR  # also every door of another checkout, interleaved (before/after)
    python bench/startup.py --doors run.py "vembed train"   # only the doors whose names contain these words

- `python -m vembed.entrypoints.train configs/demo_clip.yaml` (one process, no launcher);
- `python run.py configs/demo_clip.yaml` and `vembed train configs/demo_clip.yaml` (validate, then launch);
- `accelerate launch vembed/entrypoints/train.py ...` and `accelerate launch -m vembed.entrypoints.train ...`
  (accelerate's CLI, which starts the training script as a second interpreter).

The clock starts before the process is spawned and stops when the training process finishes its first optimizer
step: a `sitecustomize.py` put first on PYTHONPATH registers a global optimizer-step hook in every process once
torch's optimizer module is imported there (a launcher that never steps never fires it), prints a marker and exits.
Nothing in vembed is changed for the measurement. CPU seconds are those of the launched process and the children it
waited for (a launcher's training child is counted when the launcher waits for it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = "VEMBED_BENCH_FIRST_STEP"
sys.path.insert(0, str(ROOT / "bench"))
from outputs import output_dir  # noqa: E402

SITECUSTOMIZE = '''
import os, sys
if os.environ.get("VEMBED_BENCH_FIRST_STEP"):
    import importlib.abc, importlib.util

    _profile = None
    if os.environ.get("VEMBED_BENCH_PROFILE"):
        import cProfile
        _profile = cProfile.Profile()
        _profile.enable()

    def _first_step(*_):
        if _profile is not None:
            _profile.disable()
            _profile.dump_stats(os.environ["VEMBED_BENCH_PROFILE"])
        memory = {}  # peak and current RSS, and its private part, in kB: read by bench/data_scale.py
        for line in open("/proc/self/status"):
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                memory[key] = int(value.split()[0])
        print("VEMBED_BENCH_FIRST_STEP", " ".join(f"{k}={v}" for k, v in memory.items()), flush=True)
        os._exit(0)

    class _HookWhenImported(importlib.abc.MetaPathFinder):
        # Registers the hook when torch.optim.optimizer is imported, so no process imports torch early for it.
        def find_spec(self, name, path=None, target=None):
            if name != "torch.optim.optimizer":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            load = spec.loader.exec_module

            def exec_module(module):
                load(module)
                module.register_optimizer_step_post_hook(_first_step)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _HookWhenImported())
'''

BIN = Path(sys.executable).parent  # the console scripts of this environment: accelerate, vembed
LAUNCHES = {
    "python -m vembed.entrypoints.train": [sys.executable, "-m", "vembed.entrypoints.train"],
    "python run.py": [sys.executable, "run.py"],
    "vembed train": [str(BIN / "vembed"), "train"],
    "accelerate launch train.py": [str(BIN / "accelerate"), "launch", "vembed/entrypoints/train.py"],
    "accelerate launch -m": [str(BIN / "accelerate"), "launch", "-m", "vembed.entrypoints.train"],
}
ONE_PROCESS = "python -m vembed.entrypoints.train"


def make_data(work: Path) -> list[str]:
    from vembed.data.synthetic import make_digits_dataset

    data = work / "data"
    make_digits_dataset(data)
    return [f"data.train={data}/train.jsonl", f"data.validation={data}/validation.jsonl",
            f"data.test={data}/test.jsonl", f"tokenizer_name={data}/tokenizer", f"output_dir={work}/run"]


def time_to_first_step(command: list[str], work: Path, profile: Path | None = None, timeout: float = 300,
                       root: Path = ROOT, env: dict[str, str] | None = None, memory: dict | None = None,
                       ) -> tuple[float, float]:
    """Wall seconds to the first optimizer step, and CPU seconds (user + system) the launched process and the children
    it waited for spent on the way: far less sensitive than wall time to other load on a shared machine. `env`: more
    environment; `memory`, when given, gets the training process's VmHWM (peak RSS), VmRSS, RssAnon and RssFile in
    kB at its first step."""
    import resource

    def cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    env = dict(os.environ, VEMBED_BENCH_FIRST_STEP="1", PYTHONPATH=f"{work / 'site'}{os.pathsep}{root}",
               HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", ""),  # as a user runs it: offline only if they set it
               **(env or {}))
    if profile is not None:
        env["VEMBED_BENCH_PROFILE"] = str(profile)
    cpu_before, start = cpu(), time.perf_counter()
    process = subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               text=True, start_new_session=True)
    wall = None
    try:
        for line in process.stdout:  # type: ignore[union-attr]
            if line.startswith(MARKER):
                wall = time.perf_counter() - start
                if memory is not None:
                    memory.update((k, int(v)) for k, v in (item.split("=") for item in line.split()[1:]))
                break
        else:
            raise RuntimeError(f"{command} ended (code {process.wait()}) without an optimizer step")
        # The training process exits at its marker; a launcher above it then returns its exit code.
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    finally:
        if process.poll() is None:
            os.killpg(process.pid, 9)  # its own session: the launcher and anything it started
        process.wait(timeout=timeout)
    return wall, cpu() - cpu_before


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary["seconds"])
    fig, axes = plt.subplots(1, 2, figsize=(max(10, 1.2 * len(names)), 4.2))
    colours = ["tab:gray" if n.endswith("baseline") else "tab:blue" for n in names]
    for ax, key, label in ((axes[0], "seconds", "wall seconds to first step"),
                           (axes[1], "cpu_seconds", "CPU seconds to first step (launched process + children)")):
        ax.bar(range(len(names)), [summary[f"median_{key}"][n] for n in names], color=colours)
        for i, name in enumerate(names):  # every round, so the spread shows
            ax.scatter([i] * len(summary[key][name]), summary[key][name], color="black", s=8, zorder=3)
        ax.axhline(summary["target_seconds"], color="tab:red", linestyle="--", linewidth=1, label="target 5 s")
        ax.set_xticks(range(len(names)), [textwrap.fill(n.replace(".", ". "), 14).replace(". ", ".") for n in names],
                      fontsize=6)
        ax.set_title(label, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"demo recipe, start to first optimizer step, {summary['rounds']} interleaved rounds", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="write a cProfile of the one-process launch")
    parser.add_argument("--smoke", action="store_true", help="one round of the one-process launch")
    parser.add_argument("--out", help="where JSON, plot and profile go (default: bench/results, or a temporary folder "
                                      "for --smoke)")
    parser.add_argument("--baseline", help="another vembed checkout (e.g. `git archive` of main) to time alongside")
    parser.add_argument("--doors", nargs="+", help="only the doors whose names contain one of these (default: all)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    work = Path(tempfile.mkdtemp(prefix="vembed-startup-"))
    (work / "site").mkdir()
    (work / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    overrides = make_data(work)
    recipe = str(ROOT / "configs" / "demo_clip.yaml")
    doors = {ONE_PROCESS: LAUNCHES[ONE_PROCESS]} if args.smoke else {
        name: command for name, command in LAUNCHES.items() if not args.doors or any(d in name for d in args.doors)}
    rounds = 1 if args.smoke else args.rounds
    launches = {name: (command, ROOT) for name, command in doors.items()}
    if args.baseline:  # each door of the other checkout beside this one's
        baseline = Path(args.baseline).resolve()
        launches = {key: value for name, command in doors.items()
                    for key, value in ((name, (command, ROOT)), (f"{name}, baseline", (command, baseline)))}
    times: dict[str, list[float]] = {name: [] for name in launches}
    cpu_times: dict[str, list[float]] = {name: [] for name in launches}
    load_before = os.getloadavg()
    names = list(launches)
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:  # interleaved, the order rotated every round
            command, root = launches[name]
            seconds, cpu_seconds = time_to_first_step([*command, recipe, "--config_override", *overrides], work,
                                                      root=root)
            times[name].append(seconds)
            cpu_times[name].append(cpu_seconds)
            print(f"[round {round_index + 1}/{rounds}] {name:<46} {seconds:6.2f} s to the first optimizer step "
                  f"({cpu_seconds:6.2f} CPU s)", flush=True)
    summary = {"recipe": "configs/demo_clip.yaml", "rounds": rounds, "seconds": times,
               "median_seconds": {name: statistics.median(t) for name, t in times.items()},
               "cpu_seconds": cpu_times, "median_cpu_seconds": {n: statistics.median(t) for n, t in cpu_times.items()},
               "target_seconds": 5.0, "machine": {"cpus": os.cpu_count(), "load_average_before": load_before,
                                                  "load_average_after": os.getloadavg()}}
    if args.profile:
        stats = work / "startup.prof"
        time_to_first_step([*LAUNCHES[ONE_PROCESS], recipe, "--config_override", *overrides], work, profile=stats)
        import pstats

        out = output_dir(args.out, args.smoke)
        with open(out / "startup_profile.txt", "w") as handle:
            pstats.Stats(str(stats), stream=handle).sort_stats("cumulative").print_stats(45)
        summary["profile"] = str(out / "startup_profile.txt")
    out = output_dir(args.out, args.smoke)
    (out / "startup.json").write_text(json.dumps(summary, indent=2))
    plot(summary, out / "startup.png")
    for name, median in summary["median_seconds"].items():
        print(f"{name:<46} median {median:.2f} s (target ≤ 5 s), {summary['median_cpu_seconds'][name]:.2f} CPU s")
    print(f"load average before {load_before}, after {summary['machine']['load_average_after']}")
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
