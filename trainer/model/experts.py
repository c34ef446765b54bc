"""Routed-expert SwiGLU MLP over a token buffer grouped by expert, with four GEMM backends.

Weights are stored as ``w13[E, 2F, D]`` and ``w2[E, D, F]`` (``nn.Linear``'s out x in layout, contiguous);
a grouped GEMM sees them as ``w.transpose(1, 2)`` = ``[E, K, N]`` column-major, the layout that
``torch._grouped_mm`` wants for its second operand.

The expert groups are given either as host integers ``counts`` (sync-free levels 0-1) or as device
cumulative end offsets ``offs`` (int32, levels 2-3). Backends:

* ``loop``: one GEMM per expert on host-side split sizes. With device offsets only (levels 2-3) it
  cannot slice without a sync, so it runs the *masked reference*: every expert's GEMM over the whole
  buffer, keeping its own rows (E x the FLOPs; correct and sync-free, documented cost).
* ``multistream``: like ``loop``, the per-expert GEMMs round-robin over several CUDA streams; on a
  CPU it is ``loop`` (logged once).
* ``torch``: ``torch._grouped_mm(x, w, offs=...)`` with device offsets; when the op is missing or
  rejects the device/dtype/shape it falls back to the masked reference (logged once per key).
* ``triton``: ``kernels.grouped_mm(x, w, offs)`` imported lazily on CUDA; without it, or on a CPU
  (Triton needs a GPU, and kernels' CPU reference syncs with the host), the masked reference (logged).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger("trainer.experts")
_logged: set = set()
_streams: dict = {}
_torch_gmm_ok: dict = {}


def _note(key, msg: str) -> None:
    if key not in _logged:
        _logged.add(key)
        log.warning(msg)


def reset_notes() -> None:
    _logged.clear()
    _torch_gmm_ok.clear()


def counts_to_offs(counts: list[int], device) -> torch.Tensor:
    ends, s = [], 0
    for c in counts:
        s += c
        ends.append(s)
    return torch.tensor(ends, dtype=torch.int32, device=device)


def gmm_masked_reference(x: torch.Tensor, w_nk: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Device-offset grouped GEMM reference without host syncs: y[r] = x[r] @ w_nk[e(r)].T.

    Rows at or beyond ``offs[-1]`` get zeros. Costs E full-buffer GEMMs.
    """
    E = w_nk.shape[0]
    rows = torch.arange(x.shape[0], device=x.device, dtype=offs.dtype)
    seg = torch.searchsorted(offs, rows, right=True)  # expert of each row; E for rows past the end
    y = x.new_zeros(x.shape[0], w_nk.shape[1])
    for e in range(E):
        y = torch.where((seg == e).unsqueeze(1), F.linear(x, w_nk[e]), y)
    return y


def align_groups(x: torch.Tensor, offs: torch.Tensor, align: int):
    """Pad every expert's row group to a multiple of ``align`` rows, without a host sync.

    Returns (x_padded [R + E*(align-1), K], offs_padded int32, dest [R]) with ``x_padded[dest] == x``;
    padding rows are zeros (zero output, zero weight-gradient contribution); the last group absorbs the
    tail so that ``offs_padded[-1]`` covers the whole buffer. Requires ``offs[-1] == x.shape[0]``.
    """
    R, E = x.shape[0], offs.numel()
    cap = R + E * (align - 1)  # static worst case: every group wastes align-1 rows
    o = offs.to(torch.int64)
    counts = torch.diff(o, prepend=o.new_zeros(1))
    padded = (counts + align - 1) // align * align
    pend = padded.cumsum(0)
    rows = torch.arange(R, device=x.device)
    seg = torch.searchsorted(o, rows, right=True).clamp_(max=E - 1)
    dest = (pend - padded).index_select(0, seg) + rows - (o - counts).index_select(0, seg)
    xp = x.new_zeros(cap, x.shape[1]).index_copy(0, dest, x)
    offs_p = torch.cat([pend[:-1], pend.new_full((1,), cap)]).to(torch.int32)
    return xp, offs_p, dest


def _gmm_loop(x, w_nk, counts):
    xs = x.split(counts)
    return torch.cat([F.linear(xs[e], w_nk[e]) for e in range(w_nk.shape[0])], dim=0)


def _get_streams(device, n):
    key = (device, n)
    if key not in _streams:
        _streams[key] = [torch.cuda.Stream(device=device) for _ in range(n)]
    return _streams[key]


def _gmm_multistream(x, w_nk, counts, n_streams):
    if x.device.type != "cuda":
        _note(("multistream", x.device.type), "grouped_gemm_backend=multistream: no CUDA streams on "
              f"{x.device.type}; running the per-expert loop on one stream")
        return _gmm_loop(x, w_nk, counts)
    cur = torch.cuda.current_stream(x.device)
    streams = _get_streams(x.device, n_streams)
    xs = x.split(counts)
    outs = [None] * len(xs)
    for s in streams:
        s.wait_stream(cur)
    for e, xe in enumerate(xs):
        s = streams[e % n_streams]
        with torch.cuda.stream(s):
            outs[e] = F.linear(xe, w_nk[e])
            xe.record_stream(s)
    for s in streams:
        cur.wait_stream(s)
    for o in outs:
        o.record_stream(cur)
    return torch.cat(outs, dim=0)


def _gmm_torch(x, w_nk, offs):
    key = (x.device.type, x.dtype)
    if hasattr(torch, "_grouped_mm") and _torch_gmm_ok.get(key, True):
        try:
            return torch._grouped_mm(x, w_nk.transpose(1, 2), offs=offs)
        except (RuntimeError, NotImplementedError) as err:
            _torch_gmm_ok[key] = False
            _note(("torch", key), f"torch._grouped_mm unavailable for {key}: {str(err).splitlines()[0]}; "
                  "falling back to the masked device-offset reference")
    elif not hasattr(torch, "_grouped_mm"):
        _note(("torch", "missing"), "torch._grouped_mm missing in this torch; using the masked reference")
    return gmm_masked_reference(x, w_nk, offs)


def _gmm_triton(x, w_nk, offs):
    if x.device.type != "cuda":
        # Triton kernels run on GPUs; kernels' own CPU path is a host-syncing reference, which would
        # put syncs back into the MoE path, so use the sync-free masked reference here instead.
        _note(("triton", x.device.type), f"grouped_gemm_backend=triton on {x.device.type}: Triton needs a GPU; "
              "using the masked device-offset reference")
        return gmm_masked_reference(x, w_nk, offs)
    try:
        from kernels import grouped_mm  # noqa: PLC0415  (lazy: kernels may be absent or incomplete)
    except Exception as err:  # ImportError or a kernels package without grouped_mm
        _note(("triton", "import"), f"kernels.grouped_mm unavailable ({err.__class__.__name__}: {err}); "
              "falling back to the masked device-offset reference")
        return gmm_masked_reference(x, w_nk, offs)
    return grouped_mm(x, w_nk.transpose(1, 2), offs)


def grouped_gemm(x: torch.Tensor, w_nk: torch.Tensor, *, backend: str, counts: list[int] | None = None,
                 offs: torch.Tensor | None = None, n_streams: int = 4, align: int = 0) -> torch.Tensor:
    """y[rows of group e] = x[rows of group e] @ w_nk[e].T. ``counts`` (host) or ``offs`` (device).

    ``align`` > 1 (torch/triton only): pad each group to a multiple of ``align`` rows first, for
    grouped-GEMM implementations that want aligned group starts (e.g. 8 rows = 16 bytes in bf16).
    """
    if counts is None and offs is None:
        raise ValueError("grouped_gemm needs counts or offs")
    if backend in ("loop", "multistream"):
        if counts is None:
            _note((backend, "device-offs"), f"grouped_gemm_backend={backend} with device-side counts "
                  "(sync_free_level>=2): running the masked per-expert reference (E x FLOPs, no host sync)")
            return gmm_masked_reference(x, w_nk, offs)
        if backend == "loop":
            return _gmm_loop(x, w_nk, counts)
        return _gmm_multistream(x, w_nk, counts, n_streams)
    if offs is None:
        offs = counts_to_offs(counts, x.device)  # host -> device copy, no device->host sync
    if align > 1:
        xp, offs_p, dest = align_groups(x, offs, align)
        return grouped_gemm(xp, w_nk, backend=backend, offs=offs_p).index_select(0, dest)
    if backend == "torch":
        return _gmm_torch(x, w_nk, offs)
    if backend == "triton":
        return _gmm_triton(x, w_nk, offs)
    raise ValueError(f"unknown grouped_gemm_backend {backend!r}")


def expert_swiglu(x, w13, w2, *, backend: str, counts=None, offs=None, n_streams: int = 4, align: int = 0):
    """SwiGLU expert MLP on a buffer grouped by expert."""
    if align > 1 and backend in ("torch", "triton"):  # pad once for both GEMMs
        if offs is None:
            offs = counts_to_offs(counts, x.device)
        xp, offs_p, dest = align_groups(x, offs, align)
        return expert_swiglu(xp, w13, w2, backend=backend, offs=offs_p).index_select(0, dest)
    h = grouped_gemm(x, w13, backend=backend, counts=counts, offs=offs, n_streams=n_streams)
    g, u = h.chunk(2, dim=-1)
    return grouped_gemm(F.silu(g) * u, w2, backend=backend, counts=counts, offs=offs, n_streams=n_streams)
