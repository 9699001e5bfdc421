"""Live speed figures of a training run: samples/s, tokens/s, peak memory and MFU, for every log line.

MFU (model FLOPs utilisation) = model FLOPs per second ÷ the device's peak FLOP/s. Model FLOPs come from the adapter
(`EmbeddingAdapter.forward_flops`, 3× for training; vembed/models/flops.py says how they are counted). The peak comes
from `PEAK_FLOPS`, a table of known accelerators (dense, no sparsity, vendor datasheets); for a CPU or an accelerator
not in the table it is a measured matmul ceiling, cached on disk (per CPU model, thread count, dtype and torch
version) so a run pays for the measurement once per machine. A ceiling measured while the machine was busy is too low,
and shows as MFU above 100%: the meter then measures again, once per run, and keeps the higher figure.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vembed.models.flops import TRAINING_FLOPS_PER_FORWARD

if TYPE_CHECKING:
    from accelerate import Accelerator

    from vembed.models.base import EmbeddingAdapter

# Dense peak FLOP/s per device by precision: "half" (bf16/fp16 tensor cores), "tf32", "fp32". Matched by substring of
# torch.cuda.get_device_name(), most specific first.
PEAK_FLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H200", {"half": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    ("H100 PCIe", {"half": 756.0e12, "tf32": 378.0e12, "fp32": 51.2e12}),
    ("H100 NVL", {"half": 835.5e12, "tf32": 417.8e12, "fp32": 60.0e12}),
    ("H100", {"half": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),  # SXM ("H100 80GB HBM3")
    ("A100", {"half": 312.0e12, "tf32": 156.0e12, "fp32": 19.5e12}),
    ("L40S", {"half": 362.1e12, "tf32": 183.0e12, "fp32": 91.6e12}),
    ("L4", {"half": 121.0e12, "tf32": 60.0e12, "fp32": 30.3e12}),
    ("A10", {"half": 125.0e12, "tf32": 62.5e12, "fp32": 31.2e12}),
    ("V100", {"half": 125.0e12, "tf32": 15.7e12, "fp32": 15.7e12}),  # no tf32: fp32 matmuls
    ("T4", {"half": 65.0e12, "tf32": 8.1e12, "fp32": 8.1e12}),
)

_CEILING_SIZE = {"cpu": 1024}  # matmul edge for the measured ceiling; accelerators: 4096
_measured: dict[str, float] = {}  # this process's measurements, by cache key


def precision_kind(mixed_precision: str | None) -> str:
    """Which column of PEAK_FLOPS the run's matmuls use."""
    if mixed_precision in ("bf16", "fp16"):
        return "half"
    if torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "fp32"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return _cpu_model()
    return device.type


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def table_peak_flops(name: str, kind: str) -> float | None:
    for pattern, peaks in PEAK_FLOPS:
        if pattern in name:
            return peaks[kind]
    return None


def peak_flops(device: torch.device, mixed_precision: str | None = None) -> tuple[float, str]:
    """Peak FLOP/s of one `device` at the run's precision, and where the figure came from ("table" or "measured")."""
    kind = precision_kind(mixed_precision)
    if device.type == "cuda":
        known = table_peak_flops(device_name(device), kind)
        if known is not None:
            return known, "table"
    return measured_matmul_flops(device, matmul_dtype(mixed_precision)), "measured"


def matmul_dtype(mixed_precision: str | None) -> torch.dtype:
    """The dtype whose matmul ceiling a run at `mixed_precision` is compared with."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision or "no", torch.float32)


def cache_file() -> Path:
    """Where measured ceilings are kept: $XDG_CACHE_HOME/vembed/peak_flops.json (default ~/.cache)."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "vembed" / "peak_flops.json"


def _cache_key(device: torch.device, dtype: torch.dtype) -> str:
    threads = torch.get_num_threads() if device.type == "cpu" else 0
    return f"{device_name(device)}|{device.type}|{dtype}|threads={threads}|torch={torch.__version__}"


def measured_matmul_flops(device: torch.device, dtype: torch.dtype = torch.float32) -> float:
    """The best FLOP/s of a square matmul on `device` (the practical ceiling of dense layers), measured once per
    machine, thread count, dtype and torch version, then read from `cache_file()`."""
    key = _cache_key(device, dtype)
    if key in _measured:
        return _measured[key]
    path = cache_file()
    cached = _read_cache(path)
    if key not in cached:
        cached[key] = _time_matmul(device, dtype)
        _write_cache(path, cached)
    _measured[key] = float(cached[key])
    return _measured[key]


def remeasure_matmul_flops(device: torch.device, dtype: torch.dtype = torch.float32) -> float:
    """Measure the ceiling again and keep the higher of the new and the known figure, here and in the cache. For when
    a reading shows the known one too low (MFU above 100%: it was measured while other work shared the machine)."""
    key = _cache_key(device, dtype)
    fresh = _time_matmul(device, dtype)
    path = cache_file()
    cached = _read_cache(path)
    best = max(fresh, float(cached.get(key, 0.0)), _measured.get(key, 0.0))
    if best != cached.get(key):
        cached[key] = best
        _write_cache(path, cached)
    _measured[key] = best
    return best


def _read_cache(path: Path) -> dict[str, float]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _time_matmul(device: torch.device, dtype: torch.dtype, repeats: int = 5) -> float:
    n = _CEILING_SIZE.get(device.type, 4096)
    # Its own generator: the global one drives dropout, and whether (and when) the ceiling is measured depends on
    # the cache and on timing, so drawing from it would make a run's masks, and resume, depend on them.
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=generator).to(dtype)
    b = torch.randn(n, n, device=device, generator=generator).to(dtype)
    sync = torch.get_device_module(device.type).synchronize if device.type != "cpu" else (lambda: None)
    a @ b  # warm-up: thread pool, kernel selection
    sync()
    best = float("inf")
    for _ in range(repeats):  # the best of a few runs: on a shared machine the slow ones measure the neighbours
        start = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def _write_cache(path: Path, cached: dict[str, float]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cached, indent=2))
        tmp.replace(path)  # atomic: concurrent ranks never read half a file
    except OSError:
        pass  # a read-only home only costs a re-measurement next run


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: CUDA's max allocated on a GPU, the peak resident set size elsewhere."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


class ThroughputMeter:
    """Sums the work of the batches since the last log line (text tokens and model FLOPs, kept on the device) and
    turns it into the speed fields of a log record.

    `add(batch)` is called for every micro-batch; `record(seconds, samples)` at every log line, on every rank (it
    gathers the ranks' sums: one small collective per log line, none per step).
    """

    def __init__(self, adapter: "EmbeddingAdapter", accelerator: "Accelerator", mixed_precision: str | None):
        self.adapter = adapter
        self.accelerator = accelerator
        self.mixed_precision = mixed_precision
        with accelerator.main_process_first():  # one rank measures the ceiling; the others read the cache
            self.peak_flops_per_device, self.peak_source = peak_flops(accelerator.device, mixed_precision)
        self.remeasured = False
        self.reset()

    def reset(self) -> None:
        self.tokens: torch.Tensor | int = 0
        self.forward_flops: torch.Tensor | int = 0

    def add(self, batch: dict[str, Any]) -> None:
        from vembed.models.flops import text_tokens

        count = getattr(self.adapter, "forward_flops", None)  # models outside the adapter contract (DiT) have none
        for inputs in batch.values():
            if isinstance(inputs, dict):  # the sides: query, positive, negative
                self.tokens = self.tokens + text_tokens(inputs)
                if count is not None:
                    self.forward_flops = self.forward_flops + count(inputs)

    def record(self, seconds: float) -> dict[str, float]:
        """tokens_per_second (when the batches had text), peak_memory_mb (the largest of any rank) and mfu (when the
        model counts its FLOPs), over the `seconds` since the last reset; then resets."""
        acc = self.accelerator
        dtype = torch.float32 if acc.device.type == "mps" else torch.float64  # MPS has no float64
        values = (self.tokens, self.forward_flops, float(peak_memory_bytes(acc.device)))
        local = torch.stack([torch.as_tensor(v, device=acc.device).to(dtype).reshape(()) for v in values])
        every = acc.gather(local.reshape(1, 3)).reshape(-1, 3).cpu()
        tokens, flops, peak = every[:, 0].sum().item(), every[:, 1].sum().item(), every[:, 2].max().item()
        seconds = max(seconds, 1e-9)
        training_flops_per_second = TRAINING_FLOPS_PER_FORWARD * flops / seconds
        out = {"peak_memory_mb": peak / 2**20}
        if flops:  # MFU only where the model counts its FLOPs
            out["mfu"] = training_flops_per_second / (self.peak_flops_per_device * acc.num_processes)
            if out["mfu"] > 1 and self.peak_source == "measured" and not self.remeasured and acc.is_main_process:
                # Faster than the ceiling: the ceiling is wrong (measured under load), not the run. Measure again,
                # once (only the main process's records are logged and saved).
                self.remeasured = True
                self.peak_flops_per_device = remeasure_matmul_flops(acc.device, matmul_dtype(self.mixed_precision))
                out["mfu"] = training_flops_per_second / (self.peak_flops_per_device * acc.num_processes)
        if tokens:
            out["tokens_per_second"] = tokens / seconds
        self.reset()
        return out
