"""Cross-process helpers used by losses and evaluation: rank/world and an all-gather that keeps gradients.

Kept apart from accelerate so that losses work in any torch.distributed program, not only inside our loop.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank_and_world() -> tuple[int, int]:
    if is_distributed():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _GatherWithGrad(torch.autograd.Function):
    # Public collectives only: torch.distributed.nn.functional.all_gather is deprecated (FutureWarning in torch 2.13)
    # and its suggested replacement lives in a private module.

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, tensor)
        ctx.rows = tensor.shape[0]
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        # Every rank holds the gradient of its own loss w.r.t. the whole gathered tensor; summing them (all_reduce,
        # which every backend has, unlike reduce_scatter on gloo) and keeping this rank's rows gives each rank the
        # gradient of the sum of all ranks' losses w.r.t. its own embeddings.
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        start = dist.get_rank() * ctx.rows
        return grad[start : start + ctx.rows]


def gather_with_grad(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate `tensor` (same shape on every rank) along dim 0, in rank order, with gradients flowing back.

    The backward sums the gradient every rank computed for a slice and hands it to the rank that owns it, so a loss
    computed on the gathered batch gives each rank the gradient of the global objective with respect to its own
    embeddings.
    """
    if not is_distributed():
        return tensor
    return _GatherWithGrad.apply(tensor.contiguous())


class _AllReduceSumWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        total = tensor.contiguous().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        # Every rank's loss reads the sum; the gradient of all ranks' losses w.r.t. this rank's term is the sum of
        # their gradients w.r.t. the total (as for `gather_with_grad`, whose slices are here one shared tensor).
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        return grad


def all_reduce_with_grad(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of `tensor` (same shape on every rank) over ranks, with gradients flowing back: each rank's term gets
    the summed gradient of every rank's use of the total (a loss of a global-batch statistic, as FLOPS's mean)."""
    if not is_distributed():
        return tensor
    return _AllReduceSumWithGrad.apply(tensor)


def gather_no_grad(tensor: torch.Tensor) -> torch.Tensor:
    if not is_distributed():
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts, dim=0)
