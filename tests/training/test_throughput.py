"""Speed fields of the log records (samples/s, tokens/s, peak memory, MFU) and the cached CPU matmul ceiling."""

from __future__ import annotations

import json
import resource
from pathlib import Path

import pytest
import torch

from vembed.components import recipe_from_dict
from vembed.training import throughput
from vembed.training.loop import Trainer


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(throughput, "_measured", {})
    return tmp_path / "cache" / "vembed" / "peak_flops.json"


def test_log_records_carry_samples_tokens_memory_and_mfu(tiny_clip_recipe, fresh_cache):
    raw = dict(tiny_clip_recipe, max_steps=2, logging_steps=1, data={"train": tiny_clip_recipe["data"]["train"]})
    result = Trainer(recipe_from_dict(raw)).run()
    history = json.loads((Path(raw["output_dir"]) / "metrics.json").read_text())["loss_history"]
    assert history == result.metrics["loss_history"] and len(history) == 2
    rss_now_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    for record in history:
        assert record["samples_per_second"] > 0 and record["tokens_per_second"] > 0
        assert 0 < record["mfu"] <= 1
        assert 100 < record["peak_memory_mb"] <= rss_now_mb  # a torch process holds well over 100 MB
    assert fresh_cache.is_file()  # the ceiling MFU divides by was measured and cached


def test_cpu_matmul_ceiling_is_measured_once_then_read_from_the_cache(fresh_cache, monkeypatch):
    calls = []
    original = throughput._time_matmul

    def counting(device, dtype, repeats=5):
        calls.append(dtype)
        return original(device, dtype, repeats=2)

    monkeypatch.setattr(throughput, "_time_matmul", counting)
    cpu = torch.device("cpu")
    first = throughput.measured_matmul_flops(cpu)
    assert len(calls) == 1 and 1e8 < first < 1e14  # between 0.1 GFLOP/s and 100 TFLOP/s: a CPU
    monkeypatch.setattr(throughput, "_measured", {})  # a new process: only the file remains
    assert throughput.measured_matmul_flops(cpu) == first and len(calls) == 1
    cached = json.loads(fresh_cache.read_text())
    assert list(cached.values()) == [first] and "threads=" in next(iter(cached))
    peak, source = throughput.peak_flops(cpu, "no")
    assert (peak, source) == (first, "measured") and len(calls) == 1


def test_a_cached_ceiling_too_low_is_measured_again_and_replaced(tiny_clip_recipe, fresh_cache, monkeypatch):
    """A ceiling cached while the machine was busy reads as MFU above 100%; the meter measures again (once) and both
    the run's figure and the cache get the new one."""
    calls = []
    original = throughput._time_matmul

    def counting(device, dtype, repeats=5):
        calls.append(dtype)
        return original(device, dtype, repeats=2)

    monkeypatch.setattr(throughput, "_time_matmul", counting)
    key = throughput._cache_key(torch.device("cpu"), torch.float32)
    fresh_cache.parent.mkdir(parents=True)
    fresh_cache.write_text(json.dumps({key: 1e6}))  # 1 MFLOP/s: any real run beats it
    raw = dict(tiny_clip_recipe, max_steps=3, logging_steps=1, mixed_precision="no",
               data={"train": tiny_clip_recipe["data"]["train"]})
    history = Trainer(recipe_from_dict(raw)).run().metrics["loss_history"]
    assert all(0 < record["mfu"] <= 1 for record in history), [record["mfu"] for record in history]
    assert calls == [torch.float32]  # measured again once, not at every log line
    replaced = json.loads(fresh_cache.read_text())[key]
    assert replaced > 1e8 and replaced == throughput._measured[key]


def test_cache_key_names_the_cpu_threads_dtype_and_torch_version():
    cpu = torch.device("cpu")
    threads = torch.get_num_threads()
    key = throughput._cache_key(cpu, torch.float32)
    assert throughput._cpu_model() in key and torch.__version__ in key
    assert throughput._cache_key(cpu, torch.bfloat16) != key
    try:
        torch.set_num_threads(threads + 1)
        assert throughput._cache_key(cpu, torch.float32) != key
    finally:
        torch.set_num_threads(threads)
    assert throughput.matmul_dtype("bf16") == torch.bfloat16 and throughput.matmul_dtype(None) == torch.float32


def test_known_accelerators_come_from_the_table_most_specific_first():
    assert throughput.table_peak_flops("NVIDIA H100 80GB HBM3", "half") == 989.4e12
    assert throughput.table_peak_flops("NVIDIA H100 PCIe", "half") == 756.0e12
    assert throughput.table_peak_flops("NVIDIA A100-SXM4-80GB", "fp32") == 19.5e12
    assert throughput.table_peak_flops("NVIDIA L40S", "half") == 362.1e12  # not the L4 row
    assert throughput.table_peak_flops("Some Future GPU", "half") is None  # measured instead
