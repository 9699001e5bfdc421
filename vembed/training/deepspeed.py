"""What DeepSpeed needs from vembed: the config's "auto" values accelerate cannot fill, and model construction that
ZeRO-3's hook in transformers must not partition."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from accelerate import Accelerator

    from vembed.recipe import Recipe


def configure_deepspeed(accelerator: "Accelerator", recipe: "Recipe", model: torch.nn.Module) -> None:
    """Fill the DeepSpeed config's "auto" values accelerate cannot: the micro-batch (without a DataLoader to read it
    from), clipping from the recipe, and the bucket sizes it would read from `model.config` (our objective wraps
    several models, so it has none)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return
    config = plugin.deepspeed_config
    if config.get("train_micro_batch_size_per_gpu") == "auto":
        # accelerate reads it from the prepared DataLoader; a streamed run prepares none (vembed/training/streamed.py).
        config["train_micro_batch_size_per_gpu"] = recipe.batch_size
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
        # the persistence threshold keeps them gathered during forward passes (DeepSpeed still partitions them
        # around checkpoints and the export, which gather them again).
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


def skip_cpu_inference_comm_op() -> None:
    """Keep DeepSpeed from compiling its shared-memory all-reduce when its process group starts on CPU: a C++ op
    (~45 s of 2 cores, a compiler needed, rebuilt whenever the install's path changes) that only DeepSpeed
    inference's tensor parallelism calls; training's collectives go through gloo either way."""
    try:  # DeepSpeed's own table of ops it may build; another version may keep it elsewhere: then build as it would
        import deepspeed.ops
        from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

        deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False
    except (ImportError, AttributeError, TypeError):
        pass


def _zero3_unpartitioned(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    found = []
    for module in model.modules():
        declared = getattr(module, "zero3_unpartitioned_parameters", None)
        if callable(declared):
            found.extend(declared())
    return found


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
