"""The block printed when a run starts: what runs where (from the launch plan), how big its batches really are (from
the task), the parameters, and the memory planner's estimate for this launch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from accelerate import Accelerator

    from vembed.recipe import Recipe
    from vembed.training.launch_plan import LaunchPlan
    from vembed.training.threads import ThreadChoice


def describe_launch(plan: "LaunchPlan", accelerator: "Accelerator", recipe: "Recipe", trainable: int, total: int,
                    batch_lines: list[tuple[str, str]], *, grad_cache_applies: bool = True,
                    threads: "ThreadChoice | None" = None) -> str:
    """`batch_lines`: the task's (label, value) lines on its batch; `grad_cache_applies`: the task can use GradCache
    (a flow-matching run has no contrastive batch to cache); `threads`: how the entrypoint chose the thread count."""
    import torch

    world = plan.world_size
    # What torch uses now, not what was asked: a count set elsewhere after the choice shows here.
    why = f" ({threads.reason})" if threads is not None and threads.count == torch.get_num_threads() else ""
    lines = [
        ("strategy", f"{plan.strategy} ({world} process{'es' if world > 1 else ''})"),
        ("device", str(accelerator.device)),
        ("threads", f"{torch.get_num_threads()} intra-op per process{why}"),
        ("precision", str(accelerator.mixed_precision)),
        ("per-device batch", str(recipe.batch_size)),
    ]
    if grad_cache_applies:
        chunk = f"{plan.grad_cache.chunk_size} samples per forward" if plan.grad_cache.enabled else "-"
        lines.append(("GradCache", f"{plan.grad_cache.reason}; chunk {chunk}"))
    if plan.compile:
        lines.append(("compile", "on: torch.compile of each encoder tower (the first steps, and each new input "
                                 "shape, compile)"))
    lines += batch_lines
    lines.append(("parameters", f"{trainable:,} trainable / {total:,} total"))
    return "\n".join(f"{label:<20}{value}" for label, value in lines)


def launch_record(plan: "LaunchPlan", accelerator: "Accelerator", recipe: "Recipe", trainable: int, total: int, *,
                  contrastive: bool = True) -> dict[str, Any]:
    """The start block's figures as data, for the model card: what ran where and how big each batch was.
    `contrastive`: the task has a contrastive batch (negatives gathered across processes) and can use GradCache."""
    world = plan.world_size
    record: dict[str, Any] = {
        "strategy": plan.strategy, "kind": plan.kind, "world_size": world, "device": accelerator.device.type,
        "precision": str(accelerator.mixed_precision), "per_device_batch": recipe.batch_size,
        "gradient_accumulation_steps": recipe.gradient_accumulation_steps,
        "effective_batch": recipe.batch_size * world * recipe.gradient_accumulation_steps,
        "lora": recipe.use_lora, "trainable_parameters": trainable, "total_parameters": total,
    }
    if contrastive:
        record["contrastive_batch"] = recipe.batch_size * world
        record["gradient_cache"] = {"enabled": plan.grad_cache.enabled, "chunk_size": plan.grad_cache.chunk_size,
                                    "reason": plan.grad_cache.reason}
    return record


def memory_estimate_line(plan: "LaunchPlan", recipe: "Recipe", device_type: str) -> str:
    """The planner's per-device estimate for this launch; says why when the model's shape cannot be read (the run
    goes on: an estimate is advice, not a requirement)."""
    from vembed.planning import estimate_line

    try:
        return estimate_line(recipe, plan.planner_strategy, plan.world_size, device=device_type)
    except Exception as error:  # noqa: BLE001 - any failure here must not stop training
        return f"memory estimate     unavailable ({type(error).__name__}: {error})"
