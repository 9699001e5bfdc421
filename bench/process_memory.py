"""This process's resident memory on Linux, shared by the memory benchmarks: current RSS, the high-water mark
(VmHWM), and resetting that mark so a peak can be taken over one window."""

from __future__ import annotations

from pathlib import Path


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def rss_bytes() -> int:
    return _status_bytes("VmRSS")


def peak_rss_bytes() -> int:
    return _status_bytes("VmHWM")


def reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
