"""The Accelerator for a launch plan: device, precision, accumulation, trackers, gloo on CPU; then a check that
accelerate built the launch the plan describes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from vembed.errors import LaunchError
from vembed.training.fsdp import FSDP_ENV, VEMBED_FSDP_ENV

if TYPE_CHECKING:
    from accelerate import Accelerator

    from vembed.recipe import Recipe
    from vembed.training.launch_plan import LaunchPlan


def build_accelerator(recipe: "Recipe", plan: "LaunchPlan") -> "Accelerator":
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs, ProjectConfiguration

    if plan.kind == "fsdp":
        # We shard ourselves (vembed/training/fsdp.py); an accelerator that also believed in FSDP would wrap the
        # model a second time on GPUs. The plan has read the launch's FSDP settings already.
        os.environ[FSDP_ENV] = "false"
        os.environ[VEMBED_FSDP_ENV] = "true"
    handlers = [DistributedDataParallelKwargs(find_unused_parameters=plan.find_unused_parameters)]
    if plan.on_cpu and plan.world_size > 1:
        handlers.append(InitProcessGroupKwargs(backend="gloo"))  # NCCL needs GPUs
    if plan.on_cpu and plan.kind == "deepspeed":
        from vembed.training.deepspeed import skip_cpu_inference_comm_op

        skip_cpu_inference_comm_op()
    try:
        accelerator = Accelerator(
            # Accelerator(cpu=True) quietly turns a DeepSpeed launch into DDP; DeepSpeed finds the CPU by itself.
            cpu=plan.on_cpu and plan.kind != "deepspeed",
            mixed_precision=recipe.mixed_precision,
            gradient_accumulation_steps=recipe.gradient_accumulation_steps,
            log_with=list(recipe.report_to) or None,
            project_config=ProjectConfiguration(project_dir=recipe.output_dir,
                                                logging_dir=str(Path(recipe.output_dir, "logs"))),
            kwargs_handlers=handlers,
            # The loop steps the scheduler once per optimizer step itself.
            step_scheduler_with_optimizer=False,
            dataloader_config=DataLoaderConfiguration(even_batches=True),
        )
    except ValueError as error:  # accelerate's own checks of the launch config: one line, not a traceback
        raise LaunchError(f"accelerate refused this launch: {error}") from None
    check_accelerator_matches(accelerator, plan)
    return accelerator


def check_accelerator_matches(accelerator: "Accelerator", plan: "LaunchPlan") -> None:
    """The process group accelerate set up is the one the plan was made for."""
    if accelerator.num_processes != plan.world_size:
        raise LaunchError(f"the launch plan was made for {plan.world_size} process(es) but the accelerator has "
                          f"{accelerator.num_processes}")
