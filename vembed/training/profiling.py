"""The recipe's `profile:` block: torch.profiler over a window of training batches, a Chrome trace per rank, and a
step-time breakdown (data wait, forward, backward, optimizer; communication as the profiler records it).

The loop calls `step()` after every batch and `close()` when training stops; nothing else. Phases are timed with
hooks installed only for the profiled window, so an unprofiled run pays nothing. Each phase is measured on its own:
- data wait: from the end of the previous batch to the first forward of this one (loading, collation, host→device);
- forward: time inside the towers' top-level modules (every encoder pass, GradCache's re-encoding included);
- backward: time inside `accelerator.backward` (every backward the step makes; DDP's overlapped all-reduce and
  recomputation under gradient checkpointing included);
- optimizer: time inside `optimizer.step()`.
The intervals do not overlap, so they add up to at most the batch's wall time; `other` is what none of them covers
(the loss, gradient clipping, the loop's own work), never negative unless a phase was counted twice.
On an accelerator every boundary synchronises the device, so the window's batches run a little slower than others.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from accelerate import Accelerator

    from vembed.models.base import EmbeddingAdapter
    from vembed.recipe import ProfileConfig

MEASURED = ("data_wait", "forward", "backward", "optimizer")  # timed on their own; "other" is the rest
PHASES = (*MEASURED, "other")
# Collective operations as they appear in profiler events: the backend's own spans (gloo:/nccl: ...) are preferred,
# since c10d's dispatcher spans time only the launch of asynchronous work.
_COLLECTIVES = ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "broadcast", "all_to_all")


class _Hook:
    """A module hook that reports to the profiler. It pickles as a no-op: DataLoader workers receive a copy of the
    adapter (for `preprocess`) and must not drag the profiler along."""

    def __init__(self, callback: Any = None):
        self.callback = callback

    def __call__(self, *args: Any) -> None:
        if self.callback is not None:
            self.callback()

    def __reduce__(self) -> tuple[type, tuple]:
        return (_Hook, ())


class _BackwardPatch:
    """Shadows `accelerator.backward` with `timed` (an instance attribute) until `remove()`, like a hook handle."""

    def __init__(self, accelerator: "Accelerator", timed: Any):
        self.accelerator = accelerator
        self.previous = accelerator.__dict__.get("backward")
        accelerator.backward = timed

    def remove(self) -> None:
        if self.previous is None:
            self.accelerator.__dict__.pop("backward", None)
        else:
            self.accelerator.backward = self.previous


class StepProfiler:
    """Profiles batches `wait + warmup` to `wait + warmup + active` (0-based, counted from this launch's first)."""

    def __init__(
        self,
        config: "ProfileConfig",
        accelerator: "Accelerator",
        adapter: "EmbeddingAdapter",
        optimizer: torch.optim.Optimizer,
        output_dir: Path,
    ):
        self.enabled = config.enabled
        self.breakdown: dict[str, Any] | None = None
        if not self.enabled:
            return
        self.accelerator = accelerator
        self.adapter = adapter
        self.optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds the torch optimizer
        self.dir = Path(config.output_dir) if config.output_dir else Path(output_dir) / "profile"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank = accelerator.process_index
        self.trace_path = self.dir / f"trace_rank{self.rank}.json"
        self.first, self.last = config.wait + config.warmup, config.wait + config.warmup + config.active
        self.batch = 0  # batches completed
        self.records: list[dict[str, float]] = []
        self.communication_ms: float | None = None
        self._handles: list[Any] = []
        self._cuda = accelerator.device.type == "cuda"
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self._cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=config.wait, warmup=config.warmup, active=config.active, repeat=1),
            on_trace_ready=self._trace_ready,
        )
        self.profiler.start()
        if self.first == 0:
            self._install()
        self._batch_start = self._now()

    # --- called by the loop ----------------------------------------------------------------------------------------
    def step(self) -> None:
        """End of a batch."""
        if not self.enabled or self.profiler is None:
            return
        if self._handles:
            self._finish_batch()
        self.batch += 1
        self.profiler.step()  # exports the trace after the last active batch
        if self.batch == self.first:
            self._install()
        if self.batch >= self.last:
            self.close()
            return
        self._batch_start = self._now()

    def close(self) -> None:
        """Stop (also when training ends inside the window: the batches recorded so far are reported)."""
        if not self.enabled or self.profiler is None:
            return
        self._remove()
        profiler, self.profiler = self.profiler, None
        profiler.stop()
        self._report()

    # --- timing ----------------------------------------------------------------------------------------------------
    def _now(self) -> float:
        if self._cuda:
            torch.cuda.synchronize(self.accelerator.device)
        return time.perf_counter()

    def _install(self) -> None:
        self._current: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._first_forward: float | None = None
        self._in_backward = False
        if hasattr(self.adapter, "towers"):
            timed = [child for tower in self.adapter.towers() for child in tower.children()]
        else:  # the DiT has no towers, and its blocks sit in a ModuleList, which is never called: time it whole
            timed = [self.adapter]
        for module in timed:
            self._handles.append(module.register_forward_pre_hook(_Hook(self._forward_start)))
            self._handles.append(module.register_forward_hook(_Hook(self._forward_end)))
        self._handles.append(self.optimizer.register_step_pre_hook(lambda *_: self._optimizer_start()))
        self._handles.append(self.optimizer.register_step_post_hook(lambda *_: self._optimizer_end()))
        # Every train step (plain, GradCache) calls accelerator.backward; an instance attribute shadows the method
        # for the window only.
        self._backward = self.accelerator.backward
        self._handles.append(_BackwardPatch(self.accelerator, self._timed_backward))

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _timed_backward(self, *args: Any, **kwargs: Any) -> None:
        started = self._now()
        self._in_backward = True
        try:
            self._backward(*args, **kwargs)
        finally:
            self._in_backward = False
            self._current["backward"] += self._now() - started

    def _forward_start(self) -> None:
        if self._in_backward:  # recomputation under gradient checkpointing: part of backward
            return
        self._forward_started = self._now()
        if self._first_forward is None:
            self._first_forward = self._forward_started

    def _forward_end(self) -> None:
        if not self._in_backward:
            self._current["forward"] += self._now() - self._forward_started

    def _optimizer_start(self) -> None:
        self._optimizer_started = self._now()

    def _optimizer_end(self) -> None:
        self._current["optimizer"] += self._now() - self._optimizer_started

    def _finish_batch(self) -> None:
        total = self._now() - self._batch_start
        current = self._current
        current["data_wait"] = (self._first_forward or self._batch_start) - self._batch_start
        current["other"] = total - sum(current[phase] for phase in MEASURED)  # not clamped: < 0 would be a bug
        current["total"] = total
        self.records.append(current)
        self._current = dict.fromkeys(PHASES, 0.0)
        self._first_forward = None

    # --- results ---------------------------------------------------------------------------------------------------
    def _trace_ready(self, profiler: torch.profiler.profile) -> None:
        profiler.export_chrome_trace(str(self.trace_path))
        self.communication_ms = communication_ms(profiler.key_averages(), max(self.last - self.first, 1))

    def _report(self) -> None:
        n = len(self.records)
        mean = {k: 1000 * sum(r[k] for r in self.records) / n for k in (*PHASES, "total")} if n else {}
        self.breakdown = {"rank": self.rank, "batches": n, "ms_per_batch": mean,
                          "communication_ms_per_batch": self.communication_ms,
                          "trace": str(self.trace_path) if self.trace_path.is_file() else None}
        (self.dir / f"breakdown_rank{self.rank}.json").write_text(json.dumps(self.breakdown, indent=2))
        self.accelerator.print(format_breakdown(self.breakdown))


def communication_ms(events: Any, batches: int) -> float | None:
    """Milliseconds per batch spent in collectives, from `profiler.key_averages()`; None when there were none
    (one process)."""
    backend, dispatcher = 0.0, 0.0
    for event in events:
        name = event.key.lower()
        if not any(c in name for c in _COLLECTIVES):
            continue
        device_us = getattr(event, "device_time_total", 0) or 0
        spent = device_us if device_us > 0 else event.cpu_time_total
        if name.startswith(("gloo:", "nccl:")) or "nccl" in name:
            backend += spent
        elif name.startswith("c10d::"):
            dispatcher += spent
    total = backend or dispatcher
    return total / 1000 / batches if total else None


def format_breakdown(breakdown: dict[str, Any]) -> str:
    mean = breakdown["ms_per_batch"]
    if not mean:
        return f"profile (rank {breakdown['rank']}): no batch was profiled; training ended before the window"
    lines = [f"step-time breakdown (rank {breakdown['rank']}, mean of {breakdown['batches']} batches)"]
    labels = {"data_wait": "data wait", "forward": "forward", "backward": "backward", "optimizer": "optimizer",
              "other": "other"}
    for key, label in labels.items():
        share = 100 * mean[key] / mean["total"] if mean["total"] else 0.0
        lines.append(f"  {label:<18}{mean[key]:>9.1f} ms {share:>5.1f}%")
    lines.append(f"  {'total':<18}{mean['total']:>9.1f} ms")
    comm = breakdown["communication_ms_per_batch"]
    lines.append(f"  {'communication':<18}" + (f"{comm:>9.1f} ms (overlaps backward under DDP)" if comm is not None
                                               else "      n/a (one process)"))
    if breakdown["trace"]:
        lines.append(f"  trace: {breakdown['trace']} (open in https://ui.perfetto.dev)")
    return "\n".join(lines)
