"""examples/slurm: valid bash, and on a simulated 2-node allocation each node launches accelerate with its own rank,
the first node's address, the total process count, c10d rendezvous, the shipped accelerate config and the recipe."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SLURM = ROOT / "examples" / "slurm"

# Stand-ins for the cluster: srun runs its command once per node with that node's SLURM_NODEID, scontrol lists two
# hosts, and accelerate writes down how it was called.
FAKE_SRUN = """#!/bin/bash
while [[ "$1" == --* ]]; do shift; done
for node in $(seq 0 $(( SLURM_NNODES - 1 ))); do SLURM_NODEID=$node "$@" || exit $?; done
"""
FAKE_SCONTROL = """#!/bin/bash
[[ "$1 $2" == "show hostnames" ]] && printf 'gpu-node-a\\ngpu-node-b\\n'
"""
FAKE_ACCELERATE = """#!/bin/bash
printf '%q ' "$@" >> "$CALLS"; echo >> "$CALLS"
"""


@pytest.mark.parametrize("script", ["ddp.sbatch", "fsdp.sbatch"])
def test_script_is_valid_bash(script):
    subprocess.run(["bash", "-n", str(SLURM / script)], check=True)


def _option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.mark.parametrize("script, config", [("ddp.sbatch", "ddp.yaml"), ("fsdp.sbatch", "fsdp.yaml")])
def test_each_node_launches_with_its_rank_and_the_first_nodes_address(tmp_path, script, config):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("accelerate", FAKE_ACCELERATE)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls.txt"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", CALLS=str(calls), SLURM_NNODES="2",
               SLURM_GPUS_ON_NODE="4", SLURM_JOB_NODELIST="gpu-node-[a-b]", SLURM_JOB_ID="1234")
    subprocess.run(["bash", str(SLURM / script), "configs/my.yaml", "--config_override", "batch_size=64"],
                   cwd=tmp_path, env=env, check=True, capture_output=True, text=True, timeout=30)
    launches = [shlex.split(line) for line in calls.read_text().splitlines()]
    assert [_option(args, "--machine_rank") for args in launches] == ["0", "1"]
    for args in launches:
        assert args[0] == "launch"
        assert _option(args, "--config_file") == f"accelerate_configs/{config}"
        assert _option(args, "--num_machines") == "2"
        assert _option(args, "--num_processes") == "8"  # all GPUs of all nodes
        assert _option(args, "--main_process_ip") == "gpu-node-a"
        assert _option(args, "--main_process_port") == str(20000 + 1234)
        assert _option(args, "--rdzv_backend") == "c10d"
        assert args[-4:] == ["vembed/entrypoints/train.py", "configs/my.yaml", "--config_override", "batch_size=64"]
