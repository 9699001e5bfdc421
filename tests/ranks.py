"""Run a function on N real gloo ranks in fresh processes, with a deadline.

Spawned, not forked (as `accelerate.debug_launcher` does): a forked child inherits torch's thread pool and
accelerate's singletons from whatever earlier tests did in this process, and can hang. Each rank writes its output to
a file, echoed when the ranks finish; past the deadline, the failure shows the ranks still alive, the end of their
output and their Python stacks (`deadline.py`).
"""

from __future__ import annotations

import gc
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from deadline import STACK_SIGNAL, describe, dump_stacks_and_kill, limit, tail


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, log_dir: str) -> None:
    import faulthandler

    log = open(Path(log_dir) / f"rank{rank}.log", "w")  # noqa: SIM115 - open until the process ends
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout.reconfigure(line_buffering=True)  # a killed rank still leaves what it printed
    faulthandler.register(STACK_SIGNAL, file=sys.stderr, all_threads=True)
    env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world,
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "GLOO_SOCKET_IFNAME": "lo", "ACCELERATE_USE_CPU": "true"}
    os.environ.update({key: str(value) for key, value in env.items()})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(*args)
        # Tear down together: a rank that destroys its gloo group while a peer is still working (rank 0 saving, say)
        # can abort in gloo's threads ("terminate called without an active exception", SIGABRT).
        dist.barrier()
    finally:
        # Drop the last references to FSDP / DeviceMesh state first, so the group's worker threads are joined here
        # and not during interpreter shutdown.
        gc.collect()
        dist.destroy_process_group()


def run_on_ranks(fn: Callable[..., Any], *args: Any, world: int = 2, timeout: float = 600) -> None:
    """Call `fn(*args)` on `world` ranks of a gloo process group; fail the test if any rank fails or time runs out
    (`timeout` seconds, times VEMBED_TEST_TIMEOUT_SCALE)."""
    import psutil
    import torch.multiprocessing as mp

    timeout = limit(timeout)
    with tempfile.TemporaryDirectory(prefix="ranks-") as log_dir:
        logs = [Path(log_dir) / f"rank{rank}.log" for rank in range(world)]
        context = mp.spawn(_rank_entry, args=(world, _free_port(), fn, args, log_dir), nprocs=world, join=False)
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=1):
                if time.monotonic() > deadline:
                    ranks = [rank for rank, p in enumerate(context.processes) if p.is_alive()]
                    alive = [psutil.Process(context.processes[rank].pid) for rank in ranks]
                    running = describe(alive, ranks)
                    dump_stacks_and_kill(alive, STACK_SIGNAL)
                    outputs = "\n".join(f"--- rank {rank} (last lines; Python stacks at the end if it was alive):\n"
                                         f"{tail(log.read_text(errors='replace'))}"
                                         for rank, log in enumerate(logs) if log.is_file())
                    pytest.fail(f"{world} ranks of {getattr(fn, '__qualname__', fn)} did not finish within "
                                f"{timeout:.0f} s (raise VEMBED_TEST_TIMEOUT_SCALE on a slow machine)\n"
                                f"ranks alive:\n{running}\n{outputs}", pytrace=False)
        finally:
            for rank, log in enumerate(logs):  # what the ranks printed, where the test's own output goes
                text = log.read_text(errors="replace") if log.is_file() else ""
                if text:
                    print(f"--- rank {rank} output:\n{text}", end="" if text.endswith("\n") else "\n")
