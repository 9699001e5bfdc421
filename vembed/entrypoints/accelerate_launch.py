"""`python -m vembed.entrypoints.accelerate_launch ARGS`: `accelerate launch ARGS` as run.py's launcher runs it, for job
schedulers that start one launcher per node themselves (examples/slurm). It adds what plain `accelerate launch`
lacks: SIGTERM and SIGUSR1 passed on to the ranks, which stop after their step with a verified checkpoint; the ranks'
exit code as its own (75: preempted, resume it; vembed/training/preemption.py), where `accelerate launch` turns any
rank's exit into 1 and a traceback; and the one-line error of the rank that failed first.
"""

from __future__ import annotations

import os
import sys

from vembed.entrypoints.launch import AGENT_SIGNALS, forwarding_stop_signals, launch_in_process, process_environment
from vembed.training.launch_promise import (
    ACCELERATE_LAUNCH,
    EXPECTED_WORLD_SIZE_ENV,
    LAUNCHER_ENV,
    LAUNCHER_PID_ENV,
    promise_of_accelerate_launch,
)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    env = {**os.environ, LAUNCHER_PID_ENV: str(os.getpid()), **AGENT_SIGNALS}
    # The ranks' parent is this module, not `accelerate launch`: what the arguments promised is handed over instead.
    promised = promise_of_accelerate_launch(argv).num_processes
    if promised is not None:
        env.update({EXPECTED_WORLD_SIZE_ENV: str(promised), LAUNCHER_ENV: ACCELERATE_LAUNCH})
    with process_environment(env), forwarding_stop_signals():
        return launch_in_process(argv, promised)


if __name__ == "__main__":
    sys.exit(main())
