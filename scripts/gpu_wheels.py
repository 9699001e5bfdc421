"""Prepare gpu-wheels/: what the lent GPU machine (no network) lacks to run bench/gpu_check.py, as its Python's wheels.

    make gpu-wheels                      # = python scripts/gpu_wheels.py --out gpu-wheels --python 3.12

The machine, as last seen, has torch, transformers, accelerate, peft, sentence-transformers, timm, pyarrow and
scikit-learn; so the folder holds vembed's own wheel, the rest of its requirements and pytest (their closure here,
less the closure of what the machine has), pinned to the versions installed here, plus open_clip (the CLIP speed
step's peer). bench/gpu_check.py installs from it with `--no-deps` only the distributions the machine lacks.

PyLate (the ColBERT speed step's peer) pins sentence-transformers 5.3 and transformers <= 5.3, older than the
machine's, so its stack goes apart, to gpu-wheels/pylate-stack/: the wheels of this checkout's PyLate stack
(.venv/pylate-stack, which scripts/setup.sh dev pins; $VEMBED_PYLATE_STACK elsewhere) at the versions there, which the
step installs with `--target` into its own folder for PyLate's process only. PyLate's other requirements are the
machine's (accelerate, datasets, pandas: this folder) or unused by training (ujson, ninja, fastkmeans, fast-plaid: its
indexes), so they are not carried.
The device tool carries the folder (64 MiB at most per run, with the working tree), so its size is checked.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
ON_GPU_MACHINE = ("torch", "transformers", "accelerate", "peft", "sentence-transformers", "timm", "pyarrow",
                  "scikit-learn", "numpy", "pillow")
# Carried although the closure of ON_GPU_MACHINE here holds them: pydantic was seen missing there (the newer
# transformers here requires it, 5.17 there does not); pygments, pytest's, may be. Installed there only if missing.
ALWAYS_CARRIED = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "pygments")
# open_clip's own requirements beyond the machine's (torchvision, regex, huggingface-hub come with timm/transformers)
PEERS = ("open_clip_torch>=3.0", "ftfy", "wcwidth")
PYLATE_STACK = "pylate-stack"  # bench/gpu_check.py's PYLATE_STACK: the subfolder it installs PyLate from
LIMIT_MIB = 60  # under the device tool's 64 MiB, with room for the working tree


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(names: tuple[str, ...]) -> dict[str, str | None]:
    """Every distribution `names` require, transitively, as installed here: normalised name -> version (None when a
    requirement is not installed here)."""
    found: dict[str, str | None] = {}
    todo = list(names)
    while todo:
        name = _key(todo.pop())
        if name in found:
            continue
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            found[name] = None
            continue
        found[name] = dist.version
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return found


def requirements() -> list[str]:
    """Pinned requirement strings for vembed's dependencies the GPU machine lacks, and the peers."""
    present = closure(ON_GPU_MACHINE)
    # pytest runs tests/gpu/ there
    needed = {name: version for name, version in closure(("vembed", "pytest")).items()
              if (name not in present or name in ALWAYS_CARRIED) and name != "vembed"}
    missing = sorted(name for name, version in needed.items() if version is None)
    if missing:
        raise SystemExit(f"error: {', '.join(missing)} not installed here: run `make setup` first")
    return [f"{name}=={version}" for name, version in sorted(needed.items())] + list(PEERS)


def pylate_stack_requirements(stack: Path) -> list[str]:
    """Pinned requirement strings for every distribution of PyLate's stack folder here (its .dist-info names)."""
    pins = sorted(_key(info.name.removesuffix(".dist-info").rsplit("-", 1)[0]) + "==" +
                  info.name.removesuffix(".dist-info").rsplit("-", 1)[1] for info in stack.glob("*.dist-info"))
    if not any(pin.startswith("pylate==") for pin in pins):
        raise SystemExit(f"error: no PyLate stack at {stack}: run `bash scripts/setup.sh dev` (or set "
                         "VEMBED_PYLATE_STACK)")
    return pins


def _pip_download(out: Path, python: str, wanted: list[str]) -> None:
    abi = "cp" + python.replace(".", "")
    platforms = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any")
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(out),
               "--python-version", python, "--implementation", "cp", "--abi", abi, "--abi", "abi3", "--abi", "none",
               *[arg for platform in platforms for arg in ("--platform", platform)], *wanted]
    subprocess.run(command, check=True)


def download(out: Path, python: str, stack: Path) -> None:
    _pip_download(out, python, requirements())
    _pip_download(out / PYLATE_STACK, python, pylate_stack_requirements(stack))
    for old in out.glob("vembed-*.whl"):  # one vembed wheel: this checkout's
        old.unlink()
    leftovers = [path for path in (ROOT / "build", ROOT / "vembed.egg-info") if not path.exists()]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(ROOT)], check=True)
    for path in leftovers:  # setuptools builds in the checkout; an egg-info there would shadow the installed vembed
        shutil.rmtree(path, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "gpu-wheels"))
    parser.add_argument("--python", default="3.12", help="the GPU machine's Python (major.minor)")
    parser.add_argument("--pylate-stack", default=os.environ.get("VEMBED_PYLATE_STACK",
                                                                 str(ROOT / ".venv" / PYLATE_STACK)),
                        help="PyLate's stack folder here, whose versions are carried (default: .venv/pylate-stack)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    (out / PYLATE_STACK).mkdir(parents=True, exist_ok=True)
    download(out, args.python, Path(args.pylate_stack))
    wheels = sorted(out.rglob("*.whl"))
    total = sum(w.stat().st_size for w in wheels) / 2**20
    for wheel in wheels:
        print(f"{wheel.stat().st_size / 2**20:6.1f} MiB  {wheel.relative_to(out)}")
    print(f"{total:6.1f} MiB  in all ({len(wheels)} wheels) in {out}")
    if total > LIMIT_MIB:
        print(f"error: {total:.1f} MiB is over {LIMIT_MIB} MiB, more than the device tool carries with the working "
              f"tree; remove wheels the GPU machine has (ON_GPU_MACHINE in {Path(__file__).name})", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
