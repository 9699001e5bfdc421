"""The errors users see: one type per kind of bad input, each able to render itself as one line.

Entrypoints catch `VembedError`, print `str(err)` and exit with `err.exit_code`; nothing else is caught, so a real bug
still shows its traceback.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class VembedError(Exception):
    """Base class: an error caused by the user's input, reported as one line."""

    exit_code = 2
    kind = "error"

    def __str__(self) -> str:
        return f"{self.kind}: {self.args[0] if self.args else ''}"


# The commands' positional arguments: a key that names one is the command line's, not a recipe's.
POSITIONAL_ARGUMENTS = frozenset({"model_dir", "corpus", "data", "runs", "images"})


class RecipeError(VembedError):
    """A recipe key is unknown, of the wrong type or impossible. `key` is the dotted path (`data.train`); a key that
    is a command-line flag (`--top-k`) is reported as an argument error, since no recipe holds it."""

    def __init__(self, key: str, message: str, source: str | None = None):
        self.key, self.message, self.source = key, message, source
        where = f" in {source}" if source else ""
        super().__init__(f"{key}{where}: {message}")

    @property
    def kind(self) -> str:
        return "argument error" if self.key.startswith("--") or self.key in POSITIONAL_ARGUMENTS else "recipe error"


class ArgumentError(RecipeError):
    """A command's argument cannot be used: a positional one (`model_dir`, `corpus`, a run file), named by `key`.
    (Flags raised as RecipeError("--flag", ...) are labelled the same way.)"""

    @property
    def kind(self) -> str:
        return "argument error"


class EnvironmentProblem(RecipeError):
    """What the command needs is not installed here; `key` names what asked for it, the message the extra to
    install."""

    @property
    def kind(self) -> str:
        return "environment error"


class DataError(VembedError):
    """A data file or row cannot be used. Carries the file and, where known, the row."""

    kind = "data error"

    def __init__(self, message: str, file: str | None = None, row: int | None = None):
        self.file, self.row, self.detail = file, row, message
        where = ""
        if file:
            where = f"{file}" + (f", row {row}" if row is not None else "") + ": "
        super().__init__(f"{where}{message}")


class LaunchError(VembedError):
    """The launch does not match what the recipe or the launcher promised (world size, backend, strategy)."""

    kind = "launch error"


class TrainingError(VembedError):
    """Training cannot go on (NaN loss, ...). The last good checkpoint is kept."""

    kind = "training error"
    exit_code = 1


class CheckpointError(VembedError):
    """A checkpoint to resume from is damaged, missing or of another run; or one cannot be written (disk full)."""

    kind = "checkpoint error"


def require_package(module: str, key: str, purpose: str, extra: str) -> None:
    """Stop with one line naming `key` and the extra that installs `module`, before any work, when it is absent."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise EnvironmentProblem(key, f"{purpose} needs {module}, which is not installed: pip install "
                                      f"'vembed[{extra}]'")


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """' (did you mean X?)' for the closest choice, or '' when nothing is close."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""
