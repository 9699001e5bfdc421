"""Run a function on N real gloo ranks in fresh processes, with a deadline.

Spawned, not forked (as `accelerate.debug_launcher` does): a forked child inherits torch's thread pool and
accelerate's singletons from whatever earlier tests did in this process, and can hang.
"""

from __future__ import annotations

import gc
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple) -> None:
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


def run_on_ranks(fn: Callable[..., Any], *args: Any, world: int = 2, timeout: float = 180) -> None:
    """Call `fn(*args)` on `world` ranks of a gloo process group; fail the test if any rank fails or time runs out."""
    import torch.multiprocessing as mp

    context = mp.spawn(_rank_entry, args=(world, _free_port(), fn, args), nprocs=world, join=False)
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{world} ranks did not finish within {timeout:.0f} s")
