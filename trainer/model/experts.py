"""Routed-expert SwiGLU MLP over a token buffer grouped by expert, with five GEMM backends.

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
* ``triton``: ``kernels.grouped_mm(x, w, offs)`` (imported lazily) wherever ``kernels.triton_ok``:
  CUDA tensors, or CPU tensors when ``kernels`` was imported with ``TRITON_INTERPRET=1`` (Triton's
  CPU interpreter runs the same kernels, slowly). Elsewhere the sync-free masked reference (logged).
* ``auto``: a backend per pass (forward, dX, dW) from ``kernels.select_backend``: the winner of the
  tuner's on-disk cache for this shape bucket. Only backends that can run here are considered, and
  with device offsets (levels 2-3) only those that never read the group sizes back to the host.
  A shape is never tuned inside a forward: :func:`pretune` (called by the trainer before its first
  step, or ``tracelens kernels tune --config``) does it, and a miss takes the default order
  (triton, torch, loop). The choices are kept in :data:`AUTO_CHOICES` for the run manifest.
  With host counts (levels 0-1) the ``loop``/``multistream`` passes use them (no extra sync); the
  kernels' multistream backend uses 4 streams (``multistream_num_streams`` is not consulted).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from moespec.backends import GROUPED_BACKENDS, PER_EXPERT_BACKENDS

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
    return torch.tensor(_cumsum(counts), dtype=torch.int32, device=device)


def gmm_masked_reference(x: torch.Tensor, w_nk: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Device-offset grouped GEMM reference without host syncs: y[r] = x[r] @ w_nk[e(r)].T.

    Rows at or beyond ``offs[-1]`` get zeros. Costs E full-buffer GEMMs.
    """
    rows = torch.arange(x.shape[0], device=x.device, dtype=offs.dtype)
    seg = torch.searchsorted(offs, rows, right=True)  # expert of each row; E for rows past the end
    y = x.new_zeros(x.shape[0], w_nk.shape[1])
    for e, w in enumerate(w_nk.unbind(0)):  # unbind, not w_nk[e]: see _gmm_loop
        y = torch.where((seg == e).unsqueeze(1), F.linear(x, w), y)
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
    # unbind, not w_nk[e]: the backward of E selects builds E zero-filled [E, N, K] gradients and adds
    # them up (E^2 x the weight's size in fresh memory: page faults, noisy timings); unbind's backward
    # stacks the E per-expert gradients once.
    xs = x.split(counts)
    return torch.cat([F.linear(xe, w) for xe, w in zip(xs, w_nk.unbind(0), strict=True)], dim=0)


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
    for e, (xe, w) in enumerate(zip(xs, w_nk.unbind(0), strict=True)):  # unbind: see _gmm_loop
        s = streams[e % n_streams]
        with torch.cuda.stream(s):
            outs[e] = F.linear(xe, w)
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


def _kernels():
    """The ``kernels`` package, imported on first use; None (noted once) when it cannot be imported."""
    try:
        import kernels  # noqa: PLC0415  (lazy: needs triton, and decides interpreter mode at import)
    except Exception as err:  # ImportError, or a kernels package that fails to import
        _note(("kernels", "import"), f"the kernels package is unavailable ({err.__class__.__name__}: {err}); "
              "using the PyTorch paths")
        return None
    return kernels


def kernels_can_run(x: torch.Tensor) -> bool:
    """Whether the Triton kernels of ``kernels`` can take tensors like ``x`` (CUDA, or CPU under the
    interpreter)."""
    k = _kernels()
    return k is not None and k.triton_ok(x)


def _gmm_triton(x, w_nk, offs):
    if not kernels_can_run(x):
        # kernels' own fallback is a host-syncing reference, which would put syncs back into the MoE
        # path, so use the sync-free masked reference here instead.
        _note(("triton", x.device.type), f"grouped_gemm_backend=triton on {x.device.type}: Triton runs on CUDA, or "
              "on CPU under its interpreter (TRITON_INTERPRET=1 before kernels is imported); using the masked "
              "device-offset reference")
        record_use("grouped_gemm", "masked device-offset reference (Triton cannot run here)")
        return gmm_masked_reference(x, w_nk, offs)
    from kernels import grouped_mm  # noqa: PLC0415

    record_use("grouped_gemm", "kernels.grouped_mm (Triton" + (", CPU interpreter)" if x.device.type == "cpu" else ")"))
    return grouped_mm(x, w_nk.transpose(1, 2), offs)


# ---------------------------------------------------------------------------------------------- auto
#: (rows bucket, K, N, E, dtype, device, sync_free) -> {"fwd", "dx", "dw", "source", ...}: what
#: grouped_gemm_backend=auto chose in this process, for the run manifest.
AUTO_CHOICES: dict[tuple, dict] = {}


def _auto_candidates(probe: torch.Tensor, sync_free: bool) -> list[str]:
    from kernels import backends as B  # noqa: PLC0415

    names = B.available_backends(probe)
    return [n for n in names if not (sync_free and B.BACKENDS[n].syncs_host)]


def auto_backends(T: int, K: int, N: int, E: int, dtype: torch.dtype, device, sync_free: bool) -> dict:
    """The backend per pass for one expert GEMM shape (``x [T,K] x w [E,K,N]``), memoised per shape
    bucket, without tuning (see :func:`pretune`). Returns the :data:`AUTO_CHOICES` record: ``fwd``,
    ``dx``, ``dw`` (backend names, or ``masked_reference`` when no backend fits) and ``source``
    (``cache``: a tuned winner; ``default``: the shape was never tuned; ``only``: a single candidate).
    """
    from kernels import backends as B  # noqa: PLC0415
    from kernels._runtime import m_bucket  # noqa: PLC0415

    device = torch.device(device)
    key = (m_bucket(T), K, N, E, str(dtype).replace("torch.", ""), str(device), sync_free)
    rec = AUTO_CHOICES.get(key)
    if rec is not None:
        return rec
    cands = _auto_candidates(torch.empty(0, device=device, dtype=dtype), sync_free)
    rec = {"rows_bucket": key[0], "K": K, "N": N, "E": E, "dtype": key[4], "device": B.device_name(device),
           "sync_free": sync_free, "candidates": cands}
    if not cands:
        rec.update(fwd="masked_reference", dx="masked_reference", dw="masked_reference", source="none available")
    else:
        tuned = [B.is_tuned(T, K, N, E, dtype, device, p) for p in B.PASSES]
        for p in B.PASSES:
            rec[p] = B.select_backend(T, K, N, E, dtype, device, p, tune_if_missing=False, candidates=cands)
        rec["source"] = "only" if len(cands) == 1 else ("cache" if all(tuned) else "default")
    AUTO_CHOICES[key] = rec
    if rec["source"] in ("default", "none available"):
        _note(("auto", key), f"grouped_gemm_backend=auto: shape T~{key[0]} K{K} N{N} E{E} {key[4]} "
              + ("has no sync-free backend here; using the masked device-offset reference" if not cands else
                 "was not tuned; using the default order (triton, torch, loop). Run `tracelens kernels tune "
                 "--config CFG` or let the trainer pre-tune"))
    return rec


def pretune(shapes, dtype: torch.dtype, device, sync_free: bool, warmup: int | None = None,
            reps: int | None = None) -> list[dict]:
    """Tune ``shapes`` (``(T, K, N, E)`` tuples) for ``auto`` where the cache has no entry yet, then
    resolve them (:func:`auto_backends`). Never call it inside CUDA-graph capture. Returns the
    choice records. On CPU (the interpreter) the timing runs are kept to one repeat."""
    from kernels import backends as B  # noqa: PLC0415

    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("pretune inside CUDA-graph capture: tune before capturing")
    warmup = (3 if device.type == "cuda" else 0) if warmup is None else warmup
    reps = (10 if device.type == "cuda" else 1) if reps is None else reps
    cands = _auto_candidates(torch.empty(0, device=device, dtype=dtype), sync_free)
    out = []
    for T, K, N, E in shapes:
        if len(cands) > 1:
            missing = [p for p in B.PASSES if not B.is_tuned(T, K, N, E, dtype, device, p)]
            if missing:
                log.info("grouped_gemm_backend=auto: tuning T=%d K=%d N=%d E=%d %s", T, K, N, E, dtype)
                B.tune(T, K, N, E, dtype, device, passes=missing, warmup=warmup, reps=reps)
        out.append(auto_backends(T, K, N, E, dtype, device, sync_free))
    return out


def auto_is_sync_free(cfg: dict) -> bool:
    """Whether ``auto`` must pick sync-free backends: device offsets (levels 2-3), or aligned groups
    (padding works on device offsets at every level)."""
    return cfg["sync_free_level"] >= 2 or cfg["grouped_gemm_align"] > 1


def pretune_config(cfg: dict, device) -> list[dict]:
    """``grouped_gemm_backend=auto``: tune the config's expert GEMM shapes (moespec/gemm_shapes.py) that
    the cache lacks, before the first step. Under EP at levels 0-2 the received rows vary, so on a GPU
    the buckets of 0.75x and 1.25x the average are tuned too (not on the CPU interpreter, where
    tuning only exercises the mechanism). Returns the choice records."""
    from moespec.gemm_shapes import expert_gemm_dtype, expert_gemm_shapes  # noqa: PLC0415

    if cfg["grouped_gemm_backend"] != "auto" or _kernels() is None:
        return []
    shapes = []
    for g in expert_gemm_shapes(cfg):
        rows = [g.T]
        if cfg["ep"] > 1 and cfg["sync_free_level"] <= 2 and torch.device(device).type == "cuda":
            rows += [max(1, int(g.T * 0.75)), int(g.T * 1.25)]
        shapes += [(t, g.K, g.N, g.E) for t in rows]
    return pretune(shapes, getattr(torch, expert_gemm_dtype(cfg)), device, auto_is_sync_free(cfg))


#: op -> what ran it in this process ("kernels.fused_router", "masked reference", ...), for the manifest.
KERNEL_USE: dict[str, str] = {}


def record_use(op: str, what: str) -> None:
    KERNEL_USE[op] = what


def kernels_record(cfg: dict) -> dict:
    """The manifest's ``kernels`` section: which implementation ran each op, and auto's choices per pass."""
    return {"grouped_gemm_backend": cfg["grouped_gemm_backend"], "use_triton_kernels": cfg["use_triton_kernels"],
            "expert_swiglu": cfg.get("expert_swiglu", "torch"),
            "ops": dict(KERNEL_USE), "auto_choices": list(AUTO_CHOICES.values())}


def reset_records() -> None:
    """Forget the choices and uses recorded so far (each training run records its own)."""
    AUTO_CHOICES.clear()
    KERNEL_USE.clear()


def _gmm_auto(x, w_nk, offs, counts):
    sync_free = counts is None
    if _kernels() is None:  # noted by _kernels(): no tuner without the kernels package
        record_use("grouped_gemm", "auto without kernels: " + ("masked reference" if sync_free else "loop"))
        return gmm_masked_reference(x, w_nk, offs) if sync_free else _gmm_loop(x, w_nk, counts)
    E, N, K = w_nk.shape
    rec = auto_backends(x.shape[0], K, N, E, x.dtype, x.device, sync_free)
    if rec["fwd"] == "masked_reference":
        record_use("grouped_gemm", "auto: masked device-offset reference (no sync-free backend here)")
        return gmm_masked_reference(x, w_nk, offs)
    from kernels import grouped_mm  # noqa: PLC0415

    record_use("grouped_gemm", "auto: kernels.grouped_mm with a backend per pass (auto_choices)")

    host_offs = None if counts is None else _cumsum(counts)
    return grouped_mm(x, w_nk.transpose(1, 2), offs, backend=(rec["fwd"], rec["dx"], rec["dw"]), host_offs=host_offs)


def _cumsum(counts: list[int]) -> list[int]:
    ends, s = [], 0
    for c in counts:
        s += c
        ends.append(s)
    return ends


def grouped_gemm(x: torch.Tensor, w_nk: torch.Tensor, *, backend: str, counts: list[int] | None = None,
                 offs: torch.Tensor | None = None, n_streams: int = 4, align: int = 0) -> torch.Tensor:
    """y[rows of group e] = x[rows of group e] @ w_nk[e].T. ``counts`` (host) or ``offs`` (device).

    ``align`` > 1 (torch/triton/auto only): pad each group to a multiple of ``align`` rows first, for
    grouped-GEMM implementations that want aligned group starts (e.g. 8 rows = 16 bytes in bf16).
    """
    if counts is None and offs is None:
        raise ValueError("grouped_gemm needs counts or offs")
    if backend in PER_EXPERT_BACKENDS:
        if counts is None:
            _note((backend, "device-offs"), f"grouped_gemm_backend={backend} with device-side counts "
                  "(sync_free_level>=2): running the masked per-expert reference (E x FLOPs, no host sync)")
            return gmm_masked_reference(x, w_nk, offs)
        if backend == "loop":
            return _gmm_loop(x, w_nk, counts)
        return _gmm_multistream(x, w_nk, counts, n_streams)
    host_counts = counts
    if offs is None:
        offs = counts_to_offs(counts, x.device)  # host -> device copy, no device->host sync
    if align > 1:
        xp, offs_p, dest = align_groups(x, offs, align)
        return grouped_gemm(xp, w_nk, backend=backend, offs=offs_p).index_select(0, dest)
    if backend == "torch":
        return _gmm_torch(x, w_nk, offs)
    if backend == "triton":
        return _gmm_triton(x, w_nk, offs)
    if backend == "auto":
        return _gmm_auto(x, w_nk, offs, host_counts)
    raise ValueError(f"unknown grouped_gemm_backend {backend!r}")


def swiglu_problem(device) -> str | None:
    """Why ``expert_swiglu=triton`` cannot run on ``device`` (None: it can): the fused kernel is Triton, which
    runs on CUDA, or on a CPU under its interpreter (``TRITON_INTERPRET=1`` before ``kernels`` is imported)."""
    probe = torch.empty(0, device=device)
    k = _kernels()
    if k is None:
        return "needs the kernels package (Triton), which cannot be imported here"
    if not k.HAS_TRITON:
        return "needs triton, which is not importable here (pip install triton)"
    if kernels_can_run(probe):
        return None
    return (f"needs Triton on this run's device ({probe.device.type}): CUDA, or a CPU with TRITON_INTERPRET=1 "
            "(Triton's interpreter, for tests)")


def swiglu_activation(h: torch.Tensor, impl: str = "torch", n_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of ``h = [gate | up]`` [R, 2F]: eager PyTorch (``torch``), or ``kernels.swiglu``
    (``triton``: one kernel each way; the run was refused at start where it cannot run). ``n_rows`` (device
    scalar): the Triton kernels compute only the rows before it (a padded EP buffer); eager computes all."""
    if impl == "triton":
        from kernels import swiglu  # noqa: PLC0415

        where = ", CPU interpreter)" if h.device.type == "cpu" else ")"
        record_use("expert_swiglu", "kernels.swiglu (Triton" + where)
        return swiglu(h, n_rows)
    g, u = h.chunk(2, dim=-1)
    return F.silu(g) * u


def expert_swiglu(x, w13, w2, *, backend: str, counts=None, offs=None, n_streams: int = 4, align: int = 0,
                  swiglu: str = "torch"):
    """SwiGLU expert MLP on a buffer grouped by expert; ``swiglu``: the activation's implementation
    (:func:`swiglu_activation`)."""
    if align > 1 and backend in GROUPED_BACKENDS:  # pad once for both GEMMs
        if offs is None:
            offs = counts_to_offs(counts, x.device)
        xp, offs_p, dest = align_groups(x, offs, align)
        return expert_swiglu(xp, w13, w2, backend=backend, offs=offs_p, swiglu=swiglu).index_select(0, dest)
    h = grouped_gemm(x, w13, backend=backend, counts=counts, offs=offs, n_streams=n_streams)
    # rows past offs[-1] (a padded EP buffer's tail) belong to no expert: the fused activation skips them
    n_rows = offs[-1:] if offs is not None and backend in GROUPED_BACKENDS else None
    return grouped_gemm(swiglu_activation(h, swiglu, n_rows), w2, backend=backend, counts=counts, offs=offs,
                        n_streams=n_streams)
