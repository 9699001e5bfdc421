"""Stopping a run cleanly when the cluster takes the machine back: SIGTERM (Kubernetes eviction, spot reclaim, SLURM
preemption) or SIGUSR1 (SLURM's `--signal`, sent before the time limit). The handler only notes the request; the loop
reads it at the next optimizer step, over every rank at once (a signal that reached one rank stops all of them at the
same step), writes one verified checkpoint and leaves with `PREEMPTED_EXIT_CODE`, which a requeue script tests for.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

from vembed.errors import VembedError

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# EX_TEMPFAIL of sysexits.h ("try again later"): not 0 (the run is not done), not 1 or 2 (our failures), not 128+N (a
# process killed by a signal), so a requeue script can tell "resume me" from everything else.
PREEMPTED_EXIT_CODE = 75
RESUME_FLAG = "--config_override resume_from=auto"


class Preempted(VembedError):
    """A stop signal ended training after a step; the checkpoint of that step is written and verified."""

    kind = "preempted"
    exit_code = PREEMPTED_EXIT_CODE

    def __init__(self, step: int, signal_name: str, checkpoint: Path, resumes_by_itself: bool):
        how = "the same command (resume_from is auto already)" if resumes_by_itself else \
            f"the same command plus {RESUME_FLAG}"
        super().__init__(f"preempted at step {step} ({signal_name}); checkpoint {checkpoint} verified; resume with: "
                         f"{how}; exit code {PREEMPTED_EXIT_CODE}")

    def __str__(self) -> str:
        return str(self.args[0])


class StopRequests:
    """While entered, SIGTERM and SIGUSR1 are noted (`signal_name`) instead of ending the process; the previous
    handlers come back on exit. Only the main thread can install handlers: elsewhere (a run started from a thread)
    signals keep their default effect.

    A DataLoader worker forked while this is active inherits the handler; there the signal takes its default effect,
    so torch can still stop its workers with SIGTERM."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}
        self._pid = os.getpid()

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def _note(self, signum: int, frame) -> None:
        if os.getpid() != self._pid:  # a forked worker: behave as if no handler were installed
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name

    def __enter__(self) -> "StopRequests":
        if threading.current_thread() is threading.main_thread():
            self._pid = os.getpid()
            for stop in STOP_SIGNALS:
                self._previous[stop] = signal.signal(stop, self._note)
        return self

    def __exit__(self, *exc) -> None:
        for stop, previous in self._previous.items():
            signal.signal(stop, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
