"""Generous time limits for tests that start processes, and failures that say what was still running.

A limit tuned on a quiet machine trips on a loaded one (on 2 shared cores the suite once took 32 minutes and a ZeRO-2
launch hit its fixed 240 s). Limits here are far above a normal run and scale with VEMBED_TEST_TIMEOUT_SCALE; when one
trips, the failure names the command, the processes still alive (rank, state, CPU time) and the last lines of their
output, which ends with their Python stacks (dumped by faulthandler before they are killed).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import pytest

TIMEOUT_SCALE = float(os.environ.get("VEMBED_TEST_TIMEOUT_SCALE", "1"))
# Processes that registered faulthandler for it dump their stacks (see `ranks.py`); not SIGUSR1, which a training run
# takes as a request to stop after its step (vembed/training/preemption.py).
STACK_SIGNAL = signal.SIGUSR2
TAIL_LINES = 40


def limit(seconds: float) -> float:
    """A test's time limit on this machine: `seconds` (generous for a quiet one) times VEMBED_TEST_TIMEOUT_SCALE."""
    return seconds * TIMEOUT_SCALE


def tail(text: str, lines: int = TAIL_LINES) -> str:
    return "\n".join(text.splitlines()[-lines:])


def describe(processes: Iterable, ranks: Sequence[int] | None = None) -> str:
    """One line per live process (psutil.Process): pid, rank (`ranks`, else RANK from the environment it started
    with), state, CPU seconds, command."""
    import psutil

    rows = []
    for i, process in enumerate(processes):
        try:
            with process.oneshot():
                rank = ranks[i] if ranks is not None else process.environ().get("RANK", "-")
                cpu = process.cpu_times()
                command = " ".join(process.cmdline())
                rows.append(f"  pid {process.pid} rank {rank} {process.status()} cpu {cpu.user + cpu.system:.1f} s: "
                            f"{command[:160]}")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return "\n".join(rows) or "  (none)"


def dump_stacks_and_kill(processes: Sequence, stack_signal: int | None) -> None:
    """Ask each process for its Python stacks (`stack_signal`, or SIGABRT under PYTHONFAULTHANDLER), then kill all."""
    import psutil

    for process in processes if stack_signal is not None else ():
        try:
            process.send_signal(stack_signal)
        except psutil.NoSuchProcess:
            continue
        time.sleep(1)  # one at a time, so that stacks written to a shared stderr do not interleave
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(processes, timeout=10)


def run_with_deadline(command: Sequence[str], *, cwd: Path, env: dict[str, str], timeout: float,
                      log_dir: Path) -> subprocess.CompletedProcess:
    """`subprocess.run(command)` with its output in `log_dir`; past `timeout` seconds, fail the test saying what was
    still running (the command, live processes with their ranks, the last lines of output and the ranks' stacks)."""
    import psutil

    log_dir.mkdir(parents=True, exist_ok=True)
    out_path, err_path = log_dir / "stdout.log", log_dir / "stderr.log"
    env = dict(env, PYTHONFAULTHANDLER="1")  # a fatal signal (the SIGABRT below) dumps every thread's Python stack
    with open(out_path, "w") as out, open(err_path, "w") as err:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=err, start_new_session=True)
        try:
            returncode = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            returncode = None
    if returncode is None:
        root = psutil.Process(process.pid)
        tree = [root, *root.children(recursive=True)]
        alive = describe(tree)
        ranks = [p for p in tree if _has_rank(p)]
        for launcher in tree:
            if launcher not in ranks:
                try:
                    launcher.suspend()  # else it kills the other ranks as soon as one aborts
                except psutil.NoSuchProcess:
                    pass
        dump_stacks_and_kill(ranks, signal.SIGABRT)  # their stacks first
        dump_stacks_and_kill(tree, None)
        pytest.fail(
            f"still running after {timeout:.0f} s (raise VEMBED_TEST_TIMEOUT_SCALE on a slow machine): "
            f"{' '.join(command)}\nprocesses alive:\n{alive}\n"
            f"last lines of stdout:\n{tail(out_path.read_text(errors='replace'))}\n"
            f"last lines of stderr (ending with the ranks' Python stacks):\n"
            f"{tail(err_path.read_text(errors='replace'), 3 * TAIL_LINES)}",
            pytrace=False,
        )
    return subprocess.CompletedProcess(command, returncode, out_path.read_text(errors="replace"),
                                       err_path.read_text(errors="replace"))


def _has_rank(process) -> bool:
    import psutil

    try:
        return "RANK" in process.environ()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
