"""Launch strategy: build the Accelerator for this launch and check it is the launch the user asked for.

Everything that differs between launches (process-group backend, world-size checks, the forward/backward of one
micro-batch: plain or GradCache) lives here, so the loop reads the same for every launch.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vembed.errors import LaunchError

if TYPE_CHECKING:
    from accelerate import Accelerator

    from vembed.data.records import Example
    from vembed.recipe import Recipe
    from vembed.training.fsdp import FsdpSettings

EXPECTED_WORLD_SIZE_ENV = "VEMBED_EXPECTED_WORLD_SIZE"  # set by run.py / tests: the process count the launch promised


def _launcher_num_processes() -> int | None:
    """`--num_processes N` from the parent `accelerate launch` command line, if that is what started us.

    `accelerate launch --cpu --num_processes 2` silently starts ONE process and sets no WORLD_SIZE; the parent's
    command line is the only place the promise survives.
    """
    try:
        args = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    launched = any(a == "launch" or a.endswith("accelerate.commands.launch") for a in args[:4])
    if not launched or not any("accelerate" in a for a in args[:4]):
        return None
    for i, arg in enumerate(args):
        match = re.fullmatch(r"--num[_-]processes(?:=(\d+))?", arg)
        if match:
            value = match.group(1) or (args[i + 1] if i + 1 < len(args) else "")
            return int(value) if value.isdigit() else None
    return None


def expected_world_size() -> int | None:
    for source in (os.environ.get(EXPECTED_WORLD_SIZE_ENV), os.environ.get("WORLD_SIZE")):
        if source and source.isdigit():
            return int(source)
    return _launcher_num_processes()


def check_world_size(accelerator: "Accelerator") -> None:
    expected = expected_world_size()
    if expected is not None and expected != accelerator.num_processes:
        raise LaunchError(
            f"the launch promised {expected} processes but this run has {accelerator.num_processes}; on CPU, "
            "`accelerate launch --cpu --num_processes N` starts one process: use "
            "`--config_file accelerate_configs/ddp_cpu.yaml` (MULTI_GPU launcher with use_cpu) instead"
        )


def every_step_uses_every_tower(modalities: frozenset[str], examples: "list[Example]") -> bool:
    """True when each record feeds every tower (e.g. text AND image for CLIP), so every batch gives every parameter a
    gradient and DDP can skip its (costly) search for unused parameters."""
    for example in examples:
        sides = [example.query, example.positive, *example.negatives]
        present = {"text" for s in sides if s.text} | {"image" for s in sides if s.image is not None}
        if not modalities <= present:
            return False
    return True


def launched_with_deepspeed() -> bool:
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true")


def build_accelerator(recipe: "Recipe", find_unused_parameters: bool = False) -> "Accelerator":
    """The Accelerator for this launch: device, precision, accumulation, trackers, and gloo on CPU.

    `find_unused_parameters`: set when some steps may leave a tower without gradients (text-only pairs on CLIP).
    """
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

    from vembed.training.fsdp import FSDP_ENV, VEMBED_FSDP_ENV, launched_with_fsdp

    on_cpu = not torch.cuda.is_available() or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true")
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    deepspeed = launched_with_deepspeed()
    fsdp = launched_with_fsdp()
    if fsdp:
        # We shard ourselves (vembed/training/fsdp.py); an accelerator that also believed in FSDP would wrap the
        # model a second time on GPUs. The launch's FSDP_* settings stay in the environment for `settings_from_launch`.
        os.environ[FSDP_ENV] = "false"
        os.environ[VEMBED_FSDP_ENV] = "true"
    if recipe.use_fsdp and not fsdp:
        from vembed.errors import RecipeError

        raise RecipeError("use_fsdp", "is true but this launch is not FSDP; launch with python run.py RECIPE or "
                          "accelerate launch --config_file accelerate_configs/fsdp.yaml")
    handlers = [DistributedDataParallelKwargs(find_unused_parameters=find_unused_parameters)]
    if on_cpu and distributed:
        handlers.append(InitProcessGroupKwargs(backend="gloo"))  # NCCL needs GPUs
    if on_cpu and recipe.mixed_precision == "fp16":
        from vembed.errors import RecipeError

        raise RecipeError("mixed_precision", "fp16 needs a GPU; use bf16 or no on CPU")
    try:
        # Accelerator(cpu=True) quietly turns a DeepSpeed launch into DDP; DeepSpeed finds the CPU by itself.
        accelerator = _accelerator(Accelerator, on_cpu and not deepspeed, recipe, handlers)
    except ValueError as error:  # accelerate's own checks of the launch config: one line, not a traceback
        raise LaunchError(f"accelerate refused this launch: {error}") from None
    check_world_size(accelerator)
    return accelerator


def _accelerator(Accelerator, cpu: bool, recipe: "Recipe", handlers: list) -> "Accelerator":
    from accelerate import DataLoaderConfiguration
    from accelerate.utils import ProjectConfiguration

    return Accelerator(
        cpu=cpu,
        mixed_precision=recipe.mixed_precision,
        gradient_accumulation_steps=recipe.gradient_accumulation_steps,
        log_with=list(recipe.report_to) or None,
        project_config=ProjectConfiguration(
            project_dir=recipe.output_dir, logging_dir=str(Path(recipe.output_dir, "logs"))
        ),
        kwargs_handlers=handlers,
        # We compute total steps from the sharded loader and step the scheduler once per optimizer step ourselves.
        step_scheduler_with_optimizer=False,
        dataloader_config=DataLoaderConfiguration(even_batches=True),
    )


def configure_deepspeed(accelerator: "Accelerator", recipe: "Recipe", model: torch.nn.Module) -> None:
    """Fill the DeepSpeed config's "auto" values accelerate cannot: clipping from the recipe, and the bucket sizes
    it would read from `model.config` (our objective wraps several models, so it has none)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return
    config = plugin.deepspeed_config
    if config.get("gradient_clipping", "auto") == "auto":
        config["gradient_clipping"] = recipe.max_grad_norm or 0.0
    hidden = max((getattr(getattr(m, "config", None), "hidden_size", 0) or 0 for m in model.modules()), default=0)
    if hidden:
        # The values transformers' Trainer uses for the same keys.
        zero = config.setdefault("zero_optimization", {})
        for key, value in (("reduce_bucket_size", hidden * hidden),
                           ("stage3_prefetch_bucket_size", int(0.9 * hidden * hidden)),
                           ("stage3_param_persistence_threshold", 10 * hidden)):
            if zero.get(key) == "auto":
                zero[key] = value
    if config.get("zero_optimization", {}).get("stage") == 3:
        # Some transformers modules read a child's weight shape before ZeRO-3 has gathered it (CLIP's text embeddings
        # check the sequence length against position_embedding.weight.shape); adapters name those parameters and
        # they stay whole on every rank (below the persistence threshold, ZeRO-3 does not partition).
        whole = [p.numel() for p in _zero3_unpartitioned(model)]
        zero = config.setdefault("zero_optimization", {})
        if whole and int(zero.get("stage3_param_persistence_threshold") or 0) < max(whole):
            zero["stage3_param_persistence_threshold"] = max(whole)
        if accelerator.device.type == "cpu":
            # DeepSpeed's blocking coalesced all-gather (persistent parameters after every step and checkpoint,
            # GatheredParameters) launches one async gather per parameter and waits for the last only: enough on one
            # CUDA stream, not under gloo, whose worker threads finish them out of order. Parameters were read, or
            # their freed buffers reused, while half of them was still arriving (evaluation after the export saw
            # garbage in 1 run of 3). Sequential gathers wait for each one.
            zero["stage3_allgather_sequential"] = True


def is_sharded(accelerator: "Accelerator", model: torch.nn.Module) -> bool:
    """True when no single process holds the full weights (ZeRO-3, FSDP): saving the model is then collective."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        return True
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return plugin is not None and plugin.zero_stage == 3


def gather_full_state_dict(accelerator: "Accelerator", model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """Collective (every rank must call it when `is_sharded`): the unwrapped objective's full state dict, on CPU, on
    the main process; None on the others."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        plugin = accelerator.state.deepspeed_plugin
        zero = plugin.deepspeed_config.get("zero_optimization", {})
        if not zero.get("stage3_gather_16bit_weights_on_model_save", False):
            from vembed.errors import LaunchError

            raise LaunchError(
                "ZeRO-3 can only export the final model with \"stage3_gather_16bit_weights_on_model_save\": true in "
                "the DeepSpeed config (accelerate_configs/deepspeed/zero3.json sets it)"
            )
        state = accelerator.get_state_dict(model)
    return {k: v.detach().cpu() for k, v in state.items()} if accelerator.is_main_process else None


@contextlib.contextmanager
def unsharded_construction(accelerator: "Accelerator", *, unless_zero3_init: bool = False) -> Iterator[None]:
    """Models built inside are ordinary single-process models, even under ZeRO-3, whose hook in transformers would
    otherwise partition them at construction (a collective that one rank alone never finishes).

    `unless_zero3_init`: keep partitioned construction when the accelerate config asks for it (`zero3_init_flag:
    true`: for models too big to build whole on each rank). accelerate installs the hook whatever the flag says; a
    model built whole is initialised exactly as on one process (same seed, same weights).
    """
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None or plugin.zero_stage != 3 or (unless_zero3_init and plugin.zero3_init_flag):
        yield
        return
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total), counting ZeRO-3-partitioned parameters at their full size."""
    trainable = total = 0
    for param in model.parameters():
        size = int(getattr(param, "ds_numel", 0) or param.numel())
        total += size
        trainable += size if param.requires_grad else 0
    return trainable, total


def _zero3_unpartitioned(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    found = []
    for module in model.modules():
        declared = getattr(module, "zero3_unpartitioned_parameters", None)
        if callable(declared):
            found.extend(declared())
    return found


def planner_strategy(accelerator: "Accelerator", recipe: "Recipe", grad_cache: "GradientCacheChoice | None",
                     fsdp: "FsdpSettings | None") -> str:
    """This launch under its `vembed plan` name, for the memory estimate printed at start."""
    if fsdp is not None:
        return "fsdp+lora+offload" if recipe.use_lora and fsdp.offload else "fsdp+lora" if recipe.use_lora else "fsdp"
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None:
        if plugin.zero_stage != 3:
            return "zero2"
        offload = plugin.deepspeed_config.get("zero_optimization", {}).get("offload_param")
        return "zero3+offload" if offload else "zero3+lora" if recipe.use_lora else "zero3"
    if grad_cache is not None and grad_cache.enabled:
        return "ddp+gradcache"
    return "ddp" if accelerator.num_processes > 1 else "single"


def memory_estimate_line(accelerator: "Accelerator", recipe: "Recipe", grad_cache: "GradientCacheChoice | None",
                         fsdp: "FsdpSettings | None") -> str | None:
    """The planner's per-device estimate for this launch; None when the model's shape cannot be read (the run
    goes on: an estimate is advice, not a requirement)."""
    from vembed.planning import estimate_line

    try:
        # Only the main process asks: the meta-device model must not go through ZeRO-3's (collective) construction.
        with unsharded_construction(accelerator):
            return estimate_line(recipe, planner_strategy(accelerator, recipe, grad_cache, fsdp),
                                 accelerator.num_processes, device=accelerator.device.type)
    except Exception as error:  # noqa: BLE001 - any failure here must not stop training
        return f"memory estimate     unavailable ({type(error).__name__}: {error})"


def describe_launch(
    accelerator: "Accelerator", recipe: "Recipe", trainable: int, total: int,
    grad_cache: "GradientCacheChoice | None" = None, fsdp: "FsdpSettings | None" = None,
) -> str:
    """The block printed at start: what runs where, and how big the contrastive batch really is."""
    world = accelerator.num_processes
    processes = f"{world} process{'es' if world > 1 else ''}"
    kind = accelerator.distributed_type.value
    strategy = {"NO": "single device", "MULTI_GPU": "DDP (NCCL)", "MULTI_CPU": "DDP (gloo)"}.get(kind, kind)
    if fsdp is not None:
        backend = "NCCL" if accelerator.device.type == "cuda" else "gloo"
        strategy = f"FSDP2 {fsdp.strategy_name} ({backend})"
    if grad_cache is not None and grad_cache.enabled:
        strategy += " + GradCache"
    lines = [
        f"strategy            {strategy} ({processes})",
        f"device              {accelerator.device}",
        f"precision           {accelerator.mixed_precision}",
        f"per-device batch    {recipe.batch_size}",
    ]
    if grad_cache is not None:
        chunk = f"{grad_cache.chunk_size} samples per forward" if grad_cache.enabled else "-"
        lines.append(f"GradCache           {grad_cache.reason}; chunk {chunk}")
    lines += [
        f"contrastive batch   {recipe.batch_size * world} (negatives gathered across processes)",
        f"effective batch     {recipe.batch_size * world * recipe.gradient_accumulation_steps} per optimizer step",
        f"parameters          {trainable:,} trainable / {total:,} total",
    ]
    return "\n".join(lines)


# --- the forward/backward of one micro-batch --------------------------------------------------------------------------
AUTO_GRADIENT_CACHE_PARAMETERS = 1_000_000_000  # the seeds' rule: checkpointing on a >1B model turns GradCache on
DEFAULT_GRADIENT_CACHE_CHUNK = 8


@dataclass(frozen=True)
class GradientCacheChoice:
    enabled: bool
    chunk_size: int | None  # samples per forward chunk, when enabled
    reason: str  # why, for the launch block


def choose_gradient_cache(recipe: "Recipe", num_parameters: int) -> GradientCacheChoice:
    """GradCache on or off for this run, and its chunk size (never more than the per-device batch)."""
    if recipe.use_gradient_cache is None:
        auto = recipe.gradient_checkpointing and num_parameters > AUTO_GRADIENT_CACHE_PARAMETERS
        if not auto:
            return GradientCacheChoice(False, None, "off")
        reason = (f"on (automatic: gradient_checkpointing with {num_parameters / 1e9:.1f}B parameters; "
                  "set use_gradient_cache: false to turn it off)")
    elif not recipe.use_gradient_cache:
        return GradientCacheChoice(False, None, "off")
    else:
        reason = "on (use_gradient_cache)"
    chunk = min(recipe.gradient_cache_chunk_size or DEFAULT_GRADIENT_CACHE_CHUNK, recipe.batch_size)
    return GradientCacheChoice(True, chunk, reason)


def build_train_step(
    accelerator: "Accelerator", model: torch.nn.Module, choice: GradientCacheChoice
) -> Callable[[dict[str, Any]], torch.Tensor]:
    """`step(batch) -> detached loss`: forward and backward of one micro-batch, through the accelerator."""
    if not choice.enabled:

        def plain_step(batch: dict[str, Any]) -> torch.Tensor:
            loss = model(batch)
            accelerator.backward(loss)
            return loss.detach()

        return plain_step

    from accelerate.utils import DistributedType
    from torch.distributed.fsdp import FSDPModule

    from vembed.errors import RecipeError
    from vembed.training.grad_cache import GradCacheStep

    if isinstance(model, FSDPModule):
        raise RecipeError(
            "use_gradient_cache",
            "GradCache is not available under FSDP: its cached loss runs outside the sharded forward, where the "
            "loss's own parameters stay sharded; use DDP + GradCache (with LoRA for big models) or FSDP without it",
        )
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        raise RecipeError(
            "use_gradient_cache",
            "GradCache needs several backward passes per optimizer step, which DeepSpeed's engine counts as "
            "separate micro-steps; use DDP + GradCache, or DeepSpeed without it (use_gradient_cache: false)",
        )
    return GradCacheStep(accelerator, model, choice.chunk_size)
