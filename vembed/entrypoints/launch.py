"""`python run.py RECIPE` / `vembed train RECIPE`: start `accelerate launch` with the right config and process count.

The config is, in order: `--accelerate_config`, the one `accelerate config` saved, or ours from accelerate_configs/
(ddp.yaml with one process per GPU when there are several GPUs, single.yaml otherwise). The recipe is validated here
first, so a typo fails in a second instead of after N processes have started. accelerate's launcher then runs in this
process (its `launch_command`, what `accelerate launch` calls): torch and accelerate are imported already, and a
second interpreter importing them again cost ~2 s of every start. When that launcher would start one plain process
(single.yaml, or any config that comes to one process without DeepSpeed/FSDP), the training runs in this process
instead, in the environment accelerate would have given it, with the recipe already checked: no second interpreter at
all (~2.5 s of torch and transformers imports saved). `vembed eval --accelerate_config` launches through the same
functions (plan_launch, accelerate_arguments, start).

SIGTERM and SIGUSR1 sent to the launcher are passed on to the ranks, which stop after their step with a verified
checkpoint (vembed/training/preemption.py); the launcher then exits with their code, 75.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from vembed.entrypoints import run_cli
from vembed.entrypoints.train import add_arguments as add_train_arguments
from vembed.errors import LaunchError
from vembed.resources import accelerate_configs, package_root
from vembed.training.launch_promise import EXPECTED_WORLD_SIZE_ENV, LAUNCHER_ENV, LAUNCHER_PID_ENV
from vembed.training.preemption import PREEMPTED_EXIT_CODE, STOP_SIGNALS
from vembed.training.threads import USER_THREADS_ENV

if TYPE_CHECKING:
    from vembed.recipe import Recipe

# Shipped inside the package, so an installed vembed finds them from any directory (the clone's accelerate_configs/
# links here). ROOT is what the DeepSpeed YAMLs' relative JSON paths resolve against.
ROOT = package_root()
CONFIGS = accelerate_configs()
TRAIN_SCRIPT = Path(__file__).resolve().parent / "train.py"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_train_arguments(parser)
    parser.add_argument("--accelerate-config", "--accelerate_config", help="accelerate config file to launch with")
    parser.add_argument("--num-processes", "--num_processes", type=int, help="override the config's process count")
    parser.add_argument("--dry-run", "--dry_run", action="store_true", help="print the launch command and stop")


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
    return bool(_read_config(path).get("use_cpu"))


def _derived_config(data: dict, like: Path, folder: Path | None) -> Path:
    """`data` written as a config named after `like` in `folder` (the launch's scratch folder, removed when the launch
    ends); without one, a new file in $TMPDIR that the caller removes."""
    import tempfile

    import yaml

    with tempfile.NamedTemporaryFile("w", suffix=f"-{like.name}", dir=folder, delete=False) as handle:
        yaml.safe_dump(data, handle)
    return Path(handle.name)


@contextlib.contextmanager
def scratch_folder(keep: bool = False):
    """Where a launch writes the configs it derives; removed with everything in it when the launch ends (they were
    left in $TMPDIR, one per DeepSpeed or multi-CPU launch). `keep`: a dry run prints a command that names them."""
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="vembed-launch-"))
    try:
        yield folder
    finally:
        if keep and any(folder.iterdir()):
            print(f"note: the derived config stays in {folder} for the command above; remove it when done",
                  file=sys.stderr)
        else:
            shutil.rmtree(folder, ignore_errors=True)


def _with_absolute_deepspeed_file(path: Path, folder: Path | None = None) -> Path:
    """Our DeepSpeed configs name their JSON relative to the repository; a copy with the absolute path lets the
    launch start from any directory. (accelerate's --deepspeed_config_file flag cannot do it: it makes the launcher
    export settings that then conflict with the file.)"""
    data = _read_config(path)
    named = (data.get("deepspeed_config") or {}).get("deepspeed_config_file")
    if not named or Path(named).is_absolute() or not (ROOT / named).is_file():
        return path
    data["deepspeed_config"]["deepspeed_config_file"] = str(ROOT / named)
    return _derived_config(data, path, folder)


def _check_launcher_installed(config: Path) -> None:
    """accelerate's DeepSpeed launcher raises a bare ImportError when deepspeed is missing: say it in one line."""
    import importlib.util

    if _read_config(config).get("distributed_type") == "DEEPSPEED" and importlib.util.find_spec("deepspeed") is None:
        raise LaunchError(f"{config} launches DeepSpeed, which is not installed: pip install 'vembed[deepspeed]', "
                          "or pick another --accelerate_config (ddp, fsdp)")


def _with_ddp_launcher_for_several_processes(config: Path, num_processes: int, folder: Path | None = None) -> Path:
    """A config accelerate would start as ONE process although more were asked for (distributed_type MULTI_CPU
    needs mpirun; NO is single-process), as a copy that uses the DDP launcher (MULTI_GPU; `use_cpu` on CPU), which
    starts real ranks: what accelerate_configs/ddp_cpu.yaml does."""
    import torch

    data = _read_config(config)
    kind = data.get("distributed_type")
    if num_processes < 2 or kind not in ("MULTI_CPU", "NO"):
        return config
    on_cpu = kind == "MULTI_CPU" or bool(data.get("use_cpu")) or not torch.cuda.is_available()
    data.update(distributed_type="MULTI_GPU", use_cpu=on_cpu, num_processes=num_processes)
    print(f"note: accelerate starts a {kind} config as one process; launching {num_processes} "
          f"{'CPU ' if on_cpu else ''}processes with its DDP launcher instead", file=sys.stderr)
    return _derived_config(data, config, folder)


def _read_config(path: Path) -> dict:
    """The accelerate config as a dict, checked the way accelerate's launcher would (its own loader), so a bad file is
    one line here instead of a traceback from inside the launcher."""
    import yaml
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType, PrecisionType

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise LaunchError(f"accelerate config {path} is not a text file; pass a YAML accelerate config") from None
    except OSError as error:
        raise LaunchError(f"accelerate config {path} cannot be read: {error.strerror}") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise LaunchError(f"accelerate config {path} is not valid YAML{where}: "
                          f"{getattr(error, 'problem', None) or error}") from None
    if not isinstance(data, dict) or "distributed_type" not in data:
        raise LaunchError(f"{path} is not an accelerate config (no distributed_type); write one with "
                          "`accelerate config`, or pass one of ours with --accelerate_config")
    for key, allowed in (("distributed_type", [kind.value for kind in DistributedType]),
                         ("mixed_precision", PrecisionType.list())):
        value = data.get(key, allowed[0])
        if value is False:  # YAML 1.1 reads a bare NO / no as false; accelerate then fails deep in the launcher
            word = "NO" if key == "distributed_type" else "no"
            raise LaunchError(f"{key}: a bare {word} in {path} is read as false; quote it: {key}: '{word}'")
        if not isinstance(value, str) or value not in allowed:
            raise LaunchError(f"{key}: {value!r} in {path} is not one of accelerate's: {', '.join(allowed)}")
    try:
        load_config_from_file(str(path))
    except Exception as error:  # noqa: BLE001 - accelerate's loader raises several types for a bad file
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise LaunchError(f"{path} is not a valid accelerate config: {first}") from None
    return data


def run(args: argparse.Namespace) -> int:
    def body() -> int:
        from vembed.components import load_recipe
        from vembed.recipe_checks import check_recipe
        from vembed.training.run_dir import RunLock, check_output_dir

        recipe = load_recipe(args.recipe, args.config_override)
        check_recipe(recipe)
        check_output_dir(recipe)  # before any process starts: output_dir writable, and not another run's
        # Configs derived for this launch live in a scratch folder that goes when the launch ends.
        with scratch_folder(keep=args.dry_run) as scratch:
            config, num_processes = plan_launch(args.accelerate_config, args.num_processes, scratch, recipe.use_fsdp)
            command_name = getattr(args, "command_name", "python run.py")
            check_planned_launch(recipe, config, num_processes, command_name)
            target = [str(TRAIN_SCRIPT), args.recipe]
            if args.config_override:
                target += ["--config_override", *args.config_override]
            if args.debug:
                target.append("--debug")
            launch_args = accelerate_arguments(config, num_processes, target)
            if args.dry_run:
                print(f"launching {num_processes} process(es) with {config}", file=sys.stderr)
                print(" ".join(["accelerate", "launch", *launch_args]))
                return 0

            def here() -> int:
                from vembed.entrypoints.train import train

                return train(recipe)

            # Held for the whole launch: a second launch into the same output_dir is refused while this one runs.
            with RunLock(recipe.output_dir):
                return start(launch_args, num_processes, config, command_name, here)

    return run_cli(body, args.debug)


def check_planned_launch(recipe: "Recipe", config: Path, num_processes: int, command_name: str) -> None:
    """Stage 6 of the recipe's rules (`check_launch`: fp16 on CPU, FSDP's blocks, use_fsdp, GradCache under FSDP or
    DeepSpeed, compile) for the launch about to start, judged from its accelerate config before any process starts,
    so a refusal is one line and not one per rank after the launch line. Each rank judges it again from the
    environment the launcher gave it (`decide_launch`), as a rank `accelerate launch` started does."""
    import torch

    from vembed.recipe_checks import check_launch
    from vembed.training.launch_promise import LaunchPromise

    settings = _read_config(config)
    distributed = settings["distributed_type"]
    kind = {"DEEPSPEED": "deepspeed", "FSDP": "fsdp"}.get(distributed, "ddp" if num_processes > 1 else "single")
    on_cpu = bool(settings.get("use_cpu")) or distributed == "MULTI_CPU" or not torch.cuda.is_available()
    check_launch(recipe, kind, on_cpu=on_cpu, promise=LaunchPromise(command_name, num_processes, "the launcher"))


def plan_launch(accelerate_config: str | None, num_processes: int | None, scratch: Path, use_fsdp: bool = False
                ) -> tuple[Path, int]:
    """The accelerate config file to launch with (a copy in `scratch`, the launch's `scratch_folder`, where ours must
    be adjusted) and the process count, checked before any process starts. Shared by every command that launches
    itself (`vembed train`, `vembed eval`)."""
    config, forced = choose_config(accelerate_config, use_fsdp)
    if num_processes is None:
        num_processes = forced or _config_num_processes(config)
    if num_processes < 1:
        raise LaunchError(f"--num_processes {num_processes}: pass a positive number of processes")
    _check_launcher_installed(config)
    config = _with_ddp_launcher_for_several_processes(config, num_processes, scratch)
    return _with_absolute_deepspeed_file(config, scratch), num_processes


def accelerate_arguments(config: Path, num_processes: int, target: list[str]) -> list[str]:
    """`accelerate launch`'s arguments for `target` (a script and its arguments, or `-m MODULE ...`)."""
    launch_args = ["--config_file", str(config), "--num_processes", str(num_processes)]
    if num_processes > 1:
        launch_args += ["--main_process_port", str(_free_port())]
    return launch_args + target


def start(launch_args: list[str], num_processes: int, config: Path, command_name: str,
          here: Callable[[], int]) -> int:
    """`accelerate launch LAUNCH_ARGS`; when that starts one plain process, `here()` runs in this process instead, in
    the environment accelerate would give that process (a second interpreter's imports, ~2.5 s, saved)."""
    # What the launched processes check they got (vembed/training/launch_promise.py), how to phrase hints, and the
    # user's own OMP_NUM_THREADS, as accelerate's launcher puts 1 in its place (vembed/training/threads.py).
    promise = {EXPECTED_WORLD_SIZE_ENV: str(num_processes), LAUNCHER_ENV: command_name,
               USER_THREADS_ENV: os.environ.get("OMP_NUM_THREADS", "")}
    one_process = one_plain_process_env(launch_args)
    if one_process is not None:
        print(f"launching {num_processes} process(es) with {config} (in this process)", file=sys.stderr)
        with process_environment({**one_process, **promise}):
            return here()
    print(f"launching {num_processes} process(es) with {config}", file=sys.stderr)
    # The ranks inherit the promise and this process's id (each rank dies with it: stop_with_launcher); this process's
    # own environment is given back after, so a caller in Python (a test, a notebook) launches again unchanged.
    with process_environment({**os.environ, **promise, LAUNCHER_PID_ENV: str(os.getpid()), **AGENT_SIGNALS}), \
            forwarding_stop_signals():
        return launch_in_process(launch_args, num_processes)


# The signals torch's elastic agent handles (torch >= 2.9 reads the list from torchrun's --signals_to_handle, whose
# environment form this is): its default less the stop signals, which `forwarding_stop_signals` passes on instead.
# The agent would answer SIGTERM by sending it on with a 30 s deadline, then SIGKILL, and raising (the ranks' exit
# codes lost); SIGUSR1 it leaves at its default action, which kills the launcher and so (PR_SET_PDEATHSIG) the ranks.
AGENT_SIGNALS = {"PET_SIGNALS_TO_HANDLE": "SIGINT,SIGHUP,SIGQUIT"}


@contextlib.contextmanager
def forwarding_stop_signals():
    """While the ranks run: SIGTERM and SIGUSR1 sent to this launcher go on to each of its child processes (the ranks,
    in their own sessions: a signal to the launcher's process group does not reach them), and the launcher keeps
    waiting for their exit codes. Needs the main thread; elsewhere nothing changes."""
    import signal
    import threading

    import psutil

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    launcher = psutil.Process()

    def forward(signum, frame) -> None:
        for child in launcher.children():
            with contextlib.suppress(psutil.NoSuchProcess):
                child.send_signal(signum)

    previous = {stop: signal.signal(stop, forward) for stop in STOP_SIGNALS}
    try:
        yield
    finally:
        for stop, handler in previous.items():
            signal.signal(stop, handler if handler is not None else signal.SIG_DFL)


def one_plain_process_env(launch_args: list[str]) -> dict[str, str] | None:
    """The environment `accelerate launch ARGS` would give its training process when it starts exactly one plain
    process (its simple launcher: one process, no DeepSpeed, FSDP, multi-GPU, TPU, SageMaker or mpirun), else None.
    Both come from accelerate's own code, so a run trained in this process sees what the launched one would."""
    import logging

    from accelerate.commands.config.config_args import ComputeEnvironment
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import prepare_simple_launcher_cmd_env

    launch_logger = logging.getLogger("accelerate.commands.launch")
    level = launch_logger.level
    launch_logger.setLevel(logging.ERROR)  # its "defaults were used" notes: launch_command prints them if it runs
    try:
        parsed, defaults, _ = _validate_launch_command(launch_command_parser().parse_args(launch_args))
    finally:
        launch_logger.setLevel(level)
    # launch_command's choice of launcher, in its order: anything but its simple launcher starts other processes.
    other_launcher = any(getattr(parsed, flag, False) and not parsed.cpu
                         for flag in ("use_deepspeed", "use_fsdp", "use_megatron_lm", "multi_gpu", "tpu"))
    sagemaker = defaults is not None and defaults.compute_environment == ComputeEnvironment.AMAZON_SAGEMAKER
    if (other_launcher or sagemaker or parsed.num_processes != 1 or parsed.num_machines != 1
            or parsed.mpirun_hostfile is not None or parsed.no_python):
        return None
    _, env = prepare_simple_launcher_cmd_env(parsed)
    return env


@contextlib.contextmanager
def process_environment(env: dict[str, str]):
    """This process's environment replaced by `env` while training runs in it, and restored after. The OpenMP thread
    count the launcher would give the process (OMP_NUM_THREADS) is read when torch loads, so it is set on torch too."""
    import torch

    saved, threads = dict(os.environ), torch.get_num_threads()
    os.environ.clear()
    os.environ.update(env)
    if env.get("OMP_NUM_THREADS", "").isdigit() and int(env["OMP_NUM_THREADS"]) > 0:
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
        torch.set_num_threads(threads)


def launch_in_process(launch_args: list[str], num_processes: int | None = None) -> int:
    """`accelerate launch ARGS` in this process; the exit code of the training processes, without a traceback here.
    When several processes were started and one failed, the error of the rank that failed first is printed (the ranks
    hand it over in torch's per-rank error files), with which rank it was."""
    import logging

    from accelerate.commands.launch import launch_command, launch_command_parser

    # torch's agent logs each stopped and failed rank ("Sending process N closing signal SIGTERM", "failed (exitcode:
    # 2) local_rank: 0"); the line printed below says which rank failed and why.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        launch_command(launch_command_parser().parse_args(launch_args))
    except subprocess.CalledProcessError as failed:  # one process (simple launcher)
        return failed.returncode or 1
    except SystemExit as exited:
        return 0 if exited.code is None else exited.code if isinstance(exited.code, int) else 1
    except Exception as error:  # noqa: BLE001 - torch.distributed.run's ChildFailedError: several processes
        if not hasattr(error, "get_first_failure"):
            raise
        rank, failure, line, meant = _root_failure(error.failures)
        # The code the failing rank stopped with; under load torch's agent may kill it (SIGTERM, once another rank
        # has exited) after it handed its error over and before its own exit code reached the agent.
        code = meant if meant is not None else failure.exitcode if failure.exitcode > 0 else 1
        of = f" of {num_processes}" if num_processes else ""
        if any(failed.exitcode == PREEMPTED_EXIT_CODE for failed in error.failures.values()):
            # Every rank stopped after the same step and the checkpoint was verified before any left; a rank the agent
            # then stopped on its way out (SIGTERM once another had exited) failed nothing.
            if line is not None:
                print(line, file=sys.stderr)
            return PREEMPTED_EXIT_CODE
        if line is not None:
            print(f"{line} [rank {rank}{of} failed first; the other ranks were stopped]", file=sys.stderr)
        elif failure.exitcode < 0:
            print(f"launch error: rank {rank}{of} was killed by {failure.signal_name()} (out of memory?); the other "
                  "ranks were stopped", file=sys.stderr)
        else:
            print(f"launch error: rank {rank}{of} failed with exit code {failure.exitcode} (its traceback is above); "
                  "the other ranks were stopped", file=sys.stderr)
        return code
    return 0


def _root_failure(failures: dict) -> tuple[int, object, str | None, int | None]:
    """The rank whose own error started the failure: the earliest one-line error a rank handed over that is not just
    "my peer is gone" (run_cli writes them); else a rank that died without handing anything over (a signal, or a
    traceback it printed itself), the earliest as torch's agent saw them. Last: the exit code the rank handed over
    with its line, if any."""
    reported, silent = [], []
    for rank, failure in failures.items():
        ours = (getattr(failure, "error_file_data", None) or {}).get("vembed")
        if not isinstance(ours, dict):
            silent.append(rank)
        elif not ours.get("peer_lost"):
            meant = ours.get("exit_code")
            reported.append((float(ours.get("time", 0)), rank, failure, str(ours.get("line")),
                             meant if isinstance(meant, int) and meant > 0 else None))
    if reported:
        _, rank, failure, line, meant = min(reported, key=lambda item: (item[0], item[1]))
        return rank, failure, line, meant
    rank = min(silent or list(failures), key=lambda r: (failures[r].timestamp, r))
    return rank, failures[rank], None, None


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
