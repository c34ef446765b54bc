"""Expert-parallel gradient scaling of the routed experts' weights (the token dispatch itself: trainer/model/dispatch.py)."""

from __future__ import annotations

import torch


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
