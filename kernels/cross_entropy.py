"""Fused linear + cross-entropy over a large vocabulary, chunked over tokens.

``loss = cross_entropy(hidden @ weight.T, target)`` without ever holding the ``[T, V]`` logits:
tokens are processed in chunks of ``C`` rows.  For each chunk

1. ``logits_c = hidden_c @ weight.T`` (cuBLAS, in the input dtype: ``[C, V]``, the only large
   temporary);
2. ``_ce_chunk_kernel`` (one program per row) streams the row in ``BLOCK_V`` pieces, keeping an
   online max / sum-of-exponentials in fp32, reads the target logit, writes the row's loss, and —
   when gradients are needed — overwrites the logits in place with
   ``(softmax - onehot(target)) * row_scale`` (zero for ``ignore_index`` rows);
3. ``dhidden_c = dlogits_c @ weight`` and ``dweight += dlogits_c.T @ hidden_c`` (fp32 accumulator).

For ``reduction="mean"``/``"sum"`` the gradients are computed during the forward (the upstream
gradient is a scalar that scales them in backward, as in Liger-Kernel); for ``"none"`` the
forward only computes losses and the backward re-runs the chunks with per-row upstream gradients.
The mean divides by the number of non-ignored targets, counted on device (no host sync).

Peak extra memory: ``C x V`` logits in the input dtype plus ``V x D`` fp32 for the weight
gradient, instead of ``T x V`` fp32 logits (and their gradient) for the unfused version.

May import: torch, triton, stdlib.
"""

from __future__ import annotations

import torch

from ._runtime import HAS_TRITON, INTERPRET, next_pow2, triton_ok
from .reference import linear_cross_entropy_ref

__all__ = ["linear_cross_entropy", "default_chunk"]

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _ce_chunk_kernel(logits_ptr, target_ptr, loss_ptr, scale_ptr, V, s_l, ignore_index,
                         HAS_GRAD: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_V: tl.constexpr):
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * s_l
        tgt = tl.load(target_ptr + row).to(tl.int32)
        m = tl.full((BLOCK_V,), float("-inf"), tl.float32)
        s = tl.zeros((BLOCK_V,), tl.float32)
        xt = tl.zeros((BLOCK_V,), tl.float32)
        for v0 in range(0, V, BLOCK_V):  # pass 1: online logsumexp, lane-wise
            v = v0 + tl.arange(0, BLOCK_V)
            x = tl.load(base + v, mask=v < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, x)
            safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp(m - safe) + tl.exp(x - safe)
            m = m_new
            xt += tl.where(v == tgt, x, 0.0)
        mx = tl.max(m, 0)
        lse = mx + tl.log(tl.sum(s * tl.exp(m - mx), 0))
        ignored = tgt == ignore_index
        loss = tl.where(ignored, 0.0, lse - tl.sum(xt, 0))
        tl.store(loss_ptr + row, loss)
        if HAS_GRAD:  # pass 2: dlogits = (softmax - onehot) * scale, in place
            sc = 1.0
            if HAS_SCALE:
                sc = tl.load(scale_ptr + row).to(tl.float32)
            sc = tl.where(ignored, 0.0, sc)
            for v0 in range(0, V, BLOCK_V):
                v = v0 + tl.arange(0, BLOCK_V)
                x = tl.load(base + v, mask=v < V, other=0.0).to(tl.float32)
                g = (tl.exp(x - lse) - tl.where(v == tgt, 1.0, 0.0)) * sc
                tl.store(base + v, g.to(logits_ptr.dtype.element_ty), mask=v < V)


def default_chunk(T: int, V: int, D: int) -> int:
    """Rows per chunk: about ``T * D / V`` (so a chunk's logits are about as large as ``hidden``), a power of two."""
    if INTERPRET:
        return 16
    return max(64, min(max(T, 1), next_pow2(-(-T * D // max(V, 1)))))


def _run_chunks(hidden, weight, target, ignore_index, chunk, row_scale, need_grad):
    """Loop over row chunks; returns (loss_rows fp32 [T], dhidden or None, dweight fp32 or None)."""
    T, D = hidden.shape
    V = weight.shape[0]
    loss = torch.empty(T, device=hidden.device, dtype=torch.float32)
    dh = torch.empty_like(hidden) if need_grad else None
    dw = torch.zeros(V, D, device=hidden.device, dtype=torch.float32) if need_grad else None
    BLOCK_V = 32 if INTERPRET else min(4096, max(128, next_pow2(V)))
    for s in range(0, T, chunk):
        e = min(T, s + chunk)
        h = hidden[s:e]
        logits = h @ weight.t()  # [C, V] in the input dtype
        _ce_chunk_kernel[(e - s,)](
            logits, target[s:e], loss[s:e], row_scale[s:e] if row_scale is not None else loss, V,
            logits.stride(0), ignore_index, HAS_GRAD=need_grad, HAS_SCALE=row_scale is not None,
            BLOCK_V=BLOCK_V, num_warps=8 if BLOCK_V >= 2048 else 4,
        )
        if need_grad:
            torch.mm(logits, weight, out=dh[s:e])
            if dw.dtype == logits.dtype:
                dw.addmm_(logits.t(), h)
            else:  # bf16/fp16 product, accumulated in fp32 across chunks
                dw.add_(logits.t() @ h)
        del logits
    return loss, dh, dw


class _LinearCEFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, ignore_index, reduction, chunk):
        hidden = hidden.contiguous()
        weight = weight.contiguous()
        target = target.contiguous()
        T = hidden.shape[0]
        need = (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]) and reduction != "none"
        loss, dh, dw = _run_chunks(hidden, weight, target, ignore_index, chunk, None, need)
        n_valid = (target != ignore_index).sum().clamp_min(1).float()  # device tensor, no sync
        ctx.reduction, ctx.ignore_index, ctx.chunk = reduction, ignore_index, chunk
        if reduction == "none":
            ctx.save_for_backward(hidden, weight, target)
            return loss
        ctx.save_for_backward(dh, dw, n_valid)
        ctx.wdtype = weight.dtype
        if reduction == "sum":
            return loss.sum()
        return loss.sum() / n_valid if T else loss.sum() * float("nan")

    @staticmethod
    def backward(ctx, g):
        if ctx.reduction == "none":
            hidden, weight, target = ctx.saved_tensors
            _, dh, dw = _run_chunks(hidden, weight, target, ctx.ignore_index, ctx.chunk,
                                    g.float().contiguous(), True)
            return dh, dw.to(weight.dtype), None, None, None, None
        dh, dw, n_valid = ctx.saved_tensors
        scale = g.float() if ctx.reduction == "sum" else g.float() / n_valid
        dh_out = (dh.float() * scale).to(dh.dtype) if dh is not None else None
        dw_out = (dw * scale).to(ctx.wdtype) if dw is not None else None
        return dh_out, dw_out, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         ignore_index: int = -100, reduction: str = "mean", chunk: int | None = None) -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T, target)`` without materialising the ``[T, V]`` logits.

    hidden [T, D], weight [V, D] (same dtype), target [T] int.  Semantics:
    :func:`kernels.reference.linear_cross_entropy_ref`.  ``chunk``: rows per chunk (default
    :func:`default_chunk`).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1] or target.shape != hidden.shape[:1]:
        raise ValueError(f"linear_cross_entropy: bad shapes hidden{tuple(hidden.shape)} weight{tuple(weight.shape)} "
                         f"target{tuple(target.shape)}")
    if not triton_ok(hidden):
        return linear_cross_entropy_ref(hidden, weight, target, ignore_index, reduction)
    T, D = hidden.shape
    chunk = int(chunk) if chunk else default_chunk(T, weight.shape[0], D)
    return _LinearCEFn.apply(hidden, weight, target, int(ignore_index), reduction, chunk)
