"""Grouped GEMM for MoE experts in Triton: forward, dX and dW, with device-side offsets.

Rows of ``x`` [T, K] are grouped by expert: expert ``i`` owns rows ``offs[i-1]:offs[i]``
(``offs`` int32 [E], cumulative END offsets, ``offs[-1] <= T``; rows past ``offs[-1]`` belong to
no expert).  Three kernels:

- ``_gmm_fwd_kernel``: ``out[rows_i] = x[rows_i] @ w[i]`` (also dX: ``dY[rows_i] @ w[i]^T``, the same
  kernel reading ``w`` through transposed strides).  The launch grid is an upper bound on the
  number of row tiles, ``cdiv(T, BM) + E``, times the column tiles; each program finds its expert
  from ``offs`` in registers (a cumulative sum of per-expert tile counts), so nothing is read back
  to the host.  Programs past the last tile exit; the rows past ``offs[-1]`` are written as zeros
  by a virtual "tail" group, so the output can be allocated with ``torch.empty``.
- ``_gmm_dw_kernel``: ``dW[i] = x[rows_i]^T @ dY[rows_i]``, one program per (expert, K tile,
  N tile), looping over that expert's rows (a data-dependent trip count); empty experts get zeros.

Every load goes through a block pointer whose shape is the expert's own row range, so the tile
boundary at each group's edge is handled by ``boundary_check`` (zero padding) rather than by
reading neighbours.  Accumulation is fp32; bf16/fp16 products use tensor cores (wgmma on sm_90),
fp32 inputs use IEEE fp32 products so that results match the reference.

May import: torch, triton, stdlib.
"""

from __future__ import annotations

import os

import torch

from ._runtime import HAS_TRITON, INTERPRET, m_bucket, next_pow2

__all__ = ["grouped_mm_triton", "grouped_mm_dx_triton", "grouped_mm_dw_triton", "grouped_mm_tma", "grouped_mm_dx_tma",
           "tma_ok", "check_operands"]

if HAS_TRITON:
    import triton
    import triton.language as tl

    def _fwd_configs():
        if INTERPRET:  # the interpreter runs every config: keep one, small
            return [triton.Config({"BM": 16, "BN": 16, "BK": 16}, num_warps=1, num_stages=1)]
        cfg = []
        for bm, bn, bk, w, s in [
            (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4), (128, 128, 128, 8, 3),
            (64, 256, 64, 8, 4), (128, 64, 64, 4, 4), (64, 64, 64, 4, 4),
        ]:
            cfg.append(triton.Config({"BM": bm, "BN": bn, "BK": bk}, num_warps=w, num_stages=s))
        return cfg

    def _dw_configs():
        if INTERPRET:
            return [triton.Config({"BM": 16, "BN": 16, "BK": 16, "GROUP_K": 8}, num_warps=1, num_stages=1)]
        # GROUP_K: banded (8) or plain (1) order of the output tiles; which wins depends on the shape
        # (H100: 8 is 1.5x faster on Mixtral's 4096 x 28672 experts, 1 is ~10% faster on DeepSeek-V2-Lite's)
        cfg = []
        for bm, bn, bk, w, s in [
            (64, 128, 128, 8, 4), (64, 128, 64, 4, 4), (128, 128, 128, 8, 3), (64, 256, 128, 8, 3),
            (64, 64, 64, 4, 4), (32, 128, 128, 4, 4),
        ]:
            for gk in (1, 8):
                cfg.append(triton.Config({"BM": bm, "BN": bn, "BK": bk, "GROUP_K": gk}, num_warps=w, num_stages=s))
        return cfg

    @triton.jit
    def _dot_acc(a, b, acc, UPCAST: tl.constexpr, IEEE: tl.constexpr):
        """acc += a @ b in fp32. UPCAST: the interpreter's dot cannot multiply bf16 (it sees raw bits);
        IEEE: full-precision fp32 products (tests), else the tensor cores' default (tf32 for fp32)."""
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        return acc

    @triton.jit
    def _swizzle(local, m_tiles, n_tiles, GROUP: tl.constexpr):
        """(row tile, column tile) of the ``local``-th program over an m_tiles x n_tiles grid, in bands of
        GROUP row tiles walked row-fastest: one wave of programs shares a few column tiles (of the
        weight) across GROUP row tiles, so a wide weight is read about once per band from L2 instead of
        once per row tile from HBM (the classic grouped ordering of Triton's matmul tutorial)."""
        width = GROUP * n_tiles
        first = (local // width) * GROUP
        size = tl.maximum(tl.minimum(m_tiles - first, GROUP), 1)
        return first + (local % width) % size, (local % width) // size

    @triton.jit
    def _group_tile(offs_ptr, pid, T, N, E, BLOCK_E: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    GROUP: tl.constexpr):
        """The output tile of program ``pid`` in a grouped GEMM over row groups given by device offsets:
        (column tile, group g, first row, rows left in the group from there). Each group owns
        ceil(rows / BM) x ceil(N / BN) programs, in group order, swizzled within the group (_swizzle);
        group E is the tail [offs[E-1], T), written as zeros; g > E: no work.
        Offsets are clamped to T, so bad offsets never address past x."""
        n_tiles = tl.cdiv(N, BN)
        e = tl.arange(0, BLOCK_E)
        ends = tl.load(offs_ptr + e, mask=e < E, other=0).to(tl.int32)
        ends = tl.minimum(tl.where(e < E, ends, T), T)
        prev = tl.load(offs_ptr + e - 1, mask=(e > 0) & (e <= E), other=0).to(tl.int32)
        starts = tl.minimum(tl.where(e <= E, prev, T), T)
        sizes = tl.maximum(ends - starts, 0)
        tiles = (sizes + BM - 1) // BM
        progs = tiles * n_tiles
        cum = tl.cumsum(progs, 0)
        g = tl.sum((cum <= pid).to(tl.int32), 0)
        sel = e == g
        m_tiles = tl.sum(tl.where(sel, tiles, 0), 0)
        local = pid - tl.sum(tl.where(sel, cum - progs, 0), 0)
        pid_m, pid_n = _swizzle(local, m_tiles, n_tiles, GROUP)
        row0 = tl.sum(tl.where(sel, starts, 0), 0) + pid_m * BM
        rows = tl.sum(tl.where(sel, ends, 0), 0) - row0
        return pid_n, g, row0, rows

    @triton.autotune(configs=_fwd_configs(), key=["M_BUCKET", "N", "K", "E"])
    @triton.jit
    def _gmm_fwd_kernel(
        x_ptr, w_ptr, out_ptr, offs_ptr,
        T, N, K, E, M_BUCKET,
        sxm, sxk, swe, swk, swn, som, son,
        BLOCK_E: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, W_KMAJOR: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        pid_n, g, row0, rows = _group_tile(offs_ptr, tl.program_id(0), T, N, E, BLOCK_E, BM, BN, GROUP_M)
        if g <= E:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            if g < E:
                x_blk = tl.make_block_ptr(x_ptr + row0.to(tl.int64) * sxm, shape=(rows, K), strides=(sxm, sxk),
                                          offsets=(0, 0), block_shape=(BM, BK), order=(1, 0))
                if W_KMAJOR:  # e.g. nn.Linear weights [E, N, K] seen transposed: K is the contiguous dim
                    w_blk = tl.make_block_ptr(w_ptr + g.to(tl.int64) * swe, shape=(K, N), strides=(swk, swn),
                                              offsets=(0, pid_n * BN), block_shape=(BK, BN), order=(0, 1))
                else:
                    w_blk = tl.make_block_ptr(w_ptr + g.to(tl.int64) * swe, shape=(K, N), strides=(swk, swn),
                                              offsets=(0, pid_n * BN), block_shape=(BK, BN), order=(1, 0))
                for _ in range(0, tl.cdiv(K, BK)):
                    a = tl.load(x_blk, boundary_check=(0, 1), padding_option="zero")
                    b = tl.load(w_blk, boundary_check=(0, 1), padding_option="zero")
                    acc = _dot_acc(a, b, acc, UPCAST, IEEE)
                    x_blk = tl.advance(x_blk, (0, BK))
                    w_blk = tl.advance(w_blk, (BK, 0))
            o_blk = tl.make_block_ptr(out_ptr + row0.to(tl.int64) * som, shape=(rows, N), strides=(som, son),
                                      offsets=(0, pid_n * BN), block_shape=(BM, BN), order=(1, 0))
            tl.store(o_blk, acc.to(out_ptr.dtype.element_ty), boundary_check=(0, 1))

    @triton.autotune(configs=_dw_configs(), key=["M_BUCKET", "N", "K", "E"])
    @triton.jit
    def _gmm_dw_kernel(
        x_ptr, dy_ptr, dw_ptr, offs_ptr,
        T, K, N, E, M_BUCKET,
        sxm, sxk, sdm, sdn, swe, swk, swn,
        IEEE: tl.constexpr, UPCAST: tl.constexpr, DW_KMAJOR: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_K: tl.constexpr,
    ):
        g = tl.program_id(1)
        pid_k, pid_n = _swizzle(tl.program_id(0), tl.cdiv(K, BK), tl.cdiv(N, BN), GROUP_K)
        end = tl.minimum(tl.load(offs_ptr + g).to(tl.int32), T)
        start = tl.minimum(tl.load(offs_ptr + g - 1, mask=g > 0, other=0).to(tl.int32), T)
        rows = tl.maximum(end - start, 0)
        xt_blk = tl.make_block_ptr(x_ptr + start.to(tl.int64) * sxm, shape=(K, rows), strides=(sxk, sxm),
                                   offsets=(pid_k * BK, 0), block_shape=(BK, BM), order=(0, 1))
        dy_blk = tl.make_block_ptr(dy_ptr + start.to(tl.int64) * sdm, shape=(rows, N), strides=(sdm, sdn),
                                   offsets=(0, pid_n * BN), block_shape=(BM, BN), order=(1, 0))
        acc = tl.zeros((BK, BN), dtype=tl.float32)
        for _ in range(0, tl.cdiv(rows, BM)):
            a = tl.load(xt_blk, boundary_check=(0, 1), padding_option="zero")
            b = tl.load(dy_blk, boundary_check=(0, 1), padding_option="zero")
            acc = _dot_acc(a, b, acc, UPCAST, IEEE)
            xt_blk = tl.advance(xt_blk, (0, BM))
            dy_blk = tl.advance(dy_blk, (BM, 0))
        if DW_KMAJOR:
            o_blk = tl.make_block_ptr(dw_ptr + g.to(tl.int64) * swe, shape=(K, N), strides=(swk, swn),
                                      offsets=(pid_k * BK, pid_n * BN), block_shape=(BK, BN), order=(0, 1))
        else:
            o_blk = tl.make_block_ptr(dw_ptr + g.to(tl.int64) * swe, shape=(K, N), strides=(swk, swn),
                                      offsets=(pid_k * BK, pid_n * BN), block_shape=(BK, BN), order=(1, 0))
        tl.store(o_blk, acc.to(dw_ptr.dtype.element_ty), boundary_check=(0, 1))


    # ------------------------------------------------------------------ TMA variant (sm_90+), forward / dX
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor

        HAS_TMA = True
    except Exception:  # older triton
        TensorDescriptor = None  # type: ignore[assignment]
        HAS_TMA = False

    def _tma_block_hook(nargs):
        bm, bn, bk = nargs["BM"], nargs["BN"], nargs["BK"]
        nargs["x_desc"].block_shape = [bm, bk]
        nargs["w_desc"].block_shape = [1, bn, bk] if nargs["W_KMAJOR"] else [1, bk, bn]

    def _tma_configs():
        if INTERPRET:
            return [triton.Config({"BM": 16, "BN": 16, "BK": 16}, num_warps=1, num_stages=1,
                                  pre_hook=_tma_block_hook)]
        return [triton.Config({"BM": bm, "BN": bn, "BK": bk}, num_warps=w, num_stages=st, pre_hook=_tma_block_hook)
                for bm, bn, bk, w, st in [(128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4),
                                          (128, 128, 128, 8, 3), (64, 256, 64, 8, 4)]]

    @triton.autotune(configs=_tma_configs(), key=["M_BUCKET", "N", "K", "E"])
    @triton.jit
    def _gmm_fwd_tma_kernel(
        x_desc, w_desc, out_ptr, offs_ptr,
        T, N, K, E, M_BUCKET, som, son,
        BLOCK_E: tl.constexpr, UPCAST: tl.constexpr, W_KMAJOR: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        """As _gmm_fwd_kernel, with x and w tiles fetched by TMA (host tensor descriptors).

        x rows past the group's end are fetched too (they belong to the next group) but only feed
        output rows that this program does not store; w is a 3-D descriptor, exact per expert.
        """
        pid_n, g, row0, rows = _group_tile(offs_ptr, tl.program_id(0), T, N, E, BLOCK_E, BM, BN, GROUP_M)
        if g <= E:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            if g < E:
                for k in range(0, tl.cdiv(K, BK)):
                    a = x_desc.load([row0, k * BK])
                    if W_KMAJOR:
                        b = w_desc.load([g, pid_n * BN, k * BK]).reshape(BN, BK).T
                    else:
                        b = w_desc.load([g, k * BK, pid_n * BN]).reshape(BK, BN)
                    acc = _dot_acc(a, b, acc, UPCAST, False)
            o_blk = tl.make_block_ptr(out_ptr + row0.to(tl.int64) * som, shape=(rows, N), strides=(som, son),
                                      offsets=(0, pid_n * BN), block_shape=(BM, BN), order=(1, 0))
            tl.store(o_blk, acc.to(out_ptr.dtype.element_ty), boundary_check=(0, 1))
else:
    HAS_TMA = False


# Row tiles per band of the forward/dX kernels' swizzled program order (see _swizzle); 1 = plain order.
# TRACELENS_GMM_SWIZZLE=1 restores it (A/B timing in benchmarks/bench_kernels.py). The dW kernel tunes
# its own band (GROUP_K in its configs); this value is only its band under the interpreter.
SWIZZLE = max(1, int(os.environ.get("TRACELENS_GMM_SWIZZLE", "8") or 8))


def check_operands(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> None:
    """Raise ValueError/TypeError (naming the shapes or dtypes) unless x [T,K], w [E,K,N], offs [E] fit."""
    if x.dim() != 2 or w.dim() != 3 or offs.dim() != 1:
        raise ValueError(f"grouped_mm: expected x [T,K], w [E,K,N], offs [E]; got {tuple(x.shape)}, "
                         f"{tuple(w.shape)}, {tuple(offs.shape)}")
    if w.shape[0] != offs.shape[0] or x.shape[1] != w.shape[1]:
        raise ValueError(f"grouped_mm: shape mismatch x{tuple(x.shape)} w{tuple(w.shape)} offs{tuple(offs.shape)}")
    if offs.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"grouped_mm: offs must be int32, got {offs.dtype}")
    if x.dtype != w.dtype:
        raise TypeError(f"grouped_mm: x and w dtypes differ ({x.dtype} vs {w.dtype})")


def _launch(kernel, grid, T: int, N: int, K: int, **interpreter_meta):
    """``kernel[grid]`` (autotuned) on a GPU.  Under the interpreter, the plain kernel with one block
    size chosen from the shape: 16 per dimension (what the tests' small shapes exercise, several
    tiles each), 32 where a dimension is large (T >= 128, N >= 64, K >= 64), so that a model-sized
    call runs several times fewer interpreted programs and loop iterations; ``interpreter_meta``: the
    other tuned meta-parameters' values there (on a GPU the autotuner supplies them)."""
    if not INTERPRET:
        return kernel[grid]
    blocks = {"BM": 32 if T >= 128 else 16, "BN": 32 if N >= 64 else 16, "BK": 32 if K >= 64 else 16,
              **interpreter_meta}
    launch = kernel.fn[grid]
    return lambda *args, **kwargs: launch(*args, **kwargs, **blocks)


def _kmajor(w: torch.Tensor) -> bool:
    """Whether an [E, K, N] tensor is laid out with K contiguous (N-major tiles would stride)."""
    return w.stride(1) == 1 and w.stride(2) != 1


def _rows_setup(x: torch.Tensor, w_kn: torch.Tensor):
    """(T, K, E, N, out, done) of a row-grouped GEMM; ``done``: ``out`` is already the answer (no rows or
    columns: empty; no experts or K == 0: zeros), no kernel to launch."""
    T, K = x.shape
    E, _, N = w_kn.shape
    out = torch.empty(T, N, device=x.device, dtype=x.dtype)
    if T == 0 or N == 0:
        return T, K, E, N, out, True
    if E == 0 or K == 0:
        return T, K, E, N, out.zero_(), True
    return T, K, E, N, out, False


def _rows_grid(T: int, E: int, N: int):
    """Programs of the row-grouped kernels: an upper bound on the groups' row tiles (each group may end
    in a partial tile, plus the tail group) times the column tiles; programs past the work exit."""
    return lambda meta: ((triton.cdiv(T, meta["BM"]) + E) * triton.cdiv(N, meta["BN"]),)


def _gmm_rows(x: torch.Tensor, w_kn: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``out[rows_i] = x[rows_i] @ w_kn[i]`` where ``w_kn`` is any strided [E, K, N] view."""
    T, K, E, N, out, done = _rows_setup(x, w_kn)
    if done:
        return out
    grid = _rows_grid(T, E, N)
    _launch(_gmm_fwd_kernel, grid, T, N, K)(
        x, w_kn, out, offs, T, N, K, E, m_bucket(T),
        x.stride(0), x.stride(1), w_kn.stride(0), w_kn.stride(1), w_kn.stride(2), out.stride(0), out.stride(1),
        BLOCK_E=next_pow2(E + 1), IEEE=x.dtype == torch.float32, UPCAST=INTERPRET, W_KMAJOR=_kmajor(w_kn), GROUP_M=SWIZZLE,
    )
    return out


def tma_ok(x: torch.Tensor, w_kn: torch.Tensor) -> bool:
    """Whether the TMA kernel can take these operands: sm_90+ (or the interpreter), 16-bit dtypes,
    a contiguous last dimension for x and for w's storage, 16-byte aligned strides and bases."""
    if not (HAS_TRITON and HAS_TMA) or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if x.device.type == "cuda":
        if torch.cuda.get_device_capability(x.device) < (9, 0):
            return False
    elif not INTERPRET:
        return False
    w_store = w_kn.transpose(1, 2) if _kmajor(w_kn) else w_kn
    es = x.element_size()
    return (x.stride(1) == 1 and w_store.stride(2) == 1 and (x.stride(0) * es) % 16 == 0
            and all((st * es) % 16 == 0 for st in w_store.stride()[:2])
            and x.data_ptr() % 16 == 0 and w_store.data_ptr() % 16 == 0)


def _gmm_rows_tma(x: torch.Tensor, w_kn: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    T, K, E, N, out, done = _rows_setup(x, w_kn)
    if done:
        return out
    kmajor = _kmajor(w_kn)
    w_store = w_kn.transpose(1, 2) if kmajor else w_kn
    dummy = [16, 16]  # replaced by the autotune pre-hook with the config's block shape
    x_desc = TensorDescriptor(x, list(x.shape), list(x.stride()), dummy)
    w_desc = TensorDescriptor(w_store, list(w_store.shape), list(w_store.stride()), [1] + dummy)
    grid = _rows_grid(T, E, N)
    _gmm_fwd_tma_kernel[grid](
        x_desc, w_desc, out, offs, T, N, K, E, m_bucket(T), out.stride(0), out.stride(1),
        BLOCK_E=next_pow2(E + 1), UPCAST=INTERPRET, W_KMAJOR=kmajor, GROUP_M=SWIZZLE,
    )
    return out


def grouped_mm_tma(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Forward with TMA tile loads where :func:`tma_ok`, else the block-pointer kernel."""
    check_operands(x, w, offs)
    return _gmm_rows_tma(x, w, offs) if tma_ok(x, w) else _gmm_rows(x, w, offs)


def grouped_mm_dx_tma(dy: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """dX with TMA tile loads where :func:`tma_ok`, else the block-pointer kernel."""
    wt = w.transpose(1, 2)
    return _gmm_rows_tma(dy, wt, offs) if tma_ok(dy, wt) else _gmm_rows(dy, wt, offs)


def grouped_mm_triton(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Forward: ``out[offs[i-1]:offs[i]] = x[...] @ w[i]``; rows past ``offs[-1]`` are zero."""
    check_operands(x, w, offs)
    return _gmm_rows(x, w, offs)


def grouped_mm_dx_triton(dy: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """dX: ``dx[rows_i] = dy[rows_i] @ w[i]^T`` (w [E,K,N] read transposed, no copy)."""
    return _gmm_rows(dy, w.transpose(1, 2), offs)


def grouped_mm_dw_triton(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """dW: ``dw[i] = x[rows_i]^T @ dy[rows_i]`` -> [E, K, N]; experts without rows get zeros.

    ``out``: an [E, K, N] tensor to write into, with any strides (e.g. ``torch.empty_like(w)``, so
    the gradient of a transposed weight view comes out in the weight's own layout).
    """
    T, K = x.shape
    N = dy.shape[1]
    E = offs.shape[0]
    dw = torch.empty(E, K, N, device=x.device, dtype=x.dtype) if out is None else out
    if tuple(dw.shape) != (E, K, N):
        raise ValueError(f"grouped_mm_dw: out has shape {tuple(dw.shape)}, expected {(E, K, N)}")
    if E == 0 or K == 0 or N == 0:
        return dw
    grid = lambda meta: (triton.cdiv(K, meta["BK"]) * triton.cdiv(N, meta["BN"]), E)  # noqa: E731
    _launch(_gmm_dw_kernel, grid, T, N, K, GROUP_K=SWIZZLE)(
        x, dy, dw, offs, T, K, N, E, m_bucket(max(T // max(E, 1), 1)),
        x.stride(0), x.stride(1), dy.stride(0), dy.stride(1), dw.stride(0), dw.stride(1), dw.stride(2),
        IEEE=x.dtype == torch.float32, UPCAST=INTERPRET, DW_KMAJOR=_kmajor(dw),
    )
    return dw
