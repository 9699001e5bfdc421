"""examples/slurm: valid bash, and on a simulated 2-node allocation each node launches accelerate with its own rank,
the first node's address, the total process count, c10d rendezvous, the shipped accelerate config and the recipe; a
SIGUSR1 to the batch shell (SLURM's --signal=B:USR1) reaches the launchers, and their exit code 75 requeues the job,
which then resumes."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
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
[[ "$1" == requeue ]] && echo "$2" >> "$REQUEUED"
true
"""
# The per-node launcher (`python -m vembed.entrypoints.accelerate_launch`): writes down how it was called.
FAKE_LAUNCHER = """#!/bin/bash
printf '%q ' "$@" >> "$CALLS"; echo >> "$CALLS"
"""
# srun that starts its task in the background and passes SIGUSR1 on to it, as srun does.
FORWARDING_SRUN = """#!/bin/bash
while [[ "$1" == --* ]]; do shift; done
trap 'kill -USR1 $task' USR1
SLURM_NODEID=0 "$@" & task=$!
while true; do wait $task; code=$?; kill -0 $task 2>/dev/null || exit $code; done
"""
# A launcher that trains until SIGUSR1, then leaves as preempted ranks do (exit 75); bounded at 60 s.
PREEMPTED_LAUNCHER = """#!/bin/bash
trap 'exit 75' USR1
echo started > "$STARTED"
for _ in $(seq 600); do sleep 0.1; done
exit 1
"""


def _cluster(tmp_path: Path, **bins: str) -> dict[str, str]:
    """A bin folder with the stand-ins, first on PATH, and a 2-node allocation's environment."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in bins.items():
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", CALLS=str(tmp_path / "calls.txt"),
                REQUEUED=str(tmp_path / "requeued.txt"), STARTED=str(tmp_path / "started.txt"), SLURM_NNODES="2",
                SLURM_GPUS_ON_NODE="4", SLURM_JOB_NODELIST="gpu-node-[a-b]", SLURM_JOB_ID="1234")


@pytest.mark.parametrize("script", ["ddp.sbatch", "fsdp.sbatch"])
def test_script_is_valid_bash(script):
    subprocess.run(["bash", "-n", str(SLURM / script)], check=True)


def _option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.mark.parametrize("script, config", [("ddp.sbatch", "ddp.yaml"), ("fsdp.sbatch", "fsdp.yaml")])
def test_each_node_launches_with_its_rank_and_the_first_nodes_address(tmp_path, script, config):
    env = _cluster(tmp_path, srun=FAKE_SRUN, scontrol=FAKE_SCONTROL, python=FAKE_LAUNCHER)
    subprocess.run(["bash", str(SLURM / script), "configs/my.yaml", "--config_override", "batch_size=64"],
                   cwd=tmp_path, env=env, check=True, capture_output=True, text=True, timeout=30)
    launches = [shlex.split(line) for line in (tmp_path / "calls.txt").read_text().splitlines()]
    assert [_option(args, "--machine_rank") for args in launches] == ["0", "1"]
    assert not (tmp_path / "requeued.txt").exists()  # a launch that ended well is not requeued
    for args in launches:
        assert args[:2] == ["-m", "vembed.entrypoints.accelerate_launch"]  # passes stop signals on to the ranks
        assert _option(args, "--config_file") == f"accelerate_configs/{config}"
        assert _option(args, "--num_machines") == "2"
        assert _option(args, "--num_processes") == "8"  # all GPUs of all nodes
        assert _option(args, "--main_process_ip") == "gpu-node-a"
        assert _option(args, "--main_process_port") == str(20000 + 1234)
        assert _option(args, "--rdzv_backend") == "c10d"
        assert args[-4:] == ["vembed/entrypoints/train.py", "configs/my.yaml", "--config_override", "batch_size=64"]


@pytest.mark.parametrize("script", ["ddp.sbatch", "fsdp.sbatch"])
def test_sigusr1_to_the_batch_shell_reaches_the_launcher_and_its_exit_75_requeues(tmp_path, script):
    env = _cluster(tmp_path, srun=FORWARDING_SRUN, scontrol=FAKE_SCONTROL, python=PREEMPTED_LAUNCHER)
    job = subprocess.Popen(["bash", str(SLURM / script), "configs/my.yaml"], cwd=tmp_path, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 30
    while not (tmp_path / "started.txt").exists():
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[0]
        time.sleep(0.05)
    job.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@300 sends
    output, _ = job.communicate(timeout=30)
    assert job.returncode == 75, output
    assert (tmp_path / "requeued.txt").read_text().split() == ["1234"], output
    assert "requeueing job 1234" in output


@pytest.mark.parametrize("script", ["ddp.sbatch", "fsdp.sbatch"])
def test_a_requeued_job_resumes_from_its_checkpoint(tmp_path, script):
    env = dict(_cluster(tmp_path, srun=FAKE_SRUN, scontrol=FAKE_SCONTROL, python=FAKE_LAUNCHER),
               SLURM_RESTART_COUNT="1")
    subprocess.run(["bash", str(SLURM / script), "configs/my.yaml", "--config_override", "batch_size=64"],
                   cwd=tmp_path, env=env, check=True, capture_output=True, text=True, timeout=30)
    for args in (shlex.split(line) for line in (tmp_path / "calls.txt").read_text().splitlines()):
        assert args[-5:] == ["configs/my.yaml", "--config_override", "batch_size=64", "--config_override",
                             "resume_from=auto"]
