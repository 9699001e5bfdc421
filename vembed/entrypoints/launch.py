"""`python run.py RECIPE` / `vembed train RECIPE`: start `accelerate launch` with the right config and process count.

The config is, in order: `--accelerate_config`, the one `accelerate config` saved, or ours from accelerate_configs/
(ddp.yaml with one process per GPU when there are several GPUs, single.yaml otherwise). The recipe is validated here
first, so a typo fails in a second instead of after N processes have started. accelerate's launcher then runs in this
process (its `launch_command`, what `accelerate launch` calls): torch and accelerate are imported already, and a
second interpreter importing them again cost ~2 s of every start.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from vembed.entrypoints import run_cli
from vembed.entrypoints.train import add_arguments as add_train_arguments
from vembed.errors import LaunchError
from vembed.resources import accelerate_configs, package_root
from vembed.training.launcher import EXPECTED_WORLD_SIZE_ENV, LAUNCHER_ENV

# Shipped inside the package, so an installed vembed finds them from any directory (the clone's accelerate_configs/
# links here). ROOT is what the DeepSpeed YAMLs' relative JSON paths resolve against.
ROOT = package_root()
CONFIGS = accelerate_configs()
TRAIN_SCRIPT = Path(__file__).resolve().parent / "train.py"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_train_arguments(parser)
    parser.add_argument("--accelerate_config", "--accelerate-config", help="accelerate config file to launch with")
    parser.add_argument("--num_processes", "--num-processes", type=int, help="override the config's process count")
    parser.add_argument("--dry_run", "--dry-run", action="store_true", help="print the launch command and stop")


def _saved_accelerate_config() -> Path | None:
    try:
        from accelerate.commands.config import default_config_file
    except ImportError:
        return None
    path = Path(default_config_file)
    return path if path.is_file() else None


def _config_num_processes(path: Path) -> int:
    count = _read_config(path).get("num_processes", 1)
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise LaunchError(f"num_processes: {count!r} in {path} is not a positive number of processes")
    return count


def choose_config(explicit: str | None, use_fsdp: bool = False) -> tuple[Path, int | None]:
    """The accelerate config to use and, when it is one of ours, the process count to force (one per GPU)."""
    import torch

    from vembed.errors import LaunchError

    gpus = torch.cuda.device_count()
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            named = CONFIGS / explicit
            path = named if named.is_file() else CONFIGS / f"{explicit}.yaml"
        if not path.is_file():
            choices = ", ".join(sorted(p.stem for p in CONFIGS.glob("*.yaml")))
            raise LaunchError(f"accelerate config {explicit!r} not found; pass a file or one of: {choices}")
        # Our multi-GPU configs say 2 processes as a placeholder; on a GPU machine, use every GPU.
        ours = path.resolve().parent == CONFIGS.resolve() and not _uses_cpu(path)
        return path, (gpus if ours and gpus > 1 and _config_num_processes(path) > 1 else None)
    if use_fsdp:
        if gpus < 2:
            raise LaunchError("use_fsdp needs several processes: on this machine (fewer than 2 GPUs) pass "
                              "--accelerate_config with --num_processes, or set use_fsdp: false")
        return CONFIGS / "fsdp.yaml", gpus
    saved = _saved_accelerate_config()
    if saved is not None:
        return saved, None
    if gpus > 1:
        return CONFIGS / "ddp.yaml", gpus
    return CONFIGS / "single.yaml", 1


def _uses_cpu(path: Path) -> bool:
    import yaml

    return bool((yaml.safe_load(path.read_text()) or {}).get("use_cpu"))


def _with_absolute_deepspeed_file(path: Path) -> Path:
    """Our DeepSpeed configs name their JSON relative to the repository; a copy with the absolute path lets the
    launch start from any directory. (accelerate's --deepspeed_config_file flag cannot do it: it makes the launcher
    export settings that then conflict with the file.)"""
    import tempfile

    import yaml

    data = yaml.safe_load(path.read_text()) or {}
    named = (data.get("deepspeed_config") or {}).get("deepspeed_config_file")
    if not named or Path(named).is_absolute() or not (ROOT / named).is_file():
        return path
    data["deepspeed_config"]["deepspeed_config_file"] = str(ROOT / named)
    with tempfile.NamedTemporaryFile("w", suffix=f"-{path.name}", delete=False) as handle:
        yaml.safe_dump(data, handle)
    return Path(handle.name)


def _check_launcher_installed(config: Path) -> None:
    """accelerate's DeepSpeed launcher raises a bare ImportError when deepspeed is missing: say it in one line."""
    import importlib.util

    if _read_config(config).get("distributed_type") == "DEEPSPEED" and importlib.util.find_spec("deepspeed") is None:
        raise LaunchError(f"{config} launches DeepSpeed, which is not installed: pip install 'vembed[deepspeed]', "
                          "or pick another --accelerate_config (ddp, fsdp)")


def _with_ddp_launcher_for_several_processes(config: Path, num_processes: int) -> Path:
    """A config accelerate would start as ONE process although more were asked for (distributed_type MULTI_CPU
    needs mpirun; NO is single-process), as a copy that uses the DDP launcher (MULTI_GPU; `use_cpu` on CPU), which
    starts real ranks: what accelerate_configs/ddp_cpu.yaml does."""
    import tempfile

    import torch
    import yaml

    data = _read_config(config)
    kind = data.get("distributed_type")
    if num_processes < 2 or kind not in ("MULTI_CPU", "NO"):
        return config
    on_cpu = kind == "MULTI_CPU" or bool(data.get("use_cpu")) or not torch.cuda.is_available()
    data.update(distributed_type="MULTI_GPU", use_cpu=on_cpu, num_processes=num_processes)
    print(f"note: accelerate starts a {kind} config as one process; launching {num_processes} "
          f"{'CPU ' if on_cpu else ''}processes with its DDP launcher instead", file=sys.stderr)
    with tempfile.NamedTemporaryFile("w", suffix=f"-{config.name}", delete=False) as handle:
        yaml.safe_dump(data, handle)
    return Path(handle.name)


def _read_config(path: Path) -> dict:
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise LaunchError(f"accelerate config {path} cannot be read: {error}") from None
    if not isinstance(data, dict) or "distributed_type" not in data:
        raise LaunchError(f"{path} is not an accelerate config (no distributed_type); write one with "
                          "`accelerate config`, or pass one of ours with --accelerate_config")
    return data


def run(args: argparse.Namespace) -> int:
    def body() -> int:
        from vembed.components import load_recipe
        from vembed.tasks import check_recipe

        recipe = load_recipe(args.recipe, args.config_override)
        check_recipe(recipe)
        config, forced = choose_config(args.accelerate_config, recipe.use_fsdp)
        num_processes = args.num_processes
        if num_processes is None:
            num_processes = forced or _config_num_processes(config)
        if num_processes < 1:
            raise LaunchError(f"--num_processes {num_processes}: pass a positive number of processes")
        _check_launcher_installed(config)
        config = _with_ddp_launcher_for_several_processes(config, num_processes)
        config = _with_absolute_deepspeed_file(config)
        launch_args = ["--config_file", str(config), "--num_processes", str(num_processes)]
        if num_processes > 1:
            launch_args += ["--main_process_port", str(_free_port())]
        launch_args += [str(TRAIN_SCRIPT), args.recipe]
        if args.config_override:
            launch_args += ["--config_override", *args.config_override]
        if args.debug:
            launch_args.append("--debug")
        print(f"launching {num_processes} process(es) with {config}", file=sys.stderr)
        if args.dry_run:
            print(" ".join(["accelerate", "launch", *launch_args]))
            return 0
        # What the training processes check they got (vembed/training/launcher.py), and how to phrase hints.
        os.environ[EXPECTED_WORLD_SIZE_ENV] = str(num_processes)
        os.environ[LAUNCHER_ENV] = getattr(args, "command_name", "python run.py")
        return launch_in_process(launch_args)

    return run_cli(body, args.debug)


def launch_in_process(launch_args: list[str]) -> int:
    """`accelerate launch ARGS` in this process; the exit code of the training processes, without a traceback here
    (they print their own one-line errors)."""
    from accelerate.commands.launch import launch_command, launch_command_parser

    try:
        launch_command(launch_command_parser().parse_args(launch_args))
    except subprocess.CalledProcessError as failed:  # one process (simple launcher)
        return failed.returncode or 1
    except SystemExit as exited:
        return 0 if exited.code is None else exited.code if isinstance(exited.code, int) else 1
    except Exception as error:  # noqa: BLE001 - torch.distributed.run's ChildFailedError: several processes
        if not hasattr(error, "get_first_failure"):
            raise
        rank, failure = error.get_first_failure()  # the root cause; the others were stopped because of it
        code = failure.exitcode if failure.exitcode > 0 else 1
        print(f"launch error: rank {rank} exited with code {failure.exitcode} and the others were stopped; "
              "its error is above", file=sys.stderr)
        return code
    return 0


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="run.py", description=__doc__)
    add_arguments(parser)
    parser.set_defaults(command_name="python run.py")
    return run(parser.parse_args(argv))
