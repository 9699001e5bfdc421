"""The resume tests' fault: a run stopped right after one of its checkpoints is on disk, as a kill there would."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from unittest import mock

import pytest

from vembed.training.checkpoint import CheckpointManager


class Interrupted(Exception):
    """Raised in place of the kill; carries the checkpoint's path."""


def stop_after_checkpoint(run: Callable[[], object], at_step: int | None = None) -> Path:
    """Call `run()` (a training run) and stop it right after the checkpoint of `at_step` is written (None: the first
    checkpoint it writes). Returns that checkpoint's path; fails if the run ends without reaching it."""
    original_save = CheckpointManager.save

    def save_then_stop(self, state):
        path = original_save(self, state)
        if at_step is None or state.global_step == at_step:
            raise Interrupted(path)
        return path

    with mock.patch.object(CheckpointManager, "save", save_then_stop), pytest.raises(Interrupted) as stopped:
        run()
    return Path(stopped.value.args[0])
