"""Sync-free MoE token permutation: expert-sorted order, counts/offsets, gather and weighted scatter.

Given top-k expert ids ``[T, k]`` the assignments ``j = t*k + slot`` are sorted by expert, stably
(ties keep token order), without reading anything back to the host and without ``nonzero``:

1. ``_hist_kernel``: each program takes a block of ``BLOCK`` assignments and writes its per-expert
   histogram (one-hot compare against ``arange(E)``, summed over the block) to ``hist[block, E]``.
2. PyTorch, on device: ``counts = hist.sum(0)``, ``offs = cumsum(counts)``; the destination base of
   each (block, expert) is the expert's start plus the exclusive cumulative sum over earlier blocks.
3. ``_scatter_idx_kernel``: for each assignment, its rank among same-expert assignments of its block
   (a cumulative sum of the one-hot matrix) plus the base gives its permuted row ``row_map[j]``;
   ``sorted_pos[row_map[j]] = j`` is the inverse.
4. ``_gather_rows_kernel``: ``x_perm[r] = x[sorted_pos[r] // k] * scale`` row by row (coalesced
   reads and writes along D); it also serves the backward of :func:`unpermute`, where it computes
   the routing-weight gradient as a row-wise dot product.
5. ``_combine_kernel``: ``out[t] = sum_s w[t,s] * y_perm[row_map[t*k+s]]`` — a gather-reduce per
   token, so no atomics and a deterministic sum order; it is also the backward of :func:`permute`.

The same two kernels move rows between tokens and any buffer whose rows are (token, slot) copies
with a negative index marking a row or an assignment that has no counterpart: :func:`gather_rows`
builds such a buffer straight from the tokens (the capacity path's all-to-all send buffer, whose
padding rows are zeros and whose dropped assignments own no row), and :func:`unpermute` with a
``row_map`` holding -1 for dropped assignments combines the rows that came back from it (its
backward writes zeros into the padding rows). Each one's backward is the other's kernel: the
transposed gather, never an atomic scatter.

All index tensors are int32.  Expert ids should lie in ``[0, E)`` (the reference assumes so); an id
outside it is dropped memory-safely: its ``row_map`` entry is -1, it gets no permuted row, and it
contributes nothing to :func:`unpermute`.

May import: torch, triton, stdlib.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._runtime import HAS_TRITON, INTERPRET, next_pow2, triton_ok
from .reference import gather_rows_ref, permute_ref, unpermute_ref

__all__ = ["Permutation", "permute", "unpermute", "gather_rows", "route_indices"]

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _hist_kernel(ids_ptr, hist_ptr, n, E, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
        pid = tl.program_id(0)
        j = pid * BLOCK + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + j, mask=j < n, other=-1).to(tl.int32)
        e = tl.arange(0, BLOCK_E)
        onehot = (ids[:, None] == e[None, :]).to(tl.int32)
        cnt = tl.sum(onehot, 0)
        tl.store(hist_ptr + pid.to(tl.int64) * E + e, cnt, mask=e < E)

    @triton.jit
    def _scatter_idx_kernel(ids_ptr, base_ptr, row_map_ptr, sorted_pos_ptr, n, E,
                            BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
        pid = tl.program_id(0)
        j = pid * BLOCK + tl.arange(0, BLOCK)
        inb = j < n
        ids = tl.load(ids_ptr + j, mask=inb, other=-1).to(tl.int32)
        valid = inb & (ids >= 0) & (ids < E)  # out-of-range ids are dropped (row_map -1), never addressed
        e = tl.arange(0, BLOCK_E)
        onehot = (ids[:, None] == e[None, :]).to(tl.int32)
        rank = tl.sum(tl.cumsum(onehot, 0) * onehot, 1) - 1  # rank among same-expert rows of this block
        base = tl.load(base_ptr + pid.to(tl.int64) * E + ids, mask=valid, other=0)
        dest = base + rank
        tl.store(row_map_ptr + j, tl.where(valid, dest, -1), mask=inb)
        tl.store(sorted_pos_ptr + dest, j, mask=valid)

    @triton.jit
    def _gather_rows_kernel(src_ptr, idx_ptr, scale_ptr, out_ptr, dot_ptr, dot_with_ptr, nrows_ptr, R, D, k,
                            s_src, s_out, s_dw,
                            HAS_SCALE: tl.constexpr, COMPUTE_DOT: tl.constexpr, HAS_NROWS: tl.constexpr,
                            BR: tl.constexpr, BD: tl.constexpr):
        """out[r] = src[idx[r] // k] * scale[idx[r]];  dot[idx[r]] = <src[idx[r]//k], dot_with[r]>.

        A row whose index is negative (no source: padding of a capacity buffer) is zeros and contributes
        no dot product; with HAS_NROWS, so are rows r >= *nrows_ptr (= offs[-1]: rows of dropped
        assignments).
        """
        pid = tl.program_id(0)
        r = pid * BR + tl.arange(0, BR)
        rmask = r < R
        if HAS_NROWS:
            live = rmask & (r < tl.load(nrows_ptr))
        else:
            live = rmask
        j = tl.load(idx_ptr + r, mask=live, other=-1)
        live = live & (j >= 0)  # a negative index: no source row (a zero row, no dot product)
        t = (j // k).to(tl.int64)
        if HAS_SCALE:
            sc = tl.load(scale_ptr + j, mask=live, other=0.0).to(tl.float32)
        acc = tl.zeros((BR,), dtype=tl.float32)
        r64 = r.to(tl.int64)
        for d0 in range(0, D, BD):
            d = d0 + tl.arange(0, BD)
            m = rmask[:, None] & (d[None, :] < D)
            ml = live[:, None] & (d[None, :] < D)
            v = tl.load(src_ptr + t[:, None] * s_src + d[None, :], mask=ml, other=0.0).to(tl.float32)
            if COMPUTE_DOT:
                u = tl.load(dot_with_ptr + r64[:, None] * s_out + d[None, :], mask=ml, other=0.0).to(tl.float32)
                acc += tl.sum(v * u, 1)
            if HAS_SCALE:
                v = v * sc[:, None]
            tl.store(out_ptr + r64[:, None] * s_out + d[None, :], v.to(out_ptr.dtype.element_ty), mask=m)
        if COMPUTE_DOT:
            tl.store(dot_ptr + j, acc.to(dot_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def _combine_kernel(y_ptr, row_map_ptr, w_ptr, out_ptr, T, D, s_y, s_out,
                        K: tl.constexpr, HAS_W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
        """out[t] = sum_s w[t*K+s] * y[row_map[t*K+s]] (fp32 accumulation)."""
        pid_t = tl.program_id(0)
        pid_d = tl.program_id(1)
        t = pid_t * BT + tl.arange(0, BT)
        d = pid_d * BD + tl.arange(0, BD)
        tmask = t < T
        m = tmask[:, None] & (d[None, :] < D)
        acc = tl.zeros((BT, BD), dtype=tl.float32)
        for s in tl.static_range(K):
            r = tl.load(row_map_ptr + t * K + s, mask=tmask, other=-1).to(tl.int64)
            v = tl.load(y_ptr + r[:, None] * s_y + d[None, :], mask=m & (r >= 0)[:, None], other=0.0).to(tl.float32)
            if HAS_W:
                wv = tl.load(w_ptr + t * K + s, mask=tmask, other=0.0).to(tl.float32)
                v = v * wv[:, None]
            acc += v
        tl.store(out_ptr + t.to(tl.int64)[:, None] * s_out + d[None, :], acc.to(out_ptr.dtype.element_ty), mask=m)


def _blocks():
    return (32, 16, 16) if INTERPRET else (1024, 16, 128)


def route_indices(topk_ids: torch.Tensor, num_experts: int):
    """Expert-sorted order of the assignments, on device: ``(sorted_pos, row_map, counts, offs)``, int32.

    Uses the Triton kernels when they can run, else a sort-based PyTorch path (also sync-free).
    """
    T, k = topk_ids.shape
    n = T * k
    dev = topk_ids.device
    E = int(num_experts)
    if not triton_ok(topk_ids) or n == 0 or E > 4096:
        _, sp, rm, c, o = permute_ref(topk_ids.new_empty(T, 0, dtype=torch.float32), topk_ids, E)
        return sp, rm, c, o
    ids = topk_ids.reshape(-1).contiguous()
    BLOCK_E = max(16, next_pow2(E))
    # the [BLOCK, BLOCK_E] one-hot lives in registers: keep it near 16K elements per program
    BLOCK = _blocks()[0] if INTERPRET else max(32, min(1024, 16384 // BLOCK_E))
    nb = triton.cdiv(n, BLOCK)
    hist = torch.empty(nb, E, device=dev, dtype=torch.int32)
    _hist_kernel[(nb,)](ids, hist, n, E, BLOCK=BLOCK, BLOCK_E=BLOCK_E, num_warps=8)
    counts = hist.sum(0, dtype=torch.int32)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    base = (offs - counts).unsqueeze(0) + torch.cumsum(hist, 0, dtype=torch.int32) - hist
    row_map = torch.empty(n, device=dev, dtype=torch.int32)
    sorted_pos = torch.zeros(n, device=dev, dtype=torch.int32)  # rows past offs[-1] (dropped ids) -> 0
    _scatter_idx_kernel[(nb,)](ids, base.contiguous(), row_map, sorted_pos, n, E, BLOCK=BLOCK, BLOCK_E=BLOCK_E,
                                          num_warps=8)
    return sorted_pos, row_map, counts, offs


def _gather(src, idx, k, scale=None, dot_with=None, offs=None):
    """rows: out[r] = src[idx[r]//k] * scale[idx[r]]; optionally dot[idx[r]] = <src[idx[r]//k], dot_with[r]>
    (``dot`` has one entry per assignment, ``src.shape[0] * k``, also where ``idx`` has more rows: padding)."""
    R, D = idx.numel(), src.shape[1]
    out = torch.empty(R, D, device=src.device, dtype=src.dtype)
    # dropped assignments own no row, so their weight gradient is 0 unless a live row writes it
    dot = torch.zeros(src.shape[0] * k, device=src.device, dtype=torch.float32) if dot_with is not None else None
    has_n = offs is not None and offs.numel() > 0
    if R == 0:
        return out, dot
    _, BR, BD = _blocks()
    BD = min(BD, max(16, next_pow2(D)))
    src = src.contiguous()
    _gather_rows_kernel[(triton.cdiv(R, BR),)](
        src, idx, scale if scale is not None else src, out, dot if dot is not None else out,
        dot_with if dot_with is not None else out, offs[-1:] if has_n else idx, R, D, k, src.stride(0),
        out.stride(0), 1, HAS_SCALE=scale is not None, COMPUTE_DOT=dot_with is not None, HAS_NROWS=has_n,
        BR=BR, BD=BD,
    )
    return out, dot


def _combine(y, row_map, w, T, k):
    D = y.shape[1]
    out = torch.empty(T, D, device=y.device, dtype=y.dtype)
    if T == 0 or D == 0:
        return out
    _, BT, BD = _blocks()
    BD = min(BD, max(16, next_pow2(D)))
    y = y.contiguous()
    grid = (triton.cdiv(T, BT), triton.cdiv(D, BD))
    _combine_kernel[grid](y, row_map, w if w is not None else y, out, T, D, y.stride(0), out.stride(0),
                          K=k, HAS_W=w is not None, BT=BT, BD=BD)
    return out


class _PermuteFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sorted_pos, row_map, offs, k):
        ctx.save_for_backward(row_map)
        ctx.k = k
        ctx.T = x.shape[0]
        out, _ = _gather(x, sorted_pos, k, offs=offs)
        return out

    @staticmethod
    def backward(ctx, g):
        (row_map,) = ctx.saved_tensors
        return _combine(g.contiguous(), row_map, None, ctx.T, ctx.k), None, None, None, None


class _UnpermuteFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_perm, row_map, sorted_pos, offs, w):
        k = w.shape[1]
        T = w.shape[0]
        wf = w.contiguous()
        ctx.save_for_backward(y_perm, sorted_pos, wf, offs)
        return _combine(y_perm, row_map, wf, T, k)

    @staticmethod
    def backward(ctx, g):
        y_perm, sorted_pos, w, offs = ctx.saved_tensors
        k = w.shape[1]
        need_w = ctx.needs_input_grad[4]
        dy, dw = _gather(g.contiguous(), sorted_pos, k, scale=w, dot_with=y_perm.contiguous() if need_w else None,
                         offs=offs if offs.numel() else None)
        if dw is not None:
            dw = dw.view(w.shape).to(w.dtype)
        return dy, None, None, None, dw


class Permutation(NamedTuple):
    """Result of :func:`permute`.  ``offs`` feeds :func:`kernels.grouped_mm` directly."""

    x_perm: torch.Tensor  # [T*k, D], rows grouped by expert
    sorted_pos: torch.Tensor  # [T*k] int32: assignment index (t*k + slot) at each permuted row
    row_map: torch.Tensor  # [T*k] int32: permuted row of each assignment
    counts: torch.Tensor  # [E] int32
    offs: torch.Tensor  # [E] int32, cumulative END offsets


def permute(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int) -> Permutation:
    """Group each token's k copies by expert: ``x_perm[r] = x[sorted_pos[r] // k]``.  Sync-free, differentiable in x."""
    if x.dim() != 2 or topk_ids.dim() != 2 or x.shape[0] != topk_ids.shape[0]:
        raise ValueError(f"permute: expected x [T,D] and topk_ids [T,k]; got {tuple(x.shape)}, {tuple(topk_ids.shape)}")
    if not triton_ok(x):
        return Permutation(*permute_ref(x, topk_ids, num_experts))
    k = topk_ids.shape[1]
    sorted_pos, row_map, counts, offs = route_indices(topk_ids, num_experts)
    x_perm = _PermuteFn.apply(x, sorted_pos, row_map, offs, k)
    return Permutation(x_perm, sorted_pos, row_map, counts, offs)


def unpermute(y_perm: torch.Tensor, perm: Permutation | torch.Tensor, topk_weights: torch.Tensor,
              sorted_pos: torch.Tensor | None = None) -> torch.Tensor:
    """``out[t] = sum_s topk_weights[t,s] * y_perm[row_map[t*k+s]]``; differentiable in y_perm and the weights.

    ``perm`` is the :class:`Permutation` from :func:`permute` (or its ``row_map``, then pass
    ``sorted_pos`` too for the Triton backward).
    """
    offs = None
    if isinstance(perm, Permutation):
        row_map, sorted_pos, offs = perm.row_map, perm.sorted_pos, perm.offs
    else:
        row_map = perm
    if not triton_ok(y_perm) or sorted_pos is None:
        return unpermute_ref(y_perm, row_map, topk_weights)
    if offs is None:
        offs = row_map.new_empty(0)
    return _UnpermuteFn.apply(y_perm, row_map, sorted_pos, offs, topk_weights)


def gather_rows(x: torch.Tensor, src: torch.Tensor, row_map: torch.Tensor, k: int) -> torch.Tensor:
    """A buffer of token copies: ``out[b] = x[src[b] // k]``, zeros where ``src[b] < 0``; differentiable in x.

    ``src`` [R] holds the assignment index ``t*k + slot`` that each buffer row copies (-1: a padding row);
    ``row_map`` [T*k] its inverse, the buffer row of each assignment (-1: the assignment has no row, e.g. a
    dropped one). The backward is ``dx[t] = sum_s dout[row_map[t*k+s]]`` (a gather-reduce per token, no
    atomics). Index tensors int32 (int64 accepted). Sync-free.
    """
    if x.dim() != 2 or src.dim() != 1 or row_map.numel() != x.shape[0] * k:
        raise ValueError(f"gather_rows: expected x [T,D], src [R] and row_map [T*{k}]; got {tuple(x.shape)}, "
                         f"{tuple(src.shape)}, {tuple(row_map.shape)}")
    if not triton_ok(x):
        return gather_rows_ref(x, src, k)
    return _PermuteFn.apply(x, src.contiguous(), row_map.contiguous(), None, k)
