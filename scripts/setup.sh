#!/usr/bin/env bash
# Create .venv and install vembed into it (editable) with the extras named in $1 (default: dev).
# An existing torch is kept: if the Python running this already has torch, the venv sees it (system site packages);
# otherwise torch==2.13.0 is installed first (on the project's CPU machines it comes from local disk in ~30 s).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-dev}"
python="${PYTHON:-python3}"

if [ ! -x .venv/bin/python ]; then
  if "$python" -c "import torch" >/dev/null 2>&1; then
    "$python" -m venv --system-site-packages .venv
  else
    "$python" -m venv .venv
  fi
fi
venv_python=.venv/bin/python

# Reinstall only when the package metadata changed (hashlib: sha1sum is not on every OS).
digest=$("$venv_python" -c "import hashlib; print(hashlib.sha1(open('setup.cfg','rb').read() + open('pyproject.toml','rb').read()).hexdigest()[:12])")
stamp=".venv/.vembed-$extras-$digest"
if [ -f "$stamp" ]; then
  exit 0
fi
"$venv_python" -m pip install -q --upgrade pip >/dev/null
if ! "$venv_python" -c "import torch" >/dev/null 2>&1; then
  echo "installing torch (CPU build where available) ..." >&2
  "$venv_python" -m pip install -q "torch==2.13.0" || "$venv_python" -m pip install -q torch
fi
echo "installing vembed[$extras] ..." >&2
"$venv_python" -m pip install -q -e ".[$extras]"
"$venv_python" -c "import torch, transformers, accelerate; print(f'torch {torch.__version__}, transformers {transformers.__version__}, accelerate {accelerate.__version__}')" >&2
rm -f .venv/.vembed-"$extras"-*
touch "$stamp"
