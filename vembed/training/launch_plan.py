"""The launch plan: every decision about how this run is distributed, made once, before any data row or weight is read.

Inputs are the environment the launcher set (accelerate's variables, WORLD_SIZE), what the launcher promised
(`launch_promise.py`), the recipe, and where a rule needs it, the model built on the meta device (shapes, no weights).
Output is a frozen `LaunchPlan`: the kind of launch and its settings (DeepSpeed stage, FSDP sharding), the world
size, GradCache on or off and why. Every refusal (a launch that would silently do something else than asked, or
one that cannot work) is raised here, so a bad combination fails in seconds instead of after an 8B model is loaded:
the launch's own as launch errors, what the recipe asks of it by `vembed.recipe_checks.check_launch` (every recipe
rule's home), called from here.
The accelerator, the start block and the training step are then built from the plan; nothing decides again.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from vembed.errors import LaunchError
from vembed.planning import GradientCacheChoice, LaunchKind
from vembed.recipe_checks import check_launch
from vembed.training.fsdp import FSDP_ENV, VEMBED_FSDP_ENV, settings_from_launch
from vembed.training.launch_promise import LaunchPromise, read_promise

if TYPE_CHECKING:
    from vembed.recipe import Recipe
    from vembed.training.fsdp import FsdpSettings



def _flag(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "").lower() in ("1", "true", "yes")


@dataclass(frozen=True)
class DeepSpeedSettings:
    """The parts of a DeepSpeed launch's config that decide what vembed may do with it."""

    stage: int
    offload_parameters: bool
    offload_optimizer: bool
    zero3_init: bool  # build the model already partitioned (accelerate's zero3_init_flag)
    gathers_weights_on_save: bool  # ZeRO-3 can write full 16-bit weights (needed for final/)

    @property
    def name(self) -> str:
        offload = [part for part, on in (("parameters", self.offload_parameters),
                                         ("optimizer", self.offload_optimizer)) if on]
        return f"ZeRO-{self.stage}" + (f" + CPU offload ({', '.join(offload)})" if offload else "")


@dataclass(frozen=True)
class LaunchPlan:
    """The launch plan: how this run is distributed, decided once (`decide_launch`). Not the memory plan of `vembed
    plan` (planning.py's `MemoryPlan`), which estimates every strategy without launching any."""

    kind: LaunchKind
    world_size: int
    on_cpu: bool
    promise: LaunchPromise
    grad_cache: GradientCacheChoice
    fsdp: "FsdpSettings | None" = None
    deepspeed: DeepSpeedSettings | None = None
    uses_lora: bool = False  # the recipe's use_lora (the planner names LoRA launches apart)
    # DDP searches every step for parameters without gradients (costly) only when some batch can leave a tower idle.
    find_unused_parameters: bool = False
    compile: bool = False  # torch.compile the adapter's towers (the recipe's compile, where this launch allows it)

    @property
    def backend(self) -> str:
        return "gloo" if self.on_cpu else "NCCL"

    @property
    def sharded(self) -> bool:
        """No single process holds the full weights: saving and gathering them is collective."""
        return self.fsdp is not None or (self.deepspeed is not None and self.deepspeed.stage == 3)

    @property
    def strategy(self) -> str:
        """What runs, as printed in the start block."""
        if self.kind == "fsdp":
            name = f"FSDP2 {self.fsdp.strategy_name} ({self.backend})"
        elif self.kind == "deepspeed":
            name = f"DeepSpeed {self.deepspeed.name} ({self.backend})"
        elif self.kind == "ddp":
            name = f"DDP ({self.backend})"
        else:
            name = "single device"
        return name + (" + GradCache" if self.grad_cache.enabled else "")

    @property
    def planner_strategy(self) -> str:
        """This launch under its `vembed plan` name, for the memory estimate printed at start."""
        if self.kind == "fsdp":
            if not self.uses_lora:
                return "fsdp"
            return "fsdp+lora+offload" if self.fsdp.offload else "fsdp+lora"
        if self.kind == "deepspeed":
            if self.deepspeed.stage != 3:
                return "zero2"
            if self.deepspeed.offload_parameters:
                return "zero3+offload"
            return "zero3+lora" if self.uses_lora else "zero3"
        if self.grad_cache.enabled:
            return "ddp+gradcache"
        return "ddp" if self.world_size > 1 else "single"

    def with_unused_parameter_search(self, needed: bool) -> "LaunchPlan":
        """The plan once the training data says whether every batch reaches every tower (text-only pairs on CLIP
        leave the vision tower idle)."""
        return dataclasses.replace(self, find_unused_parameters=needed)


# --- deciding ---------------------------------------------------------------------------------------------------------


def decide_launch(recipe: "Recipe", env: Mapping[str, str] | None = None) -> LaunchPlan:
    """The plan for `recipe` under the launch described by `env` (default: this process's environment)."""
    env = os.environ if env is None else env
    world_size = int(env.get("WORLD_SIZE") or 1)
    promise = read_promise(env)
    _check_promise(promise, world_size)
    on_cpu = _flag(env, "ACCELERATE_USE_CPU") or not _cuda_available()

    fsdp = deepspeed = None
    if _flag(env, "ACCELERATE_USE_DEEPSPEED"):
        kind: LaunchKind = "deepspeed"
        deepspeed = deepspeed_settings(env)
    elif _flag(env, FSDP_ENV) or _flag(env, VEMBED_FSDP_ENV):

        kind = "fsdp"
        fsdp = settings_from_launch()
    else:
        kind = "ddp" if world_size > 1 else "single"
    # What the recipe asks of this launch (fp16, FSDP, GradCache, compile) is judged where every recipe rule is.
    grad_cache = check_launch(recipe, kind, on_cpu=on_cpu, promise=promise)
    return LaunchPlan(kind=kind, world_size=world_size, on_cpu=on_cpu, promise=promise, grad_cache=grad_cache,
                      fsdp=fsdp, deepspeed=deepspeed, uses_lora=recipe.use_lora, compile=recipe.compile)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _check_promise(promise: LaunchPromise, world_size: int) -> None:
    if promise.num_processes is None or promise.num_processes == world_size:
        return
    started = f"{world_size} process{'es' if world_size != 1 else ''}"
    why = ""
    if world_size == 1 and promise.command == "accelerate launch":  # the ways accelerate turns N processes into one
        if promise.cpu_flag:
            why = " (accelerate's --cpu flag starts one process)"
        elif promise.distributed_type == "MULTI_CPU":
            why = " (accelerate starts a MULTI_CPU config as one process unless mpirun is set up)"
        elif promise.distributed_type == "NO":
            why = " (distributed_type NO is a single-process config)"
    raise LaunchError(
        f"this launch promised {promise.num_processes} processes ({promise.source}) but started {started}{why}; "
        f"for several CPU processes launch with {promise.use_config_hint('ddp_cpu')}"
    )


def deepspeed_settings(env: Mapping[str, str]) -> DeepSpeedSettings:
    """A DeepSpeed launch's settings from its JSON config (or the accelerate variables that replace it)."""
    if importlib.util.find_spec("deepspeed") is None:
        raise LaunchError("this launch uses DeepSpeed (its accelerate config says distributed_type: DEEPSPEED) but "
                          "deepspeed is not installed: pip install 'vembed[deepspeed]', or launch with DDP or FSDP")
    config: dict = {}
    named = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if named and named.lower() != "none":
        path = Path(named)
        if not path.is_file():
            raise LaunchError(f"the DeepSpeed config file {named!r} named by the accelerate config does not exist "
                              f"(relative paths are read from the current directory {os.getcwd()})")
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise LaunchError(f"the DeepSpeed config file {named} is not valid JSON: {error}") from None
    zero = config.get("zero_optimization") or {}
    stage = int(zero.get("stage", env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") or 2))
    if stage not in (2, 3):
        raise LaunchError(f"DeepSpeed ZeRO stage {stage}: vembed runs stage 2 or 3 (stage 0/1 shard less than "
                          "ZeRO-2 and gain nothing over DDP here); set zero_optimization.stage to 2 or 3")

    def offloaded(key: str, env_name: str) -> bool:
        device = (zero.get(key) or {}).get("device") or env.get(env_name) or "none"
        return str(device).lower() not in ("none", "")

    gathers = bool(zero.get("stage3_gather_16bit_weights_on_model_save")) or _flag(
        env, "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL")
    settings = DeepSpeedSettings(
        stage=stage,
        offload_parameters=offloaded("offload_param", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"),
        offload_optimizer=offloaded("offload_optimizer", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"),
        zero3_init=_flag(env, "ACCELERATE_DEEPSPEED_ZERO3_INIT"),
        gathers_weights_on_save=gathers,
    )
    if stage == 3 and not gathers:
        raise LaunchError(
            "ZeRO-3 can only write the final model with \"stage3_gather_16bit_weights_on_model_save\": true in the "
            "DeepSpeed config (accelerate_configs/deepspeed/zero3.json sets it); without it the run would train and "
            "then fail to save"
        )
    return settings
