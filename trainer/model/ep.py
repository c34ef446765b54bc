"""Expert-parallel collectives of the MoE layer: autograd-aware ``all_to_all_single`` with (un)even splits."""

from __future__ import annotations

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        x = x.contiguous()
        rows = x.shape[0] if out_splits is None else sum(out_splits)
        out = x.new_empty((rows,) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        rows = grad.shape[0] if ctx.in_splits is None else sum(ctx.in_splits)
        out = grad.new_empty((rows,) + tuple(grad.shape[1:]))
        dist.all_to_all_single(out, grad, ctx.in_splits, ctx.out_splits, group=ctx.group)
        return out, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None, group) -> torch.Tensor:
    """Differentiable all-to-all. ``None`` splits = equal chunks (no host-side sizes needed)."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """Each rank's per-expert counts [E] -> the counts every peer sends to my experts [P * E_local].

    Equal splits, so no host-side sizes are needed (sync-free).
    """
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Identity forward; multiplies the gradient by ``scale`` (expert grads: 1/ep, see parallel.dp)."""
    if scale == 1.0:
        return x
    return _ScaleGrad.apply(x, scale)
