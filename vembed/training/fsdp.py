"""FSDP2: shard the objective with torch's `fully_shard`, and save/load sharded checkpoints with every rank.

Why we shard instead of letting accelerate do it: accelerate ignores FSDP on CPU, so its path could never be tested
where our CI runs. We read the settings from the accelerate FSDP config (its public plugin), build the accelerator
without FSDP, and apply the same `fully_shard` calls on GPUs and on a CPU (gloo) mesh alike: the path users run is
the path the tests run.

Units: every transformer block the adapter names (`block_classes()`), then the adapter (embeddings, norms, heads),
then the objective (the loss's temperature/bias). Evaluation goes through the objective's forward like training
(`encode=`), with the weights gathered in float32 (`full_precision_gathers`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vembed.errors import LaunchError

if TYPE_CHECKING:
    from accelerate import Accelerator

    from vembed.recipe import Recipe
    from vembed.tasks.contrastive import ContrastiveObjective

FSDP_ENV = "ACCELERATE_USE_FSDP"  # set by `accelerate launch` for a config with distributed_type: FSDP
VEMBED_FSDP_ENV = "VEMBED_FSDP"  # ours: the launch asked for FSDP (accelerate's flag is turned off once read)


@dataclass(frozen=True)
class FsdpSettings:
    reshard_after_forward: bool  # True: FULL_SHARD; False: SHARD_GRAD_OP
    offload: bool  # parameters, gradients and optimizer state in CPU RAM

    @property
    def strategy_name(self) -> str:
        name = "FULL_SHARD" if self.reshard_after_forward else "SHARD_GRAD_OP"
        return name + (" + CPU offload" if self.offload else "")


def settings_from_launch() -> FsdpSettings:
    """The FSDP settings of this launch's accelerate config, read through accelerate's own plugin."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    strategy = os.environ.get("FSDP_SHARDING_STRATEGY", "").upper()
    if strategy == "NO_SHARD":
        raise LaunchError("FSDP NO_SHARD replicates everything, which is DDP: launch with accelerate_configs/ddp.yaml")
    try:
        plugin = FullyShardedDataParallelPlugin()
    except ValueError as error:
        raise LaunchError(f"the accelerate FSDP config is not valid for FSDP2: {error}") from None
    if plugin.fsdp_version != 2:
        raise LaunchError("vembed runs FSDP2: set fsdp_version: 2 in the accelerate config (see fsdp.yaml)")
    from torch.distributed.fsdp import CPUOffloadPolicy

    offload = isinstance(plugin.cpu_offload, CPUOffloadPolicy)
    return FsdpSettings(reshard_after_forward=bool(plugin.reshard_after_forward), offload=offload)


def shard_objective(objective: "ContrastiveObjective", recipe: "Recipe", accelerator: "Accelerator",
                    settings: FsdpSettings) -> "ContrastiveObjective":
    """Shard in place (blocks, adapter, objective) over all processes; returns the same module."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    from vembed.recipe_checks import check_fsdp_blocks

    check_fsdp_blocks(recipe, objective.adapter)  # the launch plan judged the meta build, where there is one
    blocks = objective.adapter.block_classes()
    precision = accelerator.mixed_precision
    param_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    options: dict[str, Any] = {
        "mesh": init_device_mesh(accelerator.device.type, (accelerator.num_processes,)),
        "reshard_after_forward": settings.reshard_after_forward,
        # Gradients are reduced in fp32 whatever the compute dtype: summing bf16 across ranks loses digits.
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32),
        "offload_policy": CPUOffloadPolicy() if settings.offload else OffloadPolicy(),
    }
    # fully_shard refuses 0-dim parameters (CLIP's logit_scale, which vembed does not use: the loss has its own
    # temperature). They stay whole on every rank and are frozen, since nothing would average their gradients.
    scalars = {name: p for name, p in objective.named_parameters() if p.ndim == 0}
    for param in scalars.values():
        param.requires_grad_(False)
    if scalars:
        options["ignored_params"] = set(scalars.values())
        accelerator.print(f"FSDP: 0-dim parameters kept whole and frozen: {', '.join(sorted(scalars))}")
    objective.to(accelerator.device if not settings.offload else torch.device("cpu"))
    for module in list(objective.modules()):
        if type(module) in blocks:
            fully_shard(module, **options)
    fully_shard(objective.adapter, **options)
    # FSDP2 gathers a unit's parameters in the hooks of its `forward`; an objective that calls another adapter method
    # (classify, encode) names it, or the adapter's own weights (a ViT's last norm, the head) stay sharded.
    for method in getattr(type(objective), "adapter_methods", ()):
        register_fsdp_forward_method(objective.adapter, method)
    fully_shard(objective, **options)
    _initialise_from_the_root(objective)
    return objective


@contextlib.contextmanager
def full_precision_gathers(model: torch.nn.Module) -> Iterator[None]:
    """Within, FSDP gathers every parameter in the dtype it is stored and saved in (float32), not in the mixed-precision
    `param_dtype`, so a forward computes what one process computes on the saved weights; evaluation runs inside it.
    A no-op for a model FSDP does not shard with mixed precision (every other launch, and FSDP in float32).

    Why not the alternatives: training on float32 gathers under bf16 autocast (as DDP does) would keep a bf16 copy of
    every weight alive from forward to backward (the memory FSDP exists to save), double the all-gathered bytes and
    change FSDP's training numerics; evaluating a gathered full model would need the whole model on each rank. FSDP2 has
    no public switch for its policy (torch 2.13), so this sets the policy where `fully_shard` keeps it and drops the
    buffers gathered in the old dtype: the next unshard allocates them in the new one. The FSDP + bf16 launch test
    (in-run metrics = the saved model's) fails if a torch release moves these attributes.
    """
    from torch.distributed.fsdp import FSDPModule

    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    try:
        policies = {unit: unit._get_fsdp_state()._mp_policy for unit in units}
    except AttributeError:  # another torch release keeps the policy elsewhere: evaluate as FSDP computes
        warnings.warn("FSDP keeps its mixed-precision policy where this torch release does not expose it: in-run "
                   "evaluation runs on the mixed-precision copies of the weights; `vembed eval` on final/ gives the "
                   "float32 figures", stacklevel=3)  # shown once per run: the default filter
        yield
        return
    mixed = {unit: policy for unit, policy in policies.items() if policy.param_dtype is not None}
    if not mixed:
        yield
        return
    for unit in units:
        unit.reshard()  # every parameter sharded: no gathered copy of the old dtype is in use
    for unit, policy in mixed.items():
        _set_precision_policy(unit, dataclasses.replace(policy, param_dtype=None))
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
        for unit, policy in mixed.items():
            _set_precision_policy(unit, policy)


def _set_precision_policy(unit: torch.nn.Module, policy: Any) -> None:
    state = unit._get_fsdp_state()
    state._mp_policy = policy  # read to cast forward inputs
    for group in state._fsdp_param_groups:
        group.mp_policy = policy
        group._init_mp_dtypes()  # each parameter's param_dtype, which its all-gather casts to
        for param in group.fsdp_params:
            param.all_gather_outputs = []  # the gathered buffers and their parameter view, in the old dtype
            param.__dict__.pop("_unsharded_param", None)


def _initialise_from_the_root(objective: torch.nn.Module) -> None:
    """FSDP2 takes the first FSDP module called as the root and initialises the tree from it. Evaluation before
    training calls the adapter alone, which would make the adapter a root and break the objective's own forward
    later; calling the objective first, with a forward that does nothing, makes it the root for good."""
    objective.forward = lambda *args, **kwargs: None  # the root's hooks still run: lazy init, gather, reshard
    try:
        with torch.no_grad():
            objective()
    finally:
        del objective.forward


# --- sharded checkpoints ----------------------------------------------------------------------------------------------
SHARDS_DIR = "fsdp_shards"  # torch.distributed.checkpoint files: model and optimizer, one shard per rank
SCHEDULER_FILE = "scheduler.pt"


def rng_file(rank: int) -> str:
    return f"rng_state_{rank}.pt"


def save_sharded(directory: Path, accelerator: "Accelerator", model, optimizer, scheduler) -> None:
    """Collective: every rank writes its shard of model and optimizer state, and its own RNG state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, _inner(optimizer))
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(directory / SHARDS_DIR))
    if accelerator.is_main_process:
        torch.save(scheduler.state_dict(), directory / SCHEDULER_FILE)
    torch.save(_rng_state(accelerator.device), directory / rng_file(accelerator.process_index))


def load_sharded(directory: Path, accelerator: "Accelerator", model, optimizer, scheduler) -> None:
    """Collective: the inverse of `save_sharded`, on the same number of processes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, _inner(optimizer))
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(directory / SHARDS_DIR))
    set_state_dict(model, _inner(optimizer), model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    scheduler.load_state_dict(torch.load(directory / SCHEDULER_FILE, weights_only=True))
    rng = directory / rng_file(accelerator.process_index)
    if not rng.is_file():
        raise LaunchError(f"{directory} was saved by fewer processes; resume with the same number of processes")
    _set_rng_state(torch.load(rng, weights_only=True), accelerator.device)


def _inner(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps the torch one


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type != "cpu":
        state["device"] = torch.get_device_module(device.type).get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if "device" in state:
        torch.get_device_module(device.type).set_rng_state(state["device"], device)
