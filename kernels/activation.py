"""Fused SwiGLU for the MoE experts: ``a = silu(gate) * up`` in one kernel, and its backward in one.

The expert MLP's first grouped GEMM writes ``h = x @ w13^T`` as ``[R, 2F]`` (gate columns ``[0, F)``,
up columns ``[F, 2F)``). Done in eager PyTorch, ``silu(g) * u`` costs two kernels forward (``silu`` on a
strided view, then ``mul``) and four backward (two ``mul``, ``silu_backward`` and the ``cat`` that puts
the two halves of the chunk's gradient back together), and keeps ``silu(g)`` alive for the backward.
Here:

- ``_swiglu_fwd_kernel``: reads ``h`` once, writes ``a [R, F]`` (fp32 math, one rounding).
- ``_swiglu_bwd_kernel``: reads ``h`` and ``da``, writes ``dh [R, 2F]`` directly in the GEMM's layout
  (``dg = da * u * s * (1 + g * (1 - s))``, ``du = da * silu(g)``, ``s = sigmoid(g)``).

Only ``h`` is saved for the backward (the eager path also saves ``silu(g)``: ``R * F`` elements more per
MoE layer). Each program takes a ``[BR, BF]`` tile of the ``[R, F]`` output; columns are contiguous in
memory, so loads and stores are vectorised; the column block is the power of two (64-256) that pads
``F`` least (DeepSeek-V2-Lite's F = 1408 = 11 x 128).

The specification is :func:`kernels.reference.swiglu_ref`; where Triton cannot run (CPU without
``TRITON_INTERPRET=1``, no triton) :func:`swiglu` computes that reference with autograd.

May import: torch, triton, stdlib.
"""

from __future__ import annotations

import torch

from ._runtime import HAS_TRITON, INTERPRET, triton_ok
from .reference import swiglu_ref

__all__ = ["swiglu", "swiglu_blocks", "swiglu_forward", "swiglu_backward"]

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rows(R, n_ptr, BOUND: tl.constexpr):
        if BOUND:  # a device-side row count (the routed rows of a padded buffer): no host sync to read it
            R = tl.minimum(R, tl.load(n_ptr).to(tl.int64))
        return R

    @triton.jit
    def _swiglu_fwd_kernel(h_ptr, a_ptr, R, F, s_h, s_a, n_ptr, BOUND: tl.constexpr, BR: tl.constexpr,
                           BF: tl.constexpr):
        R = _rows(R, n_ptr, BOUND)
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        f = tl.program_id(1) * BF + tl.arange(0, BF)
        m = (r < R)[:, None] & (f < F)[None, :]
        r64 = r.to(tl.int64)[:, None]
        gp = h_ptr + r64 * s_h + f[None, :]
        g = tl.load(gp, mask=m, other=0.0).to(tl.float32)
        u = tl.load(gp + F, mask=m, other=0.0).to(tl.float32)
        a = g / (1.0 + tl.exp(-g)) * u
        tl.store(a_ptr + r64 * s_a + f[None, :], a.to(a_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _swiglu_bwd_kernel(h_ptr, da_ptr, dh_ptr, R, F, s_h, s_da, s_dh, n_ptr, BOUND: tl.constexpr,
                           BR: tl.constexpr, BF: tl.constexpr):
        R = _rows(R, n_ptr, BOUND)
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        f = tl.program_id(1) * BF + tl.arange(0, BF)
        m = (r < R)[:, None] & (f < F)[None, :]
        r64 = r.to(tl.int64)[:, None]
        gp = h_ptr + r64 * s_h + f[None, :]
        g = tl.load(gp, mask=m, other=0.0).to(tl.float32)
        u = tl.load(gp + F, mask=m, other=0.0).to(tl.float32)
        da = tl.load(da_ptr + r64 * s_da + f[None, :], mask=m, other=0.0).to(tl.float32)
        s = 1.0 / (1.0 + tl.exp(-g))
        dg = da * u * s * (1.0 + g * (1.0 - s))
        du = da * g * s
        dp = dh_ptr + r64 * s_dh + f[None, :]
        tl.store(dp, dg.to(dh_ptr.dtype.element_ty), mask=m)
        tl.store(dp + F, du.to(dh_ptr.dtype.element_ty), mask=m)


def swiglu_blocks(F: int, interpret: bool = INTERPRET) -> tuple[int, int]:
    """(rows, columns) per program for an output of ``F`` columns: the column block is the power of two in
    64..256 that pads ``F`` least (the largest on a tie), rows fill 4,096 elements per program (32 per
    thread at 4 warps). Under the interpreter: 16 x 16, so small test shapes span several tiles."""
    if interpret:
        return 16, 16
    bf = min((256, 128, 64), key=lambda b: (-(-F // b) * b - F, -b))
    return 4096 // bf, bf


def _check(h: torch.Tensor) -> int:
    if h.dim() != 2 or h.shape[1] % 2:
        raise ValueError(f"swiglu: expected h [R, 2F] (gate columns, then up columns); got {tuple(h.shape)}")
    return h.shape[1] // 2


def _bound(n_rows: torch.Tensor | None, h: torch.Tensor) -> tuple[torch.Tensor, bool]:
    if n_rows is None:
        return h, False  # any pointer: the kernel does not read it
    if n_rows.numel() != 1 or n_rows.device != h.device or n_rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"swiglu: n_rows must be one int32/int64 element on {h.device}, got "
                         f"{tuple(n_rows.shape)} {n_rows.dtype} on {n_rows.device}")
    return n_rows, True


def swiglu_forward(h: torch.Tensor, n_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(h[:, :F]) * h[:, F:]`` with the Triton kernel (no autograd); ``h`` [R, 2F]. With ``n_rows`` (a
    device scalar), only the first ``n_rows`` rows are computed; the rest of the output is left unwritten."""
    F = _check(h)
    n_ptr, bound = _bound(n_rows, h)
    h = h if h.stride(-1) == 1 else h.contiguous()
    R = h.shape[0]
    a = torch.empty(R, F, device=h.device, dtype=h.dtype)
    if R and F:
        BR, BF = swiglu_blocks(F)
        _swiglu_fwd_kernel[(triton.cdiv(R, BR), triton.cdiv(F, BF))](h, a, R, F, h.stride(0), a.stride(0), n_ptr,
                                                                     BOUND=bound, BR=BR, BF=BF, num_warps=4)
    return a


def swiglu_backward(h: torch.Tensor, da: torch.Tensor, n_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``dh`` [R, 2F] of ``a = silu(g) * u`` given ``da`` [R, F], with the Triton kernel (``n_rows``: as in
    :func:`swiglu_forward`; rows past it are left unwritten)."""
    F = _check(h)
    n_ptr, bound = _bound(n_rows, h)
    if da.shape != (h.shape[0], F):
        raise ValueError(f"swiglu backward: da {tuple(da.shape)} does not match h {tuple(h.shape)}")
    h = h if h.stride(-1) == 1 else h.contiguous()
    da = da if da.stride(-1) == 1 else da.contiguous()
    R = h.shape[0]
    dh = torch.empty(R, 2 * F, device=h.device, dtype=h.dtype)
    if R and F:
        BR, BF = swiglu_blocks(F)
        _swiglu_bwd_kernel[(triton.cdiv(R, BR), triton.cdiv(F, BF))](h, da, dh, R, F, h.stride(0), da.stride(0),
                                                                     dh.stride(0), n_ptr, BOUND=bound, BR=BR, BF=BF,
                                                                     num_warps=4)
    return dh


class _SwiGLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, n_rows):
        ctx.save_for_backward(h, n_rows)
        ctx.bounded = n_rows is not None
        return swiglu_forward(h, n_rows)

    @staticmethod
    def backward(ctx, da):
        h, n_rows = ctx.saved_tensors
        return swiglu_backward(h, da, n_rows if ctx.bounded else None), None


def swiglu(h: torch.Tensor, n_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``a = silu(h[:, :F]) * h[:, F:]`` for ``h`` [R, 2F] (gate, then up), differentiable in ``h``.

    The Triton kernels where they can run (CUDA; CPU under the interpreter), else the reference.
    The gradient comes back as one ``[R, 2F]`` tensor, in ``h``'s layout.

    ``n_rows``: a one-element int32/int64 device tensor; with it the kernels compute only rows
    ``[0, n_rows)`` both ways (a padded expert buffer whose routed rows are known only on the device) and
    leave the rest of the output and of the gradient unwritten. The reference path computes every row.
    """
    _check(h)
    if not triton_ok(h):
        return swiglu_ref(h)
    if n_rows is not None:
        _bound(n_rows, h)
    return _SwiGLUFn.apply(h, n_rows)
