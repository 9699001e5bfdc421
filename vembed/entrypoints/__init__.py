"""Command-line entrypoints: thin — parse, build, run. Errors from bad input become one line and an exit code."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable


def run_cli(body: Callable[[], int | None], debug: bool) -> int:
    """Run `body`; a `VembedError` is printed as one line (once, by rank 0) and turned into its exit code."""
    from vembed.errors import VembedError

    try:
        return body() or 0
    except VembedError as err:
        if debug:
            raise
        if os.environ.get("RANK", "0") == "0":
            print(str(err), file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


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
