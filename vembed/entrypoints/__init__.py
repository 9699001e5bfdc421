"""Command-line entrypoints: thin — parse, build, run. Errors from bad input become one line and an exit code."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable


def run_cli(body: Callable[[], int | None], debug: bool) -> int:
    """Run `body`; a `VembedError` is printed as one line (once, by rank 0) and turned into its exit code.

    A rank started by run.py / `vembed train` hands its error to the launcher instead (torch's per-rank error file),
    which names the rank that failed first; a rank that only lost its peer (the collective broke because another
    rank died) says nothing, so the real error is not buried under its traceback.
    """
    from vembed.errors import VembedError

    try:
        return body() or 0
    except VembedError as err:
        if debug:
            raise
        if not _hand_to_launcher(str(err), peer_lost=False, exit_code=err.exit_code) and \
                os.environ.get("RANK", "0") == "0":
            print(str(err), file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        if debug or not _lost_a_peer(error):
            raise
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        if not _hand_to_launcher(f"{type(error).__name__}: {first}", peer_lost=True, exit_code=1):
            raise
        return 1


def _hand_to_launcher(line: str, peer_lost: bool, exit_code: int) -> bool:
    """Write this rank's one-line error and the exit code it stops with where run.py's launcher reads them (the
    agent may kill the rank before that code reaches it); False when not started by it."""
    import json
    import time

    from vembed.training.launch_promise import LAUNCHER_PID_ENV

    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file or not os.environ.get(LAUNCHER_PID_ENV):
        return False
    # torch's agent reads "message" and "timestamp"; "vembed" is what our launcher reports from.
    payload = {"message": line, "timestamp": int(time.time()),
               "vembed": {"line": line, "time": time.time(), "peer_lost": peer_lost, "exit_code": exit_code}}
    try:
        with open(error_file, "w") as handle:
            json.dump(payload, handle)
    except OSError:
        return False
    return True


# What a collective raises on the ranks that are left when one rank dies (gloo, NCCL).
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted",
              "remote process exited", "Socket Timeout")


def _lost_a_peer(error: BaseException) -> bool:
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return False
    text = f"{type(error).__name__}: {error}"
    return type(error).__name__ == "DistNetworkError" or any(marker in text for marker in _PEER_LOST)


def require_at_least_one(**flags: int | None) -> None:
    """Each counting flag given (`top_k=args.top_k`, read as --top-k) is at least 1: one argument error naming the
    first that is not, before any work. Unset (None) flags take their defaults later."""
    from vembed.errors import ArgumentError

    for name, value in flags.items():
        if value is not None and value < 1:
            raise ArgumentError(f"--{name.replace('_', '-')}", f"must be at least 1, got {value}")


def quiet_libraries() -> None:
    """Keep the console for our own progress: silence library chatter that users can't act on."""
    import logging
    import warnings

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # "Generating train split" for every small file
    logging.getLogger("accelerate").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()  # "Loading weights" / "Writing model shards" bars on every save and load
    except ImportError:
        pass
