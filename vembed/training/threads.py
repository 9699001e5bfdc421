"""How many intra-op threads (torch.set_num_threads) a training or evaluation process uses: the OMP_NUM_THREADS the
user set before launching, else the cores this process may run on, shared by the processes started on this machine.

Launchers set OMP_NUM_THREADS for the processes they start whether the user did or not: accelerate's launcher sets 1
(its CPU configs: physical cores / processes), torchrun 1 for several processes. That 1 left a one-process CPU run on
one core (0.50x sentence-transformers' samples/s on 2 cores). So the variable counts only where the user set it:
run.py / `vembed train` hand on what the user's environment held (USER_THREADS_ENV); under `accelerate launch` or
torchrun it is read from the launcher's own environment, the one the user started it with (Linux:
/proc/<ppid>/environ; elsewhere a launched process's OMP_NUM_THREADS is taken as the user's); a process started with
no launcher has the user's own.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

USER_THREADS_ENV = "VEMBED_USER_OMP_NUM_THREADS"  # set by run.py, vembed train / eval: the user's value, "" if unset


@dataclass(frozen=True)
class ThreadChoice:
    """The intra-op thread count of this process and why (for the start block)."""

    count: int
    reason: str


def choose_threads(cores: int, local_processes: int, user_value: str | None) -> ThreadChoice:
    """The rule: a positive OMP_NUM_THREADS the user set wins; else cores // local processes (at least 1)."""
    if user_value is not None and user_value.strip().isdigit() and int(user_value) > 0:
        return ThreadChoice(int(user_value), f"OMP_NUM_THREADS={int(user_value)}, set by the user")
    processes = max(1, local_processes)
    count = max(1, cores // processes)
    ignored = f"; OMP_NUM_THREADS={user_value!r} is not a positive number" if user_value not in (None, "") else ""
    return ThreadChoice(count, f"{cores} core{'s' if cores != 1 else ''} / {processes} "
                               f"process{'es' if processes != 1 else ''} on this machine{ignored}")


def available_cores() -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota (containers)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def local_processes(env: Mapping[str, str]) -> int:
    """The processes launched on this machine: torchrun's LOCAL_WORLD_SIZE (accelerate's multi-process launchers
    use it), else this one."""
    value = env.get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else 1


def user_omp_num_threads(env: Mapping[str, str]) -> str | None:
    """The OMP_NUM_THREADS the user set before launching (None: not set), not the one a launcher put in."""
    if USER_THREADS_ENV in env:
        return env[USER_THREADS_ENV] or None
    from vembed.training.launch_promise import started_by_accelerate_or_torchrun

    if started_by_accelerate_or_torchrun(env):
        parent = _parent_environment()
        if parent is not None:
            return parent.get("OMP_NUM_THREADS")
    return env.get("OMP_NUM_THREADS")


def _parent_environment() -> dict[str, str] | None:
    """The environment the parent process (the launcher) was started with; None where it cannot be read."""
    try:
        raw = Path(f"/proc/{os.getppid()}/environ").read_bytes()
    except OSError:
        return None
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {key: value for key, _, value in pairs}


def use_threads(env: Mapping[str, str] | None = None) -> ThreadChoice:
    """Choose this process's intra-op thread count by the rule and set it on torch."""
    import torch

    env = os.environ if env is None else env
    choice = choose_threads(available_cores(), local_processes(env), user_omp_num_threads(env))
    torch.set_num_threads(choice.count)
    return choice
