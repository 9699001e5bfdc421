"""Files vembed reads at run time and ships as package data: the accelerate configs and the demo recipe.

They live inside the package so that an installed wheel finds them from any directory; the clone's top-level
`accelerate_configs/` and `configs/demo_clip.yaml` are links to these same files.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path


def package_root() -> Path:
    """The installed `vembed/` folder. It holds `accelerate_configs/` as the repository root does, so the paths our
    DeepSpeed YAMLs name (`accelerate_configs/deepspeed/zero2.json`) resolve against either."""
    # A real path, not a Traversable: accelerate and the recipe loader take file names, and vembed is installed
    # unpacked (pip never installs a wheel as a zip).
    return Path(str(files("vembed")))


def accelerate_configs() -> Path:
    """The folder of shipped accelerate configs (single, ddp, ddp_cpu, fsdp*, deepspeed_zero*)."""
    return package_root() / "accelerate_configs"


def demo_recipe() -> Path:
    """The recipe `vembed demo` trains."""
    return package_root() / "configs" / "demo_clip.yaml"
