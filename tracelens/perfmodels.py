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
- Convolution FLOPs are 2 per multiply-add: 2 * N * numel(weight) * output positions (input positions
  for a transposed convolution); backward costs that once per requested input / weight gradient.
- Elementwise/norm/softmax/reduction FLOPs are small per-element constants (below); these ops are
  memory-bound, their bytes are what matters.
- out= variants (`aten::mm.out`, `aten::mm_out`, a functional name recorded with an out= tensor) count
  like the functional op: the out tensor is written once, never read (`canonical_name`).
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
    kind: str  # gemm, grouped_gemm, conv, attention, elementwise, norm, softmax, reduction, loss, embedding, index, copy
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
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": (1, 7, False, "bhsd", True),
    "aten::_scaled_dot_product_fused_attention_overrideable": (0, 5, False, "bhsd", False),
    "aten::_scaled_dot_product_fused_attention_overrideable_backward": (1, 13, False, "bhsd", True),
}
# the cu_seqlens_q argument of the ops that take one with 4-D inputs: present = a variable-length batch
# packed into one sequence, whose per-sequence lengths the trace does not record
_ATTN_VARLEN = {"aten::_efficient_attention_forward": 4, "aten::_efficient_attention_backward": 6}


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
    vi = _ATTN_VARLEN.get(name)
    if vi is not None and x.is_tensor(vi) and numel(x.dims[vi]) > 0:
        raise Unmodeled("variable-length batch (cu_seqlens): the per-sequence lengths are not recorded")
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


def elementwise(flops_per_elem: float, kind: str = "elementwise",
                inputs: tuple[int, ...] | None = None) -> Callable[[Args], Perf]:
    """Every tensor input read once, output (broadcast shape, dtype of the first tensor) written once;
    in-place ops write self, which has the broadcast shape. `inputs`: the argument positions that are
    tensor inputs in the op's schemas; a tensor anywhere else is an `out=` argument, the output itself
    (written once, not read)."""

    def f(x: Args) -> Perf:
        pos = [i for i in range(len(x.types)) if x.is_tensor(i) and (inputs is None or i in inputs)]
        ts = [x.tensor(i) for i in pos]
        if not ts:
            raise Unmodeled("no tensor arguments recorded")
        out = numel(broadcast(*[t[0] for t in ts]))
        first = pos[0]
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
    if x.is_tensor(1):  # max.other / min.other (self, other): the elementwise maximum / minimum
        return elementwise(1, inputs=(0, 1))(x)
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


# ------------------------------------------------------------------------------------ convolution


@dataclass(frozen=True)
class _ConvArgs:
    """Argument positions of one convolution schema (None: absent from it)."""
    weight: int = 1
    bias: int | None = 2
    stride: int = 3
    padding: int = 4
    dilation: int = 5
    transposed: int | bool = False  # position of the flag, or the fixed value
    output_padding: int | None = None
    groups: int = 6
    extra: tuple[int, ...] = ()  # other tensors read (cudnn_convolution_add_relu's z)


# schemas as torch 2.x declares them (aten/src/ATen/native/native_functions.yaml)
_CONV: dict[str, _ConvArgs] = {
    "aten::convolution": _ConvArgs(transposed=6, output_padding=7, groups=8),
    "aten::_convolution": _ConvArgs(transposed=6, output_padding=7, groups=8),
    "aten::conv1d": _ConvArgs(), "aten::conv2d": _ConvArgs(), "aten::conv3d": _ConvArgs(),
    "aten::_convolution_mode": _ConvArgs(),
    "aten::conv_transpose1d": _ConvArgs(transposed=True, output_padding=5, groups=6, dilation=7),
    "aten::conv_transpose2d": _ConvArgs(transposed=True, output_padding=5, groups=6, dilation=7),
    "aten::conv_transpose3d": _ConvArgs(transposed=True, output_padding=5, groups=6, dilation=7),
    "aten::cudnn_convolution": _ConvArgs(bias=None, padding=2, stride=3, dilation=4, groups=5),
    "aten::cudnn_convolution_transpose": _ConvArgs(bias=None, padding=2, output_padding=3, stride=4, dilation=5,
                                                   groups=6, transposed=True),
    "aten::cudnn_convolution_relu": _ConvArgs(),
    "aten::cudnn_convolution_add_relu": _ConvArgs(bias=4, stride=5, padding=6, dilation=7, groups=8, extra=(2,)),
    "aten::miopen_convolution": _ConvArgs(padding=3, stride=4, dilation=5, groups=6),
    "aten::miopen_depthwise_convolution": _ConvArgs(padding=3, stride=4, dilation=5, groups=6),
    "aten::miopen_convolution_transpose": _ConvArgs(padding=3, output_padding=4, stride=5, dilation=6, groups=7,
                                                    transposed=True),
    "aten::mkldnn_convolution": _ConvArgs(padding=3, stride=4, dilation=5, groups=6),
}


def _int_list(x: Args, i: int | None, n: int, what: str, default: int) -> list[int]:
    """An int-list argument (stride, padding, ...) broadcast to n spatial dims; the default when absent."""
    if i is None or i >= len(x.types):
        return [default] * n
    v = x.const(i).strip()
    if v == "":
        if i < len(x.types) and x.types[i] in ("", "ScalarList"):
            raise Unmodeled(f"convolution {what} (argument {i}) not recorded in Concrete Inputs")
        return [default] * n
    try:
        val = json.loads(v)
    except ValueError:
        raise Unmodeled(f"convolution {what} (argument {i}) is {v!r}") from None
    if isinstance(val, int):
        val = [val]
    if not isinstance(val, list) or not all(isinstance(a, int) for a in val):
        raise Unmodeled(f"convolution {what} (argument {i}) is {v!r}")
    if len(val) == 1:
        val = val * n
    if len(val) != n:
        raise Unmodeled(f"convolution {what} {val} does not match {n} spatial dims")
    return val


def _conv_geometry(x: Args, spec: _ConvArgs, what: str):
    """(input, weight, batch, input spatial, output spatial, transposed, groups) of a convolution call."""
    inp, w = x.tensor(0, "input"), x.tensor(spec.weight, "weight")
    nsp = len(w[0]) - 2
    if nsp < 1:
        raise Unmodeled(f"{what}: weight {w[0]} has no spatial dims")
    if len(inp[0]) == nsp + 2:
        n, sp_in = inp[0][0], inp[0][2:]
    elif len(inp[0]) == nsp + 1:  # unbatched input
        n, sp_in = 1, inp[0][1:]
    else:
        raise Unmodeled(f"{what}: input {inp[0]} does not match weight {w[0]}")
    transposed = spec.transposed if isinstance(spec.transposed, bool) else x.flag(spec.transposed, "transposed")
    groups = x.int_const(spec.groups, "groups") if spec.groups < len(x.types) else 1
    if groups < 1:
        raise Unmodeled(f"{what}: groups {groups}")
    stride = _int_list(x, spec.stride, nsp, "stride", 1)
    dil = _int_list(x, spec.dilation, nsp, "dilation", 1)
    k = w[0][2:]
    pad_text = x.const(spec.padding).strip().strip("'\"") if spec.padding < len(x.types) else ""
    if pad_text in ("same", "valid"):  # conv*d.padding / _convolution_mode
        pad = [0] * nsp if pad_text == "valid" else None
    else:
        pad = _int_list(x, spec.padding, nsp, "padding", 0)
    if transposed:
        opad = _int_list(x, spec.output_padding, nsp, "output_padding", 0)
        if pad is None:
            raise Unmodeled(f"{what}: padding 'same' on a transposed convolution")
        sp_out = [(i - 1) * s - 2 * p + d * (kk - 1) + op + 1 for i, s, p, d, kk, op in zip(sp_in, stride, pad, dil, k, opad)]
        c_in_w = w[0][0]  # transposed weight: [C_in, C_out / groups, *k]
    else:
        if pad is None:  # 'same': output spatial = input spatial (torch requires stride 1)
            sp_out = list(sp_in)
        else:
            sp_out = [(i + 2 * p - d * (kk - 1) - 1) // s + 1 for i, s, p, d, kk in zip(sp_in, stride, pad, dil, k)]
        c_in_w = w[0][1] * groups  # weight: [C_out, C_in / groups, *k]
    c_in = inp[0][1] if len(inp[0]) == nsp + 2 else inp[0][0]
    if c_in != c_in_w or any(v <= 0 for v in sp_out) or any(s <= 0 for s in stride):
        raise Unmodeled(f"{what}: input {inp[0]}, weight {w[0]}, groups {groups} do not give a valid output")
    return inp, w, n, sp_in, sp_out, transposed, groups


def conv_model(name: str, x: Args) -> Perf:
    """Convolution forward: 2 FLOPs per multiply-add, N x numel(weight) x (output positions, or input
    positions for a transposed convolution); bias adds and fused activations are not counted as FLOPs.
    Bytes: input, weight, bias (and other tensors read) + output written."""
    spec = _CONV[name]
    inp, w, n, sp_in, sp_out, transposed, groups = _conv_geometry(x, spec, name.split("::")[-1])
    c_out = w[0][1] * groups if transposed else w[0][0]
    positions = numel(sp_in) if transposed else numel(sp_out)
    flops = 2.0 * n * numel(w[0]) * positions
    bias = x.opt_tensor(spec.bias) if spec.bias is not None else None
    extra = sum(nbytes(x.opt_tensor(i)) for i in spec.extra)
    out_bytes = n * c_out * numel(sp_out) * inp[1]
    return Perf(flops=flops, bytes=float(nbytes(inp) + nbytes(w) + nbytes(bias) + extra + out_bytes),
                dtype=x.dtype(0), kind="conv", matrix=True,
                note=("transposed, " if transposed else "") + f"groups={groups}")


def m_conv_backward(x: Args) -> Perf:
    """convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
    output_padding, groups, output_mask): grad_input and grad_weight each cost the forward's FLOPs
    (2 x N x numel(weight) x positions, from grad_output's spatial dims, or input's when transposed),
    grad_bias one add per grad_output element; each per `output_mask`. Bytes: grad_output read, input
    read for grad_weight, weight read for grad_input, the requested gradients written."""
    go, inp, w = x.tensor(0, "grad_output"), x.tensor(1, "input"), x.tensor(2, "weight")
    nsp = len(w[0]) - 2
    if nsp < 1 or len(go[0]) != len(inp[0]) or len(inp[0]) not in (nsp + 1, nsp + 2):
        raise Unmodeled(f"convolution_backward: grad_output {go[0]}, input {inp[0]}, weight {w[0]} do not match")
    transposed = x.flag(7, "transposed")
    try:
        mask = json.loads(x.const(10).lower())
        if not (isinstance(mask, list) and len(mask) == 3):
            raise ValueError
    except ValueError:
        raise Unmodeled("convolution_backward output_mask (argument 10) not recorded in Concrete Inputs") from None
    batched = len(inp[0]) == nsp + 2
    n = inp[0][0] if batched else 1
    positions = numel((inp[0] if transposed else go[0])[2 if batched else 1:])
    fwd = 2.0 * n * numel(w[0]) * positions
    flops = fwd * (int(bool(mask[0])) + int(bool(mask[1]))) + (numel(go[0]) if mask[2] else 0)
    c_bias = go[0][1 if batched else 0]
    reads = nbytes(go) + (nbytes(w) if mask[0] else 0) + (nbytes(inp) if mask[1] else 0)
    writes = (nbytes(inp) if mask[0] else 0) + (nbytes(w) if mask[1] else 0) + (c_bias * go[1] if mask[2] else 0)
    byts = reads + writes
    return Perf(flops=flops, bytes=float(byts), dtype=x.dtype(0), kind="conv", matrix=True,
                note=("transposed, " if transposed else "") + "grads " + "".join("iwb"[i] for i in range(3) if mask[i]))


# ------------------------------------------------------------------------------------ batch / group norm

# name -> (grad_out / input positions are 0; training flag position or fixed value)
_BN_FWD: dict[str, int | bool] = {
    "aten::native_batch_norm": 5, "aten::batch_norm": 5, "aten::_batch_norm_impl_index": 5,
    "aten::cudnn_batch_norm": 5, "aten::miopen_batch_norm": 5, "aten::_native_batch_norm_legit": 5,
    "aten::_native_batch_norm_legit_no_training": False, "aten::_batch_norm_with_update": True,
    "aten::_batch_norm_no_update": False,
}


def _channels(shape: list[int], what: str) -> tuple[int, int]:
    """(C, elements per channel) of an [N, C, *] tensor."""
    if len(shape) < 2:
        raise Unmodeled(f"{what}: input {shape} has no channel dim")
    return shape[1], numel(shape) // max(shape[1], 1)


def bn_model(name: str, x: Args) -> Perf:
    """Batch norm forward. Training: per-channel mean and variance over (N, *) then normalize and scale,
    ~5 FLOPs/element; running stats read and written, fp32 save_mean / save_invstd written. Eval: the
    running stats folded into a scale and shift, 2 FLOPs/element. Bytes: input read, output written,
    weight / bias / running stats per channel."""
    inp = x.tensor(0, "input")
    c, _ = _channels(inp[0], name)
    flag = _BN_FWD[name]
    stats = (3, 4)
    if name == "aten::_native_batch_norm_legit" and not x.is_tensor(3) and len(x.types) == 6:
        flag, stats = 3, ()  # the no_stats overload: (input, weight, bias, training, momentum, eps)
    training = flag if isinstance(flag, bool) else x.flag(flag, "training")
    params = nbytes(x.opt_tensor(1)) + nbytes(x.opt_tensor(2))
    run = sum(nbytes(x.opt_tensor(i)) for i in stats)
    byts = 2 * nbytes(inp) + params + (2 * run + 2 * c * 4 if training else run)
    return Perf(flops=(5.0 if training else 2.0) * numel(inp[0]), bytes=float(byts), dtype=x.dtype(0),
                kind="norm", note="training" if training else "eval")


# name -> (grad_out position, input position, weight position, save_mean, save_invstd, output_mask or None)
_BN_BWD: dict[str, tuple[int, int, int, int, int, int | None]] = {
    "aten::native_batch_norm_backward": (0, 1, 2, 5, 6, 9),
    "aten::batch_norm_backward": (0, 1, 2, 5, 6, 9),
    "aten::cudnn_batch_norm_backward": (1, 0, 2, 5, 6, None),
    "aten::miopen_batch_norm_backward": (1, 0, 2, 5, 6, None),
}


def _mask(x: Args, i: int | None, what: str) -> list[bool]:
    if i is None:
        return [True, True, True]
    try:
        m = json.loads(x.const(i).lower())
        if isinstance(m, list) and len(m) == 3:
            return [bool(v) for v in m]
    except ValueError:
        pass
    raise Unmodeled(f"{what} output_mask (argument {i}) not recorded in Concrete Inputs")


def bn_backward_model(name: str, x: Args) -> Perf:
    """Batch norm backward: two reductions over (N, *) per channel and the input gradient, ~8
    FLOPs/element. Bytes: grad_output, input, weight, saved mean / invstd read; grad_input (input's
    size), grad_weight and grad_bias (per channel) written, per output_mask (cuDNN / MIOpen: all)."""
    gi, ii, wi, mi, si, maski = _BN_BWD[name]
    go, inp = x.tensor(gi, "grad_output"), x.tensor(ii, "input")
    c, _ = _channels(inp[0], name)
    mask = _mask(x, maski, name)
    w = x.opt_tensor(wi)
    reads = nbytes(go) + nbytes(inp) + nbytes(w) + nbytes(x.opt_tensor(mi)) + nbytes(x.opt_tensor(si))
    wsize = w[1] if w is not None else inp[1]
    writes = (nbytes(inp) if mask[0] else 0) + (c * wsize if mask[1] else 0) + (c * wsize if mask[2] else 0)
    return Perf(flops=8.0 * numel(inp[0]), bytes=float(reads + writes), dtype=x.dtype(ii), kind="norm")


def m_group_norm(x: Args) -> Perf:
    """native_group_norm(input, weight, bias, N, C, HxW, group, eps) / group_norm(input, num_groups,
    weight, bias, eps, cudnn_enabled): ~5 FLOPs/element; input read, output written, weight and bias,
    fp32 mean and rstd per (sample, group) written (native_group_norm)."""
    inp = x.tensor(0, "input")
    if x.is_tensor(1) or len(x.types) >= 7:  # native_group_norm
        w, bias = x.opt_tensor(1), x.opt_tensor(2)
        groups = x.int_const(6, "group")
        stats = True
    else:  # group_norm
        w, bias = x.opt_tensor(2), x.opt_tensor(3)
        groups = x.int_const(1, "num_groups")
        stats = False
    c, _ = _channels(inp[0], "group_norm")
    if groups < 1 or c % groups:
        raise Unmodeled(f"group_norm: {c} channels in {groups} groups")
    n = inp[0][0]
    byts = 2 * nbytes(inp) + nbytes(w) + nbytes(bias) + (2 * n * groups * 4 if stats else 0)
    return Perf(flops=5.0 * numel(inp[0]), bytes=float(byts), dtype=x.dtype(0), kind="norm")


def m_group_norm_backward(x: Args) -> Perf:
    """native_group_norm_backward(grad_out, input, mean, rstd, weight, N, C, HxW, group, output_mask):
    ~8 FLOPs/element; grad_out, input, mean, rstd, weight read; grad_input, grad_weight, grad_bias written
    per output_mask."""
    go, inp = x.tensor(0, "grad_out"), x.tensor(1, "input")
    c, _ = _channels(inp[0], "native_group_norm_backward")
    mask = _mask(x, 9, "native_group_norm_backward")
    w = x.opt_tensor(4)
    reads = nbytes(go) + nbytes(inp) + nbytes(x.opt_tensor(2)) + nbytes(x.opt_tensor(3)) + nbytes(w)
    wsize = w[1] if w is not None else inp[1]
    writes = (nbytes(inp) if mask[0] else 0) + (c * wsize if mask[1] else 0) + (c * wsize if mask[2] else 0)
    return Perf(flops=8.0 * numel(inp[0]), bytes=float(reads + writes), dtype=x.dtype(1), kind="norm")


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

# tensor-input positions of the elementwise ops, from their schemas (torch 2.x, every overload but the
# out= ones): a tensor argument elsewhere is an out= argument (e.g. `aten::mul` recorded with three
# tensors is mul.out(self, other, *, out)), written once and not read
_EW_INPUTS: dict[str, tuple[int, ...]] = {
    **{n: (0,) for n in ("aten::neg", "aten::neg_", "aten::abs", "aten::relu", "aten::relu_", "aten::reciprocal",
                         "aten::sqrt", "aten::rsqrt", "aten::sign", "aten::square", "aten::silu", "aten::silu_",
                         "aten::gelu", "aten::gelu_", "aten::sigmoid", "aten::tanh", "aten::exp", "aten::log",
                         "aten::dropout", "aten::native_dropout")},
    **{n: (0, 1) for n in ("aten::add", "aten::add_", "aten::sub", "aten::sub_", "aten::rsub", "aten::mul",
                           "aten::mul_", "aten::div", "aten::div_", "aten::clamp_min", "aten::clamp_min_",
                           "aten::clamp_max", "aten::maximum", "aten::minimum", "aten::threshold_backward",
                           "aten::pow", "aten::remainder", "aten::floor_divide", "aten::eq", "aten::ne", "aten::lt",
                           "aten::le", "aten::gt", "aten::ge", "aten::fmod", "aten::mse_loss", "aten::silu_backward",
                           "aten::gelu_backward", "aten::sigmoid_backward", "aten::tanh_backward",
                           "aten::native_dropout_backward")},
    **{n: (0, 1, 2) for n in ("aten::clamp", "aten::clamp_", "aten::where", "aten::masked_fill",
                              "aten::masked_fill_", "aten::lerp_", "aten::addcmul_", "aten::addcdiv_",
                              "aten::mse_loss_backward")},
}

MODELS: dict[str, Callable[[Args], Perf]] = {
    "aten::mm": m_mm, "aten::addmm": m_addmm, "aten::bmm": m_bmm, "aten::baddbmm": m_baddbmm,
    "aten::matmul": m_matmul, "aten::linear": m_linear, "aten::_scaled_mm": m_scaled_mm,
    "aten::_grouped_mm": m_grouped_mm, "aten::_scaled_grouped_mm": m_grouped_mm,
    **{name: (lambda x, _n=name: attention_model(_n, x)) for name in _ATTN},
    **{name: elementwise(1, inputs=_EW_INPUTS[name]) for name in _EW1},
    **{name: elementwise(f, inputs=_EW_INPUTS[name]) for name, f in _EW_ACT.items()},
    **{name: (lambda x, _n=name: conv_model(_n, x)) for name in _CONV},
    "aten::convolution_backward": m_conv_backward,
    **{name: (lambda x, _n=name: bn_model(_n, x)) for name in _BN_FWD},
    **{name: (lambda x, _n=name: bn_backward_model(_n, x)) for name in _BN_BWD},
    "aten::native_group_norm": m_group_norm, "aten::group_norm": m_group_norm,
    "aten::native_group_norm_backward": m_group_norm_backward,
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


# ops seen in real traces whose FLOPs the recorded arguments cannot give: reported with the reason
UNMODELABLE: dict[str, str] = {
    "aiter::mha_batch_prefill": ("variable-length paged attention (ROCm aiter / CK): the per-sequence query and "
                                 "key lengths are not recorded, only their offsets' shapes"),
    "vllm::unified_attention_with_output": ("variable-length paged attention: the per-sequence query and key lengths "
                                            "are not recorded"),
}
# overload names of out= variants that are not 'out' / '..._out'
_OUT_OVERLOADS = frozenset({"grad_input"})


def canonical_name(name: str) -> tuple[str, bool]:
    """(the op name MODELS knows, whether the call is an out= variant). `aten::mm.out`, `aten::add.Scalar_out`,
    `aten::silu_backward.grad_input` and `aten::mm_out` are out= variants of `aten::mm`, `aten::add`, ...;
    `aten::add.Tensor` is `aten::add`. The models read inputs by position (the out= tensors come after them
    in every schema) or, for elementwise ops, only at the schema's tensor-input positions, so an out=
    variant is counted once, like its functional form: never as one more input read."""
    if name in MODELS:
        return name, False
    base, dot, overload = name.partition(".")
    if dot and "::" in base and "::" not in overload:
        is_out = overload == "out" or overload.endswith("_out") or overload in _OUT_OVERLOADS
        if base in MODELS:
            return base, is_out
        name = base
    if name.endswith("_out") and name[:-4] in MODELS:
        return name[:-4], True
    return name, False


def has_model(name: str) -> bool:
    return canonical_name(name)[0] in MODELS


def has_model_on_markers() -> dict:
    """`categories.map_strings`' keyword for has_model: on a step marker "ProfilerStep#N" (no '.', no '_out' end)
    canonical_name is the name itself, so has_model is False on every marker unless MODELS names one."""
    return {} if any(k.startswith("ProfilerStep#") for k in MODELS) else {"on_markers": False}


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
    fn = MODELS.get(canonical_name(name)[0])
    if fn is None:
        return Result(None, UNMODELABLE.get(name, "no model for this op"))
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
