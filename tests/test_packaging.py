"""Installed, not only cloned: a wheel built from this tree, in a fresh venv, trains from an empty directory.

The fresh venv sees this venv's packages (torch & co.) through a path line in a .pth file; such a line adds the folder
to sys.path without running the .pth files inside it, so this venv's editable vembed is not visible there: the only
vembed the fresh venv can import is the wheel's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
ENV.pop("PYTHONPATH", None)  # nothing may put the clone on the fresh venv's path


def _tail(result: subprocess.CompletedProcess | subprocess.TimeoutExpired) -> str:
    def last(text) -> str:
        text = text.decode(errors="replace") if isinstance(text, bytes) else text or ""
        return text[-3000:]

    return f"--- stdout (tail) ---\n{last(result.stdout)}\n--- stderr (tail) ---\n{last(result.stderr)}"


def _run(args: list, cwd: Path, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a command; a non-zero exit or a timeout fails the test with the command and its output tail."""
    try:
        result = subprocess.run([str(a) for a in args], cwd=cwd, env=env or ENV, capture_output=True, text=True,
                                timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"timed out after {timeout} s: {' '.join(map(str, args))}\n{_tail(expired)}")
    if result.returncode != 0:
        pytest.fail(f"exit code {result.returncode}: {' '.join(map(str, args))}\n{_tail(result)}")
    return result


@dataclass
class Venv:
    root: Path
    python: Path
    site_packages: Path


def _fresh_venv(path: Path) -> Venv:
    """A venv without vembed that reuses this venv's installed dependencies (installing torch would take minutes)."""
    _run([sys.executable, "-m", "venv", "--without-pip", path], cwd=path.parent, timeout=120)
    python = path / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=path.parent, timeout=60).stdout.strip())
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "_test_parent_env.pth").write_text("".join(f"{p}\n" for p in sorted(ours)))
    return Venv(path, python, site)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Venv:
    """A fresh venv with vembed installed from a wheel of this working tree (no network: no build isolation)."""
    base = tmp_path_factory.mktemp("packaging")
    # Build from a copy: an in-tree build leaves build/ behind, whose stale files would leak into later wheels.
    src = base / "src"
    shutil.copytree(ROOT / "vembed", src / "vembed", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", base / "dist", src], cwd=base, timeout=180)
    (wheel,) = (base / "dist").glob("vembed-*.whl")
    venv = _fresh_venv(base / "venv")
    # --ignore-installed: pip sees this venv's editable vembed through the .pth line and must leave it alone.
    _run([venv.python, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "-q",
          "--disable-pip-version-check", wheel], cwd=base, timeout=180)
    return venv


@pytest.fixture
def empty_dir(tmp_path) -> Path:
    path = tmp_path / "empty"
    path.mkdir()
    return path


def _tiny_recipe(tiny_clip_recipe: dict, path: Path, steps: int) -> Path:
    """The tiny CLIP recipe with a relative output_dir (so each run writes into its own working directory)."""
    raw = {**tiny_clip_recipe, "output_dir": "run", "max_steps": steps, "save_steps": None, "report_to": "none",
           "data": {"train": tiny_clip_recipe["data"]["train"]}}
    path.write_text(yaml.safe_dump(raw))
    return path


def test_clone_config_folders_are_the_shipped_files():
    """One copy in git: the clone's documented paths lead to the files the package ships."""
    from vembed.resources import accelerate_configs, demo_recipe

    assert (ROOT / "accelerate_configs").resolve() == accelerate_configs().resolve()
    assert (ROOT / "configs" / "demo_clip.yaml").resolve() == demo_recipe().resolve()
    assert {"single.yaml", "ddp_cpu.yaml", "deepspeed_zero2.yaml"} <= {p.name for p in accelerate_configs().iterdir()}


def test_a_config_named_by_its_clone_path_is_still_one_of_ours(monkeypatch):
    """`--accelerate_config accelerate_configs/ddp.yaml` (the clone's link) gets one process per GPU, as `ddp` does."""
    import torch

    from vembed.entrypoints.launch import choose_config

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    clone_path = ROOT / "accelerate_configs" / "ddp.yaml"
    assert choose_config(str(clone_path)) == (clone_path, 4)


@pytest.mark.slow
def test_installed_wheel_finds_its_accelerate_configs_and_demo_recipe_from_an_empty_directory(installed, empty_dir):
    check = """
import json, sys
from pathlib import Path
import yaml
import vembed
from vembed.cli import build_parser
from vembed.entrypoints.launch import _with_absolute_deepspeed_file, choose_config
from vembed.errors import LaunchError
from vembed.components import load_recipe

ddp_cpu, _ = choose_config("ddp_cpu")
copy = _with_absolute_deepspeed_file(choose_config("deepspeed_zero2")[0])
json_file = yaml.safe_load(copy.read_text())["deepspeed_config"]["deepspeed_config_file"]
try:
    choose_config("no_such_config")
    unknown = ""
except LaunchError as error:
    unknown = str(error)
demo = build_parser().parse_args(["demo"]).recipe
load_recipe(demo)
print(json.dumps({"vembed": vembed.__file__, "ddp_cpu": str(ddp_cpu), "json": json_file, "unknown": unknown,
                  "demo": demo, "single": str(choose_config(None)[0])}))
"""
    found = json.loads(_run([installed.python, "-c", check], cwd=empty_dir, timeout=180,
                            env={**ENV, "HF_HOME": str(empty_dir.parent / "hf")}).stdout.splitlines()[-1])
    package = installed.site_packages / "vembed"
    assert Path(found["vembed"]).parent == package, "the wheel's vembed, not the clone's"
    assert Path(found["ddp_cpu"]) == package / "accelerate_configs" / "ddp_cpu.yaml"
    assert Path(found["single"]) == package / "accelerate_configs" / "single.yaml"
    assert Path(found["json"]) == package / "accelerate_configs" / "deepspeed" / "zero2.json"
    assert "ddp_cpu" in found["unknown"] and "deepspeed_zero3" in found["unknown"]
    assert Path(found["demo"]) == package / "configs" / "demo_clip.yaml"
    assert not any(empty_dir.iterdir())


@pytest.mark.slow
def test_installed_wheel_trains_through_vembed_train_and_accelerate_launch_module(installed, tiny_clip_recipe,
                                                                                   tmp_path):
    recipe = _tiny_recipe(tiny_clip_recipe, tmp_path / "recipe.yaml", steps=3)
    # No saved accelerate config may steer `vembed train`: it must pick the shipped single.yaml.
    env = {**ENV, "HF_HOME": str(tmp_path / "hf")}
    doors = {
        "vembed train": [installed.root / "bin" / "vembed", "train", recipe],
        "accelerate launch -m": [installed.python, "-m", "accelerate.commands.launch", "--num_processes", "1",
                                 "-m", "vembed.entrypoints.train", recipe],
    }
    # Both at once: each is mostly interpreter start-up and imports, and this keeps the test near 60 s.
    running = {}
    for name, args in doors.items():
        cwd = tmp_path / name.replace(" ", "_")
        cwd.mkdir()
        running[name] = (cwd, subprocess.Popen([str(a) for a in args], cwd=cwd, env=env, text=True,
                                               stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    for name, (cwd, process) in running.items():
        try:
            stdout, stderr = process.communicate(timeout=400)
        except subprocess.TimeoutExpired:
            for _, other in running.values():
                other.kill()
            stdout, stderr = process.communicate()
            pytest.fail(f"{name} timed out\n{_tail(subprocess.CompletedProcess([], -9, stdout, stderr))}")
        result = subprocess.CompletedProcess(doors[name], process.returncode, stdout, stderr)
        assert process.returncode == 0, f"{name} exited with {process.returncode}\n{_tail(result)}"
        assert (cwd / "run" / "final").is_dir(), f"{name} saved no final model\n{_tail(result)}"
        metrics = json.loads((cwd / "run" / "metrics.json").read_text())
        assert metrics["train"]["steps"] == 3, name
        if name == "vembed train":
            shipped = installed.site_packages / "vembed" / "accelerate_configs" / "single.yaml"
            assert f"with {shipped}" in stderr, _tail(result)


@pytest.mark.slow
def test_train_file_run_without_vembed_installed_says_how_to_install_in_one_line(tmp_path, empty_dir):
    bare = _fresh_venv(tmp_path / "bare")
    result = subprocess.run([str(bare.python), str(ROOT / "vembed" / "entrypoints" / "train.py"), "recipe.yaml"],
                            cwd=empty_dir, env=ENV, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, _tail(result)
    assert result.stderr.strip().count("\n") == 0 and "pip install -e ." in result.stderr, _tail(result)
