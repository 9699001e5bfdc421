"""What started this process and what it promised: the command the user typed (run.py, vembed train, accelerate
launch, or none), the number of processes it asked for, and how to phrase a fix in that command's own flags. It
launches nothing (vembed/entrypoints/launch.py does); launch_plan.py checks the promise against the launch.

accelerate's simple launcher starts ONE process for `--cpu --num_processes N` and for a saved `MULTI_CPU` config
(more need mpirun), and it sets no WORLD_SIZE. The launcher's own arguments and config file are then the only record
of the promise, so we read them from the parent process (Linux: /proc/<ppid>/cmdline; elsewhere the check is skipped
for plain `accelerate launch`, while run.py and `vembed train` always pass the promise in the environment).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from accelerate import Accelerator

LAUNCHER_ENV = "VEMBED_LAUNCHER"  # set by run.py / `vembed train`: the command the user typed
EXPECTED_WORLD_SIZE_ENV = "VEMBED_EXPECTED_WORLD_SIZE"  # set by run.py / `vembed train`: processes it launched
LAUNCHER_PID_ENV = "VEMBED_LAUNCHER_PID"  # set by run.py / `vembed train`: its pid, the parent of every rank

ACCELERATE_LAUNCH = "accelerate launch"


@dataclass(frozen=True)
class LaunchPromise:
    """The command that started us and the process count it promised (None: nothing was promised)."""

    command: str | None  # "python run.py", "vembed train", "accelerate launch", or None (python -m, a notebook)
    num_processes: int | None
    source: str = ""  # where the count comes from, for messages: "--num_processes 2", "config ~/.../default.yaml"
    distributed_type: str | None = None  # the accelerate config's, when one was read
    cpu_flag: bool = False  # `accelerate launch --cpu`

    def use_config_hint(self, name: str) -> str:
        """How to launch with our accelerate config `name` using the command the user ran."""
        if self.command in ("python run.py", "vembed train"):
            return f"`{self.command} RECIPE --accelerate_config {name}`"
        return f"`accelerate launch --config_file {config_path_for_hint(name)} -m vembed.entrypoints.train RECIPE`"


def config_path_for_hint(name: str) -> str:
    """Our accelerate config `name` as a path the user can type: the clone's `accelerate_configs/NAME.yaml` when
    run from its root, else the file shipped in the package."""
    from vembed.resources import accelerate_configs

    if (Path.cwd() / "accelerate_configs" / f"{name}.yaml").is_file():
        return f"accelerate_configs/{name}.yaml"
    return str(accelerate_configs() / f"{name}.yaml")


def read_promise(env: Mapping[str, str] | None = None) -> LaunchPromise:
    env = os.environ if env is None else env
    expected = env.get(EXPECTED_WORLD_SIZE_ENV, "")
    if expected.isdigit():
        return LaunchPromise(env.get(LAUNCHER_ENV) or "python run.py", int(expected), "the launcher")
    arguments = _parent_accelerate_launch_arguments()
    if arguments is None:
        return LaunchPromise(None, None)
    return promise_of_accelerate_launch(arguments)


def started_by_accelerate_or_torchrun(env: Mapping[str, str]) -> bool:
    """This process is a rank that `accelerate launch` or torchrun started (its parent is that launcher)."""
    return "TORCHELASTIC_RUN_ID" in env or _parent_accelerate_launch_arguments() is not None


def _parent_accelerate_launch_arguments() -> list[str] | None:
    """The arguments after `accelerate launch` (or `python -m accelerate.commands.launch`) of our parent process."""
    try:
        argv = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    argv = [a for a in argv if a]
    for i, arg in enumerate(argv[:4]):
        if arg == "accelerate.commands.launch" or (arg == "launch" and i > 0 and "accelerate" in argv[i - 1]):
            return argv[i + 1:]
    return None


def promise_of_accelerate_launch(arguments: list[str]) -> LaunchPromise:
    """The process count `accelerate launch ARGUMENTS` promised: `--num_processes`, else its config file's (the one
    named by `--config_file`, else the one `accelerate config` saved)."""
    from accelerate.commands.launch import launch_command_parser

    try:
        args, _ = launch_command_parser().parse_known_args(arguments)
    except SystemExit:  # not parseable: promise nothing rather than guess
        return LaunchPromise(ACCELERATE_LAUNCH, None)
    config = _launch_config_file(args.config_file)
    settings = _read_yaml(config) if config else {}
    kind = str(settings.get("distributed_type") or "") or None
    if args.num_processes is not None:
        return LaunchPromise(ACCELERATE_LAUNCH, int(args.num_processes), f"--num_processes {args.num_processes}",
                             kind, bool(args.cpu))
    count = settings.get("num_processes")
    if isinstance(count, int) and count > 0:
        return LaunchPromise(ACCELERATE_LAUNCH, count, f"num_processes: {count} in {config}", kind, bool(args.cpu))
    return LaunchPromise(ACCELERATE_LAUNCH, None, "", kind, bool(args.cpu))


def _launch_config_file(named: str | None) -> Path | None:
    if named:
        return Path(named)
    from accelerate.commands.config import default_config_file

    saved = Path(default_config_file)
    return saved if saved.is_file() else None


def _read_yaml(path: Path) -> dict:
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def stop_with_launcher(env: Mapping[str, str] | None = None) -> bool:
    """Have the kernel SIGKILL this training process when the launcher that started it dies (Linux).

    torch's elastic agent starts each rank in its own session, so a launcher killed with SIGKILL left its ranks
    training (and writing final/) beside any relaunch. Only processes a launcher started ask for it: run.py /
    `vembed train` (their pid in the environment), torchrun and `accelerate launch`; a process started from a shell
    (`python -m vembed.entrypoints.train`, perhaps under nohup) must outlive that shell. Returns whether it was set.
    """
    import ctypes
    import signal
    import sys

    env = os.environ if env is None else env
    if not sys.platform.startswith("linux"):
        return False
    launcher_pid = env.get(LAUNCHER_PID_ENV, "")
    if launcher_pid == str(os.getpid()):  # this process is the launcher itself (it trains or evaluates in-process)
        return False
    launched = launcher_pid.isdigit() or started_by_accelerate_or_torchrun(env)
    if not launched:
        return False
    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) != 0:
        return False
    # The launcher may have died before the call: then this process already has another parent.
    if launcher_pid.isdigit() and os.getppid() != int(launcher_pid):
        os._exit(1)
    return True


def command_accelerator() -> "Accelerator":
    """The Accelerator of a command that any launcher may start (`vembed eval`): on CPU where there is no GPU or the
    launch asked for CPU, and refused when the launcher promised more processes than started (`accelerate launch --cpu
    --num_processes 2` starts one, without a word)."""
    import torch
    from accelerate import Accelerator

    from vembed.errors import LaunchError

    on_cpu = not torch.cuda.is_available() or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true")
    accelerator = Accelerator(cpu=on_cpu)
    promise = read_promise()
    if promise.num_processes is not None and promise.num_processes != accelerator.num_processes:
        raise LaunchError(f"{promise.command} promised {promise.num_processes} processes ({promise.source}) but "
                          f"{accelerator.num_processes} started; on CPU drop --cpu and launch with a multi-process "
                          "config (accelerate_configs/ddp_cpu.yaml)")
    return accelerator
