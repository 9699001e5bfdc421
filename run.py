#!/usr/bin/env python
"""Train from a recipe, launching accelerate for you: `python run.py RECIPE.yaml [--config_override key=value ...]`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vembed.entrypoints.launch import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
