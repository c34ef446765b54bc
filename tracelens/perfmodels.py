"""Performance models: FLOPs and minimum bytes of an op from the shapes the profiler recorded.

`MODELS` is the one table of op name -> model. A model receives the op's parsed `Input Dims`,
`Input type` and `Concrete Inputs` (all lists, one entry per argument) and returns a `Perf`, or raises
`Unmodeled` with a reason. `model(name, dims, types, concrete)` is the entry point; it never raises.
Ops not in the table are *unmodeled* and never guessed.

Conventions (docs/roofline.md):
- GEMM FLOPs are 2*M*N*K multiply-adds (bias epilogues, alpha/beta are not counted as FLOPs but the
  bias is read); minimum bytes = each input read once + the output written once.
- Attention FLOPs count the two matmuls (QK^T, PV) over the attended (query, key) pairs: causal
  (top-left aligned, as torch's is_causal) counts only pairs with key <= query. Backward = the
  recomputed QK^T plus four matmuls: 2 * pairs * (3*D + 2*Dv) (2.5x forward when D == Dv).
- Elementwise/norm/softmax/reduction FLOPs are small per-element constants (below); these ops are
  memory-bound, their bytes are what matters.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Sequence

# bytes per element of the dtype names Kineto writes in "Input type"
DTYPE_SIZES: dict[str, int] = {
    "c10::BFloat16": 2, "c10::Half": 2, "float": 4, "double": 8, "long int": 8, "long": 8, "int": 4,
    "short int": 2, "short": 2, "signed char": 1, "unsigned char": 1, "bool": 1, "unsigned int": 4,
    "unsigned long": 8, "unsigned short": 2, "c10::complex<float>": 8, "c10::complex<double>": 16,
    "c10::complex<c10::Half>": 4, "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1, "c10::Float8_e4m3fnuz": 1,
    "c10::Float8_e5m2fnuz": 1, "c10::Float8_e8m0fnu": 1, "c10::Float4_e2m1fn_x2": 1,
}
DTYPE_CLASS: dict[str, str] = {
    "c10::BFloat16": "bf16", "c10::Half": "fp16", "float": "fp32", "double": "fp64",
    "c10::Float8_e4m3fn": "fp8", "c10::Float8_e5m2": "fp8", "c10::Float8_e4m3fnuz": "fp8",
    "c10::Float8_e5m2fnuz": "fp8", "c10::complex<float>": "fp32", "c10::complex<double>": "fp64",
}
# torch ScalarType codes (as Concrete Inputs record a dtype argument) -> bytes
SCALAR_TYPE_SIZES = {0: 1, 1: 1, 2: 2, 3: 4, 4: 8, 5: 2, 6: 4, 7: 8, 11: 1, 15: 2, 23: 1, 24: 1, 25: 1, 26: 1}


class Unmodeled(Exception):
    """The op has a model but its recorded arguments do not allow it (the message is the reason)."""


@dataclass(frozen=True)
class Perf:
    flops: float
    bytes: float
    dtype: str  # dtype class of the compute: bf16, fp16, fp8, fp32, fp64, int
    kind: str  # gemm, grouped_gemm, attention, elementwise, norm, softmax, reduction, loss, embedding, index, copy
    matrix: bool = False  # runs on tensor cores / MFMA (GEMM, attention): bounded by the matrix peak
    mnk: tuple[int, int, int] | None = None  # GEMM (M, N, K) without batch, for shape families
    batch: int = 1
    note: str = ""


@dataclass(frozen=True)
class Result:
    perf: Perf | None
    reason: str | None = None  # set when perf is None


# ------------------------------------------------------------------------------------ arguments


@dataclass
class Args:
    dims: list
    types: list
    concrete: list = field(default_factory=list)
    strides: list = field(default_factory=list)

    def is_tensor(self, i: int) -> bool:
        return (i < len(self.types) and self.types[i] in DTYPE_SIZES and i < len(self.dims)
                and isinstance(self.dims[i], list) and all(isinstance(d, int) and d >= 0 for d in self.dims[i]))

    def tensor(self, i: int, what: str = "") -> tuple[list[int], int, int]:
        """(shape, itemsize) of argument i, or Unmodeled."""
        if not self.is_tensor(i):
            raise Unmodeled(f"argument {i}{' (' + what + ')' if what else ''} is not a recorded tensor")
        return self.dims[i], DTYPE_SIZES[self.types[i]], self.unique_elems(i)

    def unique_elems(self, i: int) -> int:
        """Distinct elements of argument i: broadcast (stride-0) dimensions, as in expand(), count once."""
        shape = self.dims[i]
        st = self.strides[i] if i < len(self.strides) else None
        if isinstance(st, list) and len(st) == len(shape) and all(isinstance(v, int) for v in st):
            return numel([d for d, s in zip(shape, st) if s != 0])
        return numel(shape)

    def opt_tensor(self, i: int) -> tuple[list[int], int] | None:
        return self.tensor(i) if self.is_tensor(i) else None

    def dtype(self, i: int) -> str:
        t = self.types[i] if i < len(self.types) else ""
        return DTYPE_CLASS.get(t, "int" if t in DTYPE_SIZES else "?")

    def const(self, i: int) -> str:
        v = self.concrete[i] if i < len(self.concrete) else ""
        return v if isinstance(v, str) else json.dumps(v)

    def flag(self, i: int, what: str) -> bool:
        v = self.const(i).strip()
        if v in ("True", "true", "1"):
            return True
        if v in ("False", "false", "0"):
            return False
        raise Unmodeled(f"{what} (argument {i}) not recorded in Concrete Inputs")

    def int_const(self, i: int, what: str) -> int:
        try:
            return int(float(self.const(i)))
        except ValueError:
            raise Unmodeled(f"{what} (argument {i}) not recorded in Concrete Inputs") from None

    def tensors(self) -> list[tuple[list[int], int]]:
        return [self.tensor(i) for i in range(len(self.types)) if self.is_tensor(i)]


def numel(shape: Sequence[int]) -> int:
    return int(math.prod(shape)) if shape else 1


def nbytes(t: tuple | None) -> int:
    """Bytes read for a tensor argument (shape, itemsize, distinct elements): stride-0 dims count once."""
    if t is None:
        return 0
    return (t[2] if len(t) > 2 else numel(t[0])) * t[1]


def broadcast(*shapes: Sequence[int]) -> list[int]:
    nd = max((len(s) for s in shapes), default=0)
    out = []
    for i in range(nd):
        ds = {s[len(s) - nd + i] for s in shapes if len(s) - nd + i >= 0}
        ds.discard(1)
        if len(ds) > 1:
            raise Unmodeled(f"shapes {list(map(list, shapes))} do not broadcast")
        out.append(ds.pop() if ds else 1)
    return out


# ------------------------------------------------------------------------------------ GEMM family


def _gemm(m: int, n: int, k: int, batch: int, a, b, out_elems: int, out_size: int, extra_bytes: int, dt: str,
          kind: str = "gemm", note: str = "") -> Perf:
    return Perf(flops=2.0 * batch * m * n * k, bytes=float(nbytes(a) + nbytes(b) + out_elems * out_size + extra_bytes),
                dtype=dt, kind=kind, matrix=True, mnk=(m, n, k), batch=batch, note=note)


def _mm2(a, b, what: str) -> tuple[int, int, int]:
    if len(a[0]) != 2 or len(b[0]) != 2:
        raise Unmodeled(f"{what}: expected 2-D operands, got {a[0]} and {b[0]}")
    (m, k), (k2, n) = a[0], b[0]
    if k != k2:
        raise Unmodeled(f"{what}: inner dimensions differ ({a[0]} x {b[0]})")
    return m, n, k


def m_mm(x: Args) -> Perf:  # mm(self [M,K], mat2 [K,N])
    a, b = x.tensor(0, "self"), x.tensor(1, "mat2")
    m, n, k = _mm2(a, b, "mm")
    return _gemm(m, n, k, 1, a, b, m * n, a[1], 0, x.dtype(0))


def m_addmm(x: Args) -> Perf:  # addmm(bias, mat1 [M,K], mat2 [K,N], beta, alpha)
    bias, a, b = x.opt_tensor(0), x.tensor(1, "mat1"), x.tensor(2, "mat2")
    m, n, k = _mm2(a, b, "addmm")
    return _gemm(m, n, k, 1, a, b, m * n, a[1], nbytes(bias), x.dtype(1))


def _bmm3(a, b, what: str) -> tuple[int, int, int, int]:
    if len(a[0]) != 3 or len(b[0]) != 3:
        raise Unmodeled(f"{what}: expected 3-D operands, got {a[0]} and {b[0]}")
    (ba, m, k), (bb, k2, n) = a[0], b[0]
    if ba != bb or k != k2:
        raise Unmodeled(f"{what}: shapes do not match ({a[0]} x {b[0]})")
    return ba, m, n, k


def m_bmm(x: Args) -> Perf:  # bmm(self [B,M,K], mat2 [B,K,N])
    a, b = x.tensor(0, "self"), x.tensor(1, "mat2")
    bt, m, n, k = _bmm3(a, b, "bmm")
    return _gemm(m, n, k, bt, a, b, bt * m * n, a[1], 0, x.dtype(0))


def m_baddbmm(x: Args) -> Perf:  # baddbmm(self(bias), batch1, batch2, beta, alpha)
    bias, a, b = x.opt_tensor(0), x.tensor(1, "batch1"), x.tensor(2, "batch2")
    bt, m, n, k = _bmm3(a, b, "baddbmm")
    return _gemm(m, n, k, bt, a, b, bt * m * n, a[1], nbytes(bias), x.dtype(1))


def m_matmul(x: Args) -> Perf:  # matmul(self, other) with numpy broadcasting semantics
    a, b = x.tensor(0, "self"), x.tensor(1, "other")
    sa, sb = list(a[0]), list(b[0])
    if not sa or not sb:
        raise Unmodeled("matmul of a 0-d tensor")
    va, vb = len(sa) == 1, len(sb) == 1
    if va:
        sa = [1] + sa
    if vb:
        sb = sb + [1]
    m, k = sa[-2], sa[-1]
    k2, n = sb[-2], sb[-1]
    if k != k2:
        raise Unmodeled(f"matmul: inner dimensions differ ({a[0]} x {b[0]})")
    batch_shape = broadcast(sa[:-2], sb[:-2])
    bt = numel(batch_shape)
    return _gemm(m, n, k, bt, a, b, bt * m * n, a[1], 0, x.dtype(0))


def m_linear(x: Args) -> Perf:  # linear(input [..., K], weight [N, K], bias [N]?)
    a, w, bias = x.tensor(0, "input"), x.tensor(1, "weight"), x.opt_tensor(2)
    if not a[0] or len(w[0]) != 2:
        raise Unmodeled(f"linear: unexpected shapes input {a[0]}, weight {w[0]}")
    k = a[0][-1]
    n, k2 = w[0]
    if k != k2:
        raise Unmodeled(f"linear: input {a[0]} does not match weight {w[0]}")
    m = numel(a[0][:-1])
    return _gemm(m, n, k, 1, a, w, m * n, a[1], nbytes(bias), x.dtype(0))


def m_scaled_mm(x: Args) -> Perf:
    # _scaled_mm(self [M,K], mat2 [K,N], scale_a, scale_b, bias, scale_result, out_dtype, use_fast_accum)
    a, b = x.tensor(0, "self"), x.tensor(1, "mat2")
    m, n, k = _mm2(a, b, "_scaled_mm")
    extra = sum(nbytes(x.opt_tensor(i)) for i in (2, 3, 4, 5))
    try:
        out_size = SCALAR_TYPE_SIZES.get(int(x.const(6)), 2)
        note = ""
    except ValueError:
        out_size, note = 2, "out_dtype not recorded: output assumed 2 bytes/element"
    return _gemm(m, n, k, 1, a, b, m * n, out_size, extra, x.dtype(0), note=note)


def m_grouped_mm(x: Args) -> Perf:
    """_grouped_mm(mat_a, mat_b, offs, bias, out_dtype): 2-D x 3-D (offsets over A's rows), 3-D x 2-D
    (over B's columns), 2-D x 2-D (over K, output [G, M, N]), 3-D x 3-D (batched). Totals come from the
    inputs' shapes: rows past the last offset are counted (the trace does not record offset values)."""
    a, b = x.tensor(0, "mat_a"), x.tensor(1, "mat_b")
    offs, bias = x.opt_tensor(2), x.opt_tensor(3)
    sa, sb = a[0], b[0]
    if len(sa) == 2 and len(sb) == 3:
        (m, k), (g, k2, n) = sa, sb
        out = m * n
        bt = 1
    elif len(sa) == 3 and len(sb) == 2:
        (g, m, k), (k2, n) = sa, sb
        out = m * n
        bt = 1
    elif len(sa) == 2 and len(sb) == 2:
        (m, k), (k2, n) = sa, sb
        g = offs[0][0] if offs and offs[0] else None
        if g is None:
            raise Unmodeled("_grouped_mm 2-D x 2-D without offsets: group count unknown")
        out = g * m * n
        bt = 1
    elif len(sa) == 3 and len(sb) == 3:
        (g, m, k), (g2, k2, n) = sa, sb
        if g != g2:
            raise Unmodeled(f"_grouped_mm: group counts differ ({sa} x {sb})")
        out = g * m * n
        bt = g
    else:
        raise Unmodeled(f"_grouped_mm: unsupported operand ranks {sa} x {sb}")
    if k != k2:
        raise Unmodeled(f"_grouped_mm: inner dimensions differ ({sa} x {sb})")
    return _gemm(m, n, k, bt, a, b, out, a[1], nbytes(offs) + nbytes(bias), x.dtype(0), kind="grouped_gemm")


# ------------------------------------------------------------------------------------ attention

# name -> (q index, is_causal index or None, causal from custom_mask_type, layout "bhsd" / "bshd", backward)
_ATTN: dict[str, tuple[int, int | None, bool, str, bool]] = {
    "aten::scaled_dot_product_attention": (0, 5, False, "bhsd", False),
    "aten::_scaled_dot_product_flash_attention": (0, 4, False, "bhsd", False),
    "aten::_scaled_dot_product_flash_attention_for_cpu": (0, 4, False, "bhsd", False),
    "aten::_scaled_dot_product_efficient_attention": (0, 6, False, "bhsd", False),
    "aten::_scaled_dot_product_cudnn_attention": (0, 6, False, "bhsd", False),
    "aten::_cudnn_attention_forward": (0, 10, False, "bhsd", False),
    "aten::_flash_attention_forward": (0, 8, False, "bshd", False),
    "aten::_efficient_attention_forward": (0, 9, True, "bshd", False),
    "aten::_scaled_dot_product_flash_attention_backward": (1, 11, False, "bhsd", True),
    "aten::_scaled_dot_product_efficient_attention_backward": (1, 11, False, "bhsd", True),
    "aten::_scaled_dot_product_cudnn_attention_backward": (1, 14, False, "bhsd", True),
    "aten::_cudnn_attention_backward": (1, 14, False, "bhsd", True),
    "aten::_flash_attention_backward": (1, 11, False, "bshd", True),
    "aten::_efficient_attention_backward": (1, 14, True, "bshd", True),
}


def causal_pairs(sq: int, sk: int) -> int:
    """(query, key) pairs a top-left-aligned causal mask keeps: key j <= query i."""
    full = min(sq, sk)  # rows 0..full-1 attend to i+1 keys; rows beyond attend to all sk keys
    return full * (full + 1) // 2 + max(sq - sk, 0) * sk


def _bhsd(shape: list[int], layout: str, what: str) -> tuple[int, int, int, int]:
    if len(shape) != 4:
        raise Unmodeled(f"attention {what}: expected a 4-D tensor, got {shape} (variable-length layouts are not modeled)")
    if layout == "bhsd":
        b, h, s, d = shape
    else:
        b, s, h, d = shape
    return b, h, s, d


def attention_model(name: str, x: Args) -> Perf:
    qi, ci, mask_type, layout, bwd = _ATTN[name]
    q, k, v = x.tensor(qi, "query"), x.tensor(qi + 1, "key"), x.tensor(qi + 2, "value")
    b, h, sq, d = _bhsd(q[0], layout, "query")
    bk, hk, sk, dk = _bhsd(k[0], layout, "key")
    bv, hv, sv, dv = _bhsd(v[0], layout, "value")
    if bk != b or dk != d or sv != sk or bv != b or hk != hv or (hk and h % hk):
        raise Unmodeled(f"attention: query {q[0]}, key {k[0]}, value {v[0]} do not match")
    if mask_type:
        mt = x.int_const(ci, "custom_mask_type")
        if mt not in (0, 1):
            raise Unmodeled(f"attention custom_mask_type {mt} (bottom-right causal) not modeled")
        causal = mt == 1
    else:
        causal = x.flag(ci, "is_causal")
    pairs = b * h * (causal_pairs(sq, sk) if causal else sq * sk)
    qb, kb, vb = nbytes(q), nbytes(k), nbytes(v)
    ob = b * h * sq * dv * q[1]
    lse = b * h * sq * 4
    if not bwd:
        flops = 2.0 * pairs * (d + dv)
        byts = qb + kb + vb + ob + lse
    else:
        flops = 2.0 * pairs * (3 * d + 2 * dv)
        byts = 2 * (qb + kb + vb) + 2 * ob + lse  # read q,k,v,out,dout,lse; write dq,dk,dv
    note = "causal" if causal else "non-causal"
    return Perf(flops=flops, bytes=float(byts), dtype=x.dtype(qi), kind="attention", matrix=True,
                note=note)


# ------------------------------------------------------------------------------------ memory-bound ops


def elementwise(flops_per_elem: float, kind: str = "elementwise") -> Callable[[Args], Perf]:
    """Every tensor argument read once, output (broadcast shape, dtype of the first tensor) written once;
    in-place ops write self, which has the broadcast shape."""

    def f(x: Args) -> Perf:
        ts = x.tensors()
        if not ts:
            raise Unmodeled("no tensor arguments recorded")
        out = numel(broadcast(*[t[0] for t in ts]))
        first = next(i for i in range(len(x.types)) if x.is_tensor(i))
        return Perf(flops=float(flops_per_elem * out), bytes=float(sum(nbytes(t) for t in ts) + out * ts[0][1]),
                    dtype=x.dtype(first), kind=kind)

    return f


def m_copy(x: Args) -> Perf:  # copy_(self, src, non_blocking): read src, write self
    dst, src = x.tensor(0, "self"), x.tensor(1, "src")
    return Perf(flops=0.0, bytes=float(numel(dst[0]) * dst[1] + nbytes(src)), dtype=x.dtype(0), kind="copy")


def m_fill(x: Args) -> Perf:  # fill_/zero_(self, ...): write self
    t = x.tensor(0, "self")
    return Perf(flops=0.0, bytes=float(nbytes(t)), dtype=x.dtype(0), kind="copy")


def _norm_rows(shape: list[int], normalized: list[int]) -> tuple[int, int]:
    n = numel(normalized)
    total = numel(shape)
    return (total // n if n else 0), n


def m_layer_norm(x: Args) -> Perf:
    """native_layer_norm / layer_norm(input, normalized_shape, weight, bias, eps): read input, weight,
    bias; write output (+ fp32 mean and rstd per row for native_layer_norm). ~5 FLOPs/element."""
    inp, w, bias = x.tensor(0, "input"), x.opt_tensor(2), x.opt_tensor(3)
    try:
        norm = json.loads(x.const(1))
    except ValueError:
        norm = inp[0][-1:]
    rows, _ = _norm_rows(inp[0], norm if isinstance(norm, list) else [norm])
    total = numel(inp[0])
    byts = 2 * nbytes(inp) + nbytes(w) + nbytes(bias) + 2 * rows * 4
    return Perf(flops=5.0 * total, bytes=float(byts), dtype=x.dtype(0), kind="norm")


def m_layer_norm_backward(x: Args) -> Perf:
    """native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask):
    read grad_out, input, mean, rstd, weight; write grad_input / grad_weight / grad_bias per output_mask."""
    go, inp = x.tensor(0, "grad_out"), x.tensor(1, "input")
    mean, rstd, w, bias = x.opt_tensor(3), x.opt_tensor(4), x.opt_tensor(5), x.opt_tensor(6)
    try:
        mask = json.loads(x.const(7).lower())
        if not (isinstance(mask, list) and len(mask) == 3):
            raise ValueError
    except ValueError:
        mask = [True, w is not None, bias is not None]
    total = numel(inp[0])
    byts = nbytes(go) + nbytes(inp) + nbytes(mean) + nbytes(rstd) + nbytes(w)
    byts += (nbytes(inp) if mask[0] else 0) + (nbytes(w) if mask[1] else 0) + (nbytes(bias) if mask[2] else 0)
    return Perf(flops=8.0 * total, bytes=float(byts), dtype=x.dtype(0), kind="norm")


def m_rms_norm(x: Args) -> Perf:
    """rms_norm / _fused_rms_norm(input, normalized_shape, weight, eps): read input, weight; write output
    (+ fp32 rstd per row). ~4 FLOPs/element."""
    inp, w = x.tensor(0, "input"), x.opt_tensor(2)
    rows = numel(inp[0]) // max(inp[0][-1], 1) if inp[0] else 1
    return Perf(flops=4.0 * numel(inp[0]), bytes=float(2 * nbytes(inp) + nbytes(w) + rows * 4), dtype=x.dtype(0),
                kind="norm")


def m_rms_norm_backward(x: Args) -> Perf:
    """_fused_rms_norm_backward(grad_out, input, normalized_shape, rstd, weight, output_mask)."""
    go, inp, rstd, w = x.tensor(0, "grad_out"), x.tensor(1, "input"), x.opt_tensor(3), x.opt_tensor(4)
    byts = nbytes(go) + 2 * nbytes(inp) + nbytes(rstd) + 2 * nbytes(w)
    return Perf(flops=6.0 * numel(inp[0]), bytes=float(byts), dtype=x.dtype(0), kind="norm")


def m_softmax(x: Args) -> Perf:  # (_log_)softmax(self, dim, half_to_float / dtype): read, write
    t = x.tensor(0, "self")
    return Perf(flops=5.0 * numel(t[0]), bytes=float(2 * nbytes(t)), dtype=x.dtype(0), kind="softmax")


def m_softmax_backward(x: Args) -> Perf:  # (_log)_softmax_backward_data(grad_output, output, dim, input_dtype)
    go, out = x.tensor(0, "grad_output"), x.tensor(1, "output")
    return Perf(flops=3.0 * numel(go[0]), bytes=float(nbytes(go) + nbytes(out) + nbytes(go)), dtype=x.dtype(0),
                kind="softmax")


def m_reduce(x: Args) -> Perf:
    """sum / mean / amax / amin / prod (self, dim list, keepdim, dtype): read input, write the reduced
    output (dims from the recorded dim list; [] or missing = all dims)."""
    t = x.tensor(0, "self")
    shape = t[0]
    try:
        dims = json.loads(x.const(1)) if len(x.concrete) > 1 and x.const(1) else []
    except ValueError:
        raise Unmodeled("reduction dims not recorded") from None
    if isinstance(dims, int):
        dims = [dims]
    if not isinstance(dims, list):
        raise Unmodeled("reduction dims not recorded")
    if not dims:
        out = 1
    else:
        nd = len(shape)
        try:
            red = {(d % nd) for d in dims} if nd else set()
        except TypeError:
            raise Unmodeled("reduction dims not recorded") from None
        out = numel([s for i, s in enumerate(shape) if i not in red])
    return Perf(flops=float(numel(shape)), bytes=float(nbytes(t) + out * t[1]), dtype=x.dtype(0), kind="reduction")


def m_reduce_all(x: Args) -> Perf:
    """max / min (self) over the whole tensor, or (self, dim, keepdim) writing values and int64 indices."""
    t = x.tensor(0, "self")
    out_bytes = t[1]
    if len(x.types) > 1 and x.types[1] == "Scalar":
        dim = x.int_const(1, "dim")
        if t[0]:
            out = numel(t[0]) // max(t[0][dim % len(t[0])], 1)
            out_bytes = out * (t[1] + 8)
    return Perf(flops=float(numel(t[0])), bytes=float(nbytes(t) + out_bytes), dtype=x.dtype(0), kind="reduction")


def m_nll_loss(x: Args) -> Perf:
    """nll_loss_forward / nll_loss2d_forward(self [N,C], target [N], weight, reduction, ignore_index):
    reads one log-probability per target (N elements), the targets, writes the loss."""
    inp, tgt, w = x.tensor(0, "self"), x.tensor(1, "target"), x.opt_tensor(2)
    n = numel(tgt[0])
    return Perf(flops=float(n), bytes=float(n * inp[1] + nbytes(tgt) + nbytes(w) + n * inp[1]), dtype=x.dtype(0),
                kind="loss")


def m_nll_loss_backward(x: Args) -> Perf:
    """nll_loss_backward(grad_output, self [N,C], target, weight, reduction, ignore_index, total_weight):
    writes the whole grad_input (zeros except one element per row), reads the targets."""
    inp, tgt = x.tensor(1, "self"), x.tensor(2, "target")
    return Perf(flops=float(numel(tgt[0])), bytes=float(nbytes(inp) + nbytes(tgt)), dtype=x.dtype(1), kind="loss")


def m_cross_entropy(x: Args) -> Perf:
    """cross_entropy_loss(self [N,C], target, weight, reduction, ignore_index, label_smoothing): one
    read of the logits, a log-softmax written and read back, targets read."""
    inp, tgt = x.tensor(0, "self"), x.tensor(1, "target")
    return Perf(flops=6.0 * numel(inp[0]), bytes=float(3 * nbytes(inp) + nbytes(tgt)), dtype=x.dtype(0), kind="loss")


def m_embedding(x: Args) -> Perf:  # embedding(weight [V,D], indices): read indices and rows, write output
    w, idx = x.tensor(0, "weight"), x.tensor(1, "indices")
    if len(w[0]) != 2:
        raise Unmodeled(f"embedding: weight {w[0]} is not 2-D")
    rows = numel(idx[0]) * w[0][1]
    return Perf(flops=0.0, bytes=float(nbytes(idx) + 2 * rows * w[1]), dtype=x.dtype(0), kind="embedding")


def m_embedding_backward(x: Args) -> Perf:
    """embedding_dense_backward(grad_output [..., D], indices, num_weights, padding_idx, scale_grad_by_freq):
    read grad and indices, write the dense [num_weights, D] gradient."""
    go, idx = x.tensor(0, "grad_output"), x.tensor(1, "indices")
    nw = x.int_const(2, "num_weights")
    d = go[0][-1] if go[0] else 1
    return Perf(flops=float(numel(go[0])), bytes=float(nbytes(go) + nbytes(idx) + nw * d * go[1]),
                dtype=x.dtype(0), kind="embedding")


def m_index_select(x: Args) -> Perf:  # index_select(self, dim, index): out = self with dim sized len(index)
    t, idx = x.tensor(0, "self"), x.tensor(2, "index")
    dim = x.int_const(1, "dim")
    if not t[0]:
        raise Unmodeled("index_select of a 0-d tensor")
    other = numel(t[0]) // max(t[0][dim % len(t[0])], 1)
    out = other * numel(idx[0])
    return Perf(flops=0.0, bytes=float(nbytes(idx) + 2 * out * t[1]), dtype=x.dtype(0), kind="index")


def m_gather(x: Args) -> Perf:  # gather(self, dim, index, sparse_grad): out has index's shape
    t, idx = x.tensor(0, "self"), x.tensor(2, "index")
    out = numel(idx[0])
    return Perf(flops=0.0, bytes=float(nbytes(idx) + 2 * out * t[1]), dtype=x.dtype(0), kind="index")


def m_scatter(x: Args) -> Perf:
    """scatter_/scatter_add_(self, dim, index, src|value[, reduce]) and index_add_(self, dim, index, source,
    alpha): read index and source, read-modify-write the destination elements touched."""
    t, idx = x.tensor(0, "self"), x.tensor(2, "index")
    src = x.opt_tensor(3)
    touched = numel(src[0]) if src is not None and len(src[0]) == len(t[0]) else numel(idx[0])
    if src is not None and len(idx[0]) == 1 and len(t[0]) > 1:  # index_add_: index selects rows
        touched = numel(src[0])
    return Perf(flops=float(touched), bytes=float(nbytes(idx) + nbytes(src) + 2 * touched * t[1]),
                dtype=x.dtype(0), kind="index")


# ------------------------------------------------------------------------------------ the table

_EW1 = ("aten::add", "aten::add_", "aten::sub", "aten::sub_", "aten::rsub", "aten::mul", "aten::mul_", "aten::div",
        "aten::div_", "aten::neg", "aten::neg_", "aten::abs", "aten::relu", "aten::relu_", "aten::clamp",
        "aten::clamp_", "aten::clamp_min", "aten::clamp_min_", "aten::clamp_max", "aten::maximum", "aten::minimum",
        "aten::where", "aten::masked_fill", "aten::masked_fill_", "aten::threshold_backward", "aten::pow",
        "aten::reciprocal", "aten::sqrt", "aten::rsqrt", "aten::remainder", "aten::floor_divide", "aten::eq",
        "aten::ne", "aten::lt", "aten::le", "aten::gt", "aten::ge", "aten::sign", "aten::square",
        "aten::fmod", "aten::lerp_", "aten::addcmul_", "aten::addcdiv_", "aten::mse_loss")
_EW_ACT = {  # activations and their backward: FLOPs per output element (documented convention)
    "aten::silu": 4, "aten::silu_": 4, "aten::silu_backward": 6, "aten::gelu": 8, "aten::gelu_": 8,
    "aten::gelu_backward": 12, "aten::sigmoid": 4, "aten::sigmoid_backward": 2, "aten::tanh": 4,
    "aten::tanh_backward": 2, "aten::exp": 1, "aten::log": 1, "aten::dropout": 2, "aten::native_dropout": 2,
    "aten::native_dropout_backward": 1, "aten::mse_loss_backward": 3,
}

MODELS: dict[str, Callable[[Args], Perf]] = {
    "aten::mm": m_mm, "aten::addmm": m_addmm, "aten::bmm": m_bmm, "aten::baddbmm": m_baddbmm,
    "aten::matmul": m_matmul, "aten::linear": m_linear, "aten::_scaled_mm": m_scaled_mm,
    "aten::_grouped_mm": m_grouped_mm, "aten::_scaled_grouped_mm": m_grouped_mm,
    **{name: (lambda x, _n=name: attention_model(_n, x)) for name in _ATTN},
    **{name: elementwise(1) for name in _EW1},
    **{name: elementwise(f) for name, f in _EW_ACT.items()},
    "aten::copy_": m_copy, "aten::fill_": m_fill, "aten::zero_": m_fill,
    "aten::layer_norm": m_layer_norm, "aten::native_layer_norm": m_layer_norm,
    "aten::native_layer_norm_backward": m_layer_norm_backward,
    "aten::rms_norm": m_rms_norm, "aten::_fused_rms_norm": m_rms_norm,
    "aten::_fused_rms_norm_backward": m_rms_norm_backward,
    "aten::softmax": m_softmax, "aten::_softmax": m_softmax, "aten::log_softmax": m_softmax,
    "aten::_log_softmax": m_softmax, "aten::_softmax_backward_data": m_softmax_backward,
    "aten::_log_softmax_backward_data": m_softmax_backward,
    "aten::sum": m_reduce, "aten::mean": m_reduce, "aten::amax": m_reduce, "aten::amin": m_reduce,
    "aten::prod": m_reduce, "aten::max": m_reduce_all, "aten::min": m_reduce_all,
    "aten::cross_entropy_loss": m_cross_entropy, "aten::nll_loss_forward": m_nll_loss,
    "aten::nll_loss2d_forward": m_nll_loss, "aten::nll_loss_backward": m_nll_loss_backward,
    "aten::nll_loss2d_backward": m_nll_loss_backward,
    "aten::embedding": m_embedding, "aten::embedding_dense_backward": m_embedding_backward,
    "aten::index_select": m_index_select, "aten::gather": m_gather, "aten::scatter_": m_scatter,
    "aten::scatter_add_": m_scatter, "aten::index_add_": m_scatter,
}


def _loads(text: Any) -> list:
    if text is None or (isinstance(text, float) and math.isnan(text)):
        return []
    if isinstance(text, list):
        return text
    s = str(text)
    if not s:
        return []
    v = json.loads(s)
    if not isinstance(v, list):
        raise ValueError("not a list")
    return v


def has_model(name: str) -> bool:
    return name in MODELS


def model(name: str, input_dims: Any = "", input_types: Any = "", concrete_inputs: Any = "",
          input_strides: Any = "") -> Result:
    """FLOPs and bytes of one op call from its recorded arguments (JSON text as in the trace, or
    already-parsed lists), or the reason it cannot be modeled. Never raises; cached per distinct call."""
    args = []
    for v in (input_dims, input_types, concrete_inputs, input_strides):
        if v is None or (isinstance(v, float) and math.isnan(v)):
            v = ""
        elif not isinstance(v, str):
            try:
                v = json.dumps(v)
            except (TypeError, ValueError):
                return Result(None, "malformed Input Dims / Input type / Concrete Inputs")
        args.append(v)
    return _model(str(name), *args)


@lru_cache(maxsize=65536)
def _model(name: str, input_dims: str, input_types: str, concrete_inputs: str, input_strides: str) -> Result:
    fn = MODELS.get(name)
    if fn is None:
        return Result(None, "no model for this op")
    try:
        args = Args(_loads(input_dims), _loads(input_types), _loads(concrete_inputs))
    except (ValueError, TypeError):
        return Result(None, "malformed Input Dims / Input type / Concrete Inputs")
    try:
        args.strides = _loads(input_strides)
    except (ValueError, TypeError):
        args.strides = []
    if not args.dims or not args.types:
        return Result(None, "shapes not recorded (profile with record_shapes=True)")
    try:
        perf = fn(args)
    except Unmodeled as e:
        return Result(None, str(e))
    except (ValueError, TypeError, IndexError, KeyError, ZeroDivisionError, OverflowError) as e:
        return Result(None, f"unexpected arguments ({type(e).__name__}: {e})")
    if not (math.isfinite(perf.flops) and math.isfinite(perf.bytes)) or perf.flops < 0 or perf.bytes < 0:
        return Result(None, "model gave a non-finite or negative count")
    return Result(perf)


def model_args(name: str, dims: list, types: list, concrete: list | None = None,
               strides: list | None = None) -> Result:
    """`model` for already-parsed lists (tests, callers that build arguments by hand)."""
    return model(name, json.dumps(dims), json.dumps(types), json.dumps(concrete or []), json.dumps(strides or []))
