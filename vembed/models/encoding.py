"""Embedding many sides in batches: what `vembed.load(...).encode`, export checks and evaluation all run.

It belongs to the model side (evaluation, the public API and export use it; it uses only the adapter), so the API and
export need nothing of `vembed.evaluation`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from accelerate import Accelerator

    from vembed.data.records import Side
    from vembed.models.base import EmbeddingAdapter


def unwrapped(adapter: "EmbeddingAdapter", accelerator: "Accelerator | None") -> "EmbeddingAdapter":
    # accelerate's unwrap_model imports deepspeed whenever it is installed (seconds at start-up); a plain adapter
    # needs no unwrapping.
    from vembed.models.base import EmbeddingAdapter

    if accelerator is None or isinstance(adapter, EmbeddingAdapter):
        return adapter
    return accelerator.unwrap_model(adapter)


def _device_of(module: torch.nn.Module) -> torch.device:
    param = next(module.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def length_order(adapter: "EmbeddingAdapter", sides: Sequence["Side"]) -> list[int] | None:
    """The order to encode `sides` in: longest text first, so each batch pads only to lengths like its own (in file
    order a real corpus padded to 2.26x the token positions, issue 22); None to keep their order. Only adapters whose
    output padding columns do not change (`length_chunking`) are reordered, so every embedding is the one file order
    gives. Characters stand in for tokens, as in sentence-transformers' encode: nothing is tokenised twice."""
    if not getattr(adapter, "length_chunking", False) or len(sides) < 2:
        return None
    return sorted(range(len(sides)), key=lambda i: -len(sides[i].text or ""))


def share_bounds(n: int, process_index: int, num_processes: int) -> tuple[int, int]:
    """The contiguous rows `[start, stop)` of `n` that process `process_index` encodes (the last share may be short)."""
    per = math.ceil(n / num_processes) if n else 0
    start = min(process_index * per, n)
    return start, min(start + per, n)


@torch.no_grad()
def encode_sides(
    adapter: "EmbeddingAdapter",
    sides: Sequence["Side"],
    *,
    batch_size: int = 64,
    accelerator: "Accelerator | None" = None,
    show_progress: bool = False,
    desc: str = "encoding",
    forward: "Callable[[dict[str, Any]], torch.Tensor] | None" = None,
    gather: bool = True,
) -> torch.Tensor:
    """Embed `sides` in batches, in eval mode (the previous mode is restored), returning `(len(sides), dim)` float32.
    Batches are cut from the sides sorted by length (`length_order`); rows come back in the sides' order.

    With an `accelerator`, each process encodes a contiguous share and the shares are gathered, so every process
    returns the same full tensor. Every process runs the same number of forward passes (short shares are padded with
    a repeated side), which sharded models (FSDP, ZeRO-3) need. `adapter` may be the model `accelerator.prepare`
    returned: batches go through its forward (the adapter's `encode`), preprocessing through the unwrapped adapter.
    `forward` embeds a preprocessed batch instead of `adapter`: the training loop passes one through the prepared
    model (`ContrastiveObjective.forward(encode=...)`), so that a sharded model gathers its weights as in training.
    `gather=False`: each process returns only its own share, rows `share_bounds(len(sides), ...)` (corpus search
    scores its share where it was encoded instead of holding the whole corpus on every process).
    """
    from vembed.models.token_vectors import cat_tokens

    core = unwrapped(adapter, accelerator)
    n = len(sides)
    if accelerator is not None and accelerator.num_processes > 1:
        start, stop = share_bounds(n, accelerator.process_index, accelerator.num_processes)
        per = math.ceil(n / accelerator.num_processes) if n else 0
        mine = list(sides[start:stop])
        local = mine + [sides[-1]] * (per - len(mine)) if n else []
        device = accelerator.device
        show_progress = show_progress and accelerator.is_main_process
    else:
        local, device = list(sides), _device_of(core)

    order = length_order(core, local)
    if order is not None:
        local = [local[i] for i in order]
    was_training = adapter.training
    adapter.eval()
    try:
        starts = range(0, len(local), batch_size)
        if show_progress:
            from tqdm.auto import tqdm

            starts = tqdm(starts, desc=desc, unit="batch", leave=False)  # transient: training's bar stays readable
        parts = []
        for start in starts:
            inputs = core.preprocess(local[start : start + batch_size])
            inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
            parts.append((forward or adapter)(inputs).float())
    finally:
        adapter.train(was_training)
    dim = core.embedding_dim
    # token vectors (multi_vector) of different lengths are padded to the longest batch's
    embeddings = cat_tokens(parts) if parts else torch.empty(0, dim, device=device)
    if order is not None:  # back to the sides' order
        from vembed.models.length_chunks import in_batch_order

        embeddings = in_batch_order(embeddings, torch.tensor(order, device=embeddings.device))
    if accelerator is not None and accelerator.num_processes > 1:
        if not gather:
            return embeddings[: len(mine)]
        # Plain gather, not gather_for_metrics: the latter trims by the remainder of whichever prepared dataloader is
        # at its end (the training one, when evaluating at the end of an epoch), which is not ours.
        if embeddings.dim() == 3:  # token vectors: each share padded to its own longest side; gather needs one length
            embeddings = accelerator.pad_across_processes(embeddings, dim=1)  # zero vectors: the padding contract
        embeddings = accelerator.gather(embeddings.contiguous())[:n]
    return embeddings
