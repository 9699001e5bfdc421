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

# PyLate, for the ColBERT interop test and bench/colbert_vs_pylate.py (dev and bench extras only). Its latest release
# (1.6.0) pins sentence-transformers==5.3.0 and transformers<=5.3.0 and does not run on the 6.x/5.2x in this venv
# (ColBERT() crashes in sentence-transformers 6's module loading, and its encode calls the removed _text_length), so
# it cannot be an extra: it goes with its own pinned stack into a folder of its own (--no-deps: pip would otherwise
# replace the venv's packages), put in front of the venv's packages only by the processes that run PyLate
# (PYTHONPATH=.venv/pylate-stack); torch, numpy, scipy and the rest come from the venv.
pylate_stack=.venv/pylate-stack
if [[ " dev bench " == *" $extras "* ]] && [ ! -f "$pylate_stack/.complete" ]; then
  echo "installing PyLate and its pinned stack into $pylate_stack ..." >&2
  rm -rf "$pylate_stack"
  "$venv_python" -m pip install -q --no-deps --target "$pylate_stack" pylate==1.6.0 sentence-transformers==5.3.0 \
    transformers==5.3.0 tokenizers==0.22.2 huggingface-hub==1.33.0
  touch "$pylate_stack/.complete"
fi

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
