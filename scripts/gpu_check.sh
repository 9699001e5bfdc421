#!/usr/bin/env bash
# The GPU check: scripts/gpu_check.sh --out DIR [--cpu-dry-run] [--steps gpu_tests,clip_speed,...]
# All the logic is in bench/gpu_check.py (its docstring says what each step does); docs/guides/testing.md, "Checking the GPU paths".
# Uses .venv/bin/python where there is one (a development checkout), else $PYTHON or python3 (the lent GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then
  python="$PYTHON"
elif [ -x .venv/bin/python ]; then
  python=.venv/bin/python
else
  python=python3
fi
export HF_HUB_OFFLINE=1 WANDB_MODE=offline PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" bench/gpu_check.py "$@"
