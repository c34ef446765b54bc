"""Backend registry and per-shape tuner for the grouped GEMM (Primus-Turbo style).

A grouped GEMM runs three products, and the fastest implementation differs between them and
between shapes, so each *pass* picks its own backend:

====== ============================== =====================================
pass   computes                       arguments
====== ============================== =====================================
fwd    ``out[rows_i] = x_i @ w[i]``     ``(x [T,K], w [E,K,N], offs [E])``
dx     ``dx[rows_i] = dy_i @ w[i]^T``   ``(dy [T,N], w [E,K,N], offs [E])``
dw     ``dw[i] = x_i^T @ dy_i``         ``(x [T,K], dy [T,N], offs [E])``
====== ============================== =====================================

Backends (see :data:`BACKENDS`): ``triton`` (this package's kernels), ``torch``
(``torch._grouped_mm``: CUDA, bf16, sm_90+), ``loop`` (one matmul per expert; reads ``offs`` back
to the host), ``multistream`` (the loop spread over CUDA streams), ``reference`` (the plain
PyTorch specification).  :func:`tune` times every available backend on given shapes, separately
per pass, and writes the winners to a JSON cache keyed by (device name, dtype, shape bucket, pass)
in ``$TRACELENS_CACHE_DIR/kernels/`` (default ``~/.cache/tracelens/kernels/``).
:func:`select_backend` is what ``grouped_gemm_backend=auto`` uses: cached winner, else tune once.

:func:`grouped_mm` (``kernels.grouped_mm``) is the op itself: an autograd function that runs each pass on
its backend. The Triton kernels it dispatches to live in :mod:`kernels.grouped_gemm`, which imports
nothing from here.

May import: torch, triton, stdlib.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from . import grouped_gemm as g
from ._runtime import m_bucket, median_ms, triton_ok
from .reference import grouped_mm_ref

log = logging.getLogger("kernels")

PASSES = ("fwd", "dx", "dw")
CACHE_VERSION = 1

__all__ = [
    "grouped_mm", "GroupedMM",
    "PASSES", "BACKENDS", "Backend", "register_backend", "available_backends", "run_pass", "resolve_passes",
    "cache_dir", "cache_path", "cache_key", "load_cache", "clear_cache", "tune", "select_backend", "is_tuned",
    "tune_table",
    "balanced_offs",
]


# ----------------------------------------------------------------------------------------------- passes
def _bounds(offs) -> list[tuple[int, int]]:
    """(start, end) of each group.  ``offs`` is a device tensor (read back: a host sync, the loop
    backends need Python ints) or the same END offsets already on the host (a list/tuple of ints)."""
    ends = [int(v) for v in (offs if isinstance(offs, (list, tuple)) else offs.tolist())]
    return list(zip([0] + ends[:-1], ends))


def _loop_pass(pass_: str, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, streams=None) -> torch.Tensor:
    bounds = _bounds(offs)
    if pass_ == "dw":
        x, dy = a, b
        out = torch.zeros(len(bounds), x.shape[1], dy.shape[1], device=x.device, dtype=x.dtype)
    else:
        x, w = a, b
        n = w.shape[2] if pass_ == "fwd" else w.shape[1]
        out = torch.zeros(x.shape[0], n, device=x.device, dtype=x.dtype)
    cur = torch.cuda.current_stream() if streams else None
    for i, (s, e) in enumerate(bounds):
        if e <= s:
            continue
        if streams:
            st = streams[i % len(streams)]
            st.wait_stream(cur)
            ctx = torch.cuda.stream(st)
        else:
            ctx = _null
        with ctx:
            if pass_ == "fwd":
                torch.mm(a[s:e], b[i], out=out[s:e])
            elif pass_ == "dx":
                torch.mm(a[s:e], b[i].t(), out=out[s:e])
            else:
                torch.mm(a[s:e].t(), b[s:e], out=out[i])
    if streams:
        for st in streams:
            cur.wait_stream(st)
        for t in (a, b, out):
            t.record_stream(cur)
    return out


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_null = _Null()
_STREAMS: dict[tuple, list] = {}


def _multistream_pass(pass_, a, b, offs):
    if a.device.type != "cuda":
        return _loop_pass(pass_, a, b, offs)
    key = (a.device.index,)
    if key not in _STREAMS:
        _STREAMS[key] = [torch.cuda.Stream(device=a.device) for _ in range(4)]
    return _loop_pass(pass_, a, b, offs, streams=_STREAMS[key])


def _torch_pass(pass_, a, b, offs):
    offs = offs.to(torch.int32)
    if pass_ == "fwd":
        return torch._grouped_mm(a, b, offs=offs)
    if pass_ == "dx":
        return torch._grouped_mm(a, b.transpose(1, 2), offs=offs)
    return torch._grouped_mm(a.t(), b, offs=offs)


def _triton_pass(pass_, a, b, offs, out=None):
    if pass_ == "fwd":
        return g.grouped_mm_triton(a, b, offs)
    if pass_ == "dx":
        return g.grouped_mm_dx_triton(a, b, offs)
    return g.grouped_mm_dw_triton(a, b, offs, out=out)


def _triton_tma_pass(pass_, a, b, offs):
    if pass_ == "fwd":
        return g.grouped_mm_tma(a, b, offs)
    if pass_ == "dx":
        return g.grouped_mm_dx_tma(a, b, offs)
    return g.grouped_mm_dw_triton(a, b, offs)  # dW sums over a group's rows: needs exact row masking


def _tma_available(t: torch.Tensor) -> bool:
    if not (g.HAS_TMA and triton_ok(t)) or t.dtype not in (torch.bfloat16, torch.float16):
        return False
    return t.device.type != "cuda" or torch.cuda.get_device_capability(t.device) >= (9, 0)


def _reference_pass(pass_, a, b, offs):
    if pass_ == "fwd":
        return grouped_mm_ref(a, b, offs)
    if pass_ == "dx":
        return grouped_mm_ref(a, b.transpose(1, 2), offs)
    # dw[i] = x_i^T dy_i, built from the forward reference by autograd-free slicing
    out = torch.zeros(offs.shape[0], a.shape[1], b.shape[1], device=a.device, dtype=a.dtype)
    for i, (s, e) in enumerate(_bounds(offs)):
        if e > s:
            out[i] = (a[s:e].float().t() @ b[s:e].float()).to(a.dtype)
    return out


def _torch_available(t: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm") or t.device.type != "cuda" or t.dtype != torch.bfloat16:
        return False
    return torch.cuda.get_device_capability(t.device) >= (9, 0)


@dataclass(frozen=True)
class Backend:
    name: str
    fn: Callable  # fn(pass_, a, b, offs) -> Tensor
    available: Callable[[torch.Tensor], bool]
    syncs_host: bool
    doc: str


BACKENDS: dict[str, Backend] = {}


def register_backend(name: str, fn: Callable, available: Callable[[torch.Tensor], bool] = lambda t: True,
                     syncs_host: bool = False, doc: str = "") -> None:
    """Add (or replace) a grouped-GEMM backend: ``fn(pass_, a, b, offs)`` for ``pass_`` in :data:`PASSES`."""
    BACKENDS[name] = Backend(name, fn, available, syncs_host, doc)


register_backend("triton", _triton_pass, triton_ok, False, "Triton kernels of this package (sync-free)")
register_backend("triton_tma", _triton_tma_pass, _tma_available, False,
                 "Triton kernels with TMA tile loads for fwd/dX (sm_90+, bf16/fp16)")
register_backend("torch", _torch_pass, _torch_available, False, "torch._grouped_mm (CUDA bf16, sm_90+)")
register_backend("loop", _loop_pass, lambda t: True, True, "one torch.mm per expert (reads offs on the host)")
register_backend("multistream", _multistream_pass, lambda t: t.device.type == "cuda", True,
                 "per-expert torch.mm spread over 4 CUDA streams")
register_backend("reference", _reference_pass, lambda t: True, True, "plain-PyTorch specification (fp32 accumulate)")


def available_backends(t: torch.Tensor, names: Iterable[str] | None = None) -> list[str]:
    """Names of registered backends that can run on tensors like ``t`` (in registry order)."""
    names = list(BACKENDS) if names is None else list(names)
    return [n for n in names if n in BACKENDS and n != "reference" and BACKENDS[n].available(t)]


def run_pass(name: str, pass_: str, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor,
             host_offs: Sequence[int] | None = None) -> torch.Tensor:
    """Run one pass with backend ``name``.

    ``host_offs``: the same END offsets as Python ints, when the caller already has them on the
    host; the backends that need them there (``loop``, ``multistream``) then use them instead of
    reading ``offs`` back (no host sync).  Device backends ignore it.
    """
    if pass_ not in PASSES:
        raise ValueError(f"unknown pass {pass_!r}; expected one of {PASSES}")
    try:
        bk = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown grouped-GEMM backend {name!r}; registered: {sorted(BACKENDS)}") from None
    if host_offs is not None and bk.syncs_host:
        return bk.fn(pass_, a, b, list(host_offs))
    return bk.fn(pass_, a, b, offs)


def resolve_passes(backend, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> tuple[str, str, str]:
    """Turn a user's backend choice into a backend name per pass (fwd, dx, dw)."""
    if backend is None or backend == "triton":
        name = "triton" if triton_ok(x) else "reference"
        return (name, name, name)
    if isinstance(backend, (tuple, list)):
        if len(backend) != 3:
            raise ValueError("backend tuple must be (fwd, dx, dw)")
        return tuple(backend)  # type: ignore[return-value]
    if backend == "auto":
        T, K = x.shape
        N = w.shape[2]
        return tuple(select_backend(T, K, N, w.shape[0], x.dtype, x.device, p) for p in PASSES)  # type: ignore
    if backend not in BACKENDS:
        raise ValueError(f"unknown grouped-GEMM backend {backend!r}; registered: {sorted(BACKENDS)} or 'auto'")
    return (backend, backend, backend)


# ----------------------------------------------------------------------------------------------- the op
class GroupedMM(torch.autograd.Function):
    """Autograd wrapper: forward, dX and dW each by a Triton kernel (or the chosen backend)."""

    @staticmethod
    def forward(ctx, x, w, offs, backends=None, host_offs=None):
        fwd, dx, dw = resolve_passes(backends, x, w, offs)
        ctx.save_for_backward(x, w, offs)
        ctx.bk = (dx, dw)
        ctx.host_offs = host_offs
        return run_pass(fwd, "fwd", x, w, offs, host_offs)

    @staticmethod
    def backward(ctx, dy):
        x, w, offs = ctx.saved_tensors
        dx_b, dw_b = ctx.bk
        dy = dy.contiguous()
        dx = run_pass(dx_b, "dx", dy, w, offs, ctx.host_offs) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            if dw_b == "triton":  # write dW in w's own layout (e.g. a transposed nn.Linear weight)
                dw = g.grouped_mm_dw_triton(x, dy, offs, out=torch.empty_like(w))
            else:
                dw = run_pass(dw_b, "dw", x, dy, offs, ctx.host_offs)
        return dx, dw, None, None, None


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, backend=None, host_offs=None) -> torch.Tensor:
    """Autograd-capable grouped GEMM (the kernels: :mod:`kernels.grouped_gemm`).

    ``backend``: ``None`` / ``"triton"`` (Triton where it can run, else the reference), a registered
    backend name (``"loop"``, ``"multistream"``, ``"torch"``), ``"auto"`` (tuned per pass, see
    :func:`select_backend`), or a ``(fwd, dx, dw)`` tuple of names.  ``host_offs``: ``offs`` as
    Python ints when the caller already has them on the host, so that the ``loop`` and
    ``multistream`` passes need not read ``offs`` back (see :func:`run_pass`).
    """
    g.check_operands(x, w, offs)
    if backend is None and not triton_ok(x):
        return grouped_mm_ref(x, w, offs)
    return GroupedMM.apply(x, w, offs, backend, None if host_offs is None else tuple(int(v) for v in host_offs))


# ----------------------------------------------------------------------------------------------- cache
def cache_dir() -> Path:
    """``$TRACELENS_CACHE_DIR/kernels`` or ``~/.cache/tracelens/kernels``."""
    root = os.environ.get("TRACELENS_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "tracelens"
    return base / "kernels"


def cache_path() -> Path:
    return cache_dir() / "grouped_mm.json"


@functools.lru_cache(maxsize=None)
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_name(device: torch.device | str) -> str:
    """The device's marketing name for CUDA (e.g. ``NVIDIA H100 80GB HBM3``), else its type."""
    device = torch.device(device)
    if device.type == "cuda":
        return _cuda_name(device.index if device.index is not None else torch.cuda.current_device())
    return device.type


def cache_key(device: torch.device | str, dtype: torch.dtype, T: int, K: int, N: int, E: int, pass_: str) -> str:
    """(device name, dtype, shape bucket, pass) as one string.  Rows are bucketed to a power of two;
    K, N, E are the model's fixed dimensions and stay exact."""
    return f"{device_name(device)}|{str(dtype).replace('torch.', '')}|T{m_bucket(T)}|K{K}|N{N}|E{E}|{pass_}"


def load_cache() -> dict:
    p = cache_path()
    try:
        doc = json.loads(p.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict) or doc.get("version") != CACHE_VERSION:
        return {}
    return doc.get("entries", {})


def _store(entries: dict) -> None:
    p = cache_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    merged = load_cache()  # merge: several ranks may tune at once
    merged.update(entries)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=".grouped_mm.", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump({"version": CACHE_VERSION, "entries": merged}, f, indent=1, sort_keys=True)
    os.replace(tmp, p)


def clear_cache() -> None:
    try:
        cache_path().unlink()
    except FileNotFoundError:
        pass
    _MEMO.clear()
    _TIMES.clear()
    _CHOICE_MEMO.clear()


_MEMO: dict[str, str] = {}  # cache key -> winning backend (this process)
_TIMES: dict[str, dict] = {}  # cache key -> {backend: ms or None} from this process's tunes


# ----------------------------------------------------------------------------------------------- tuner
def balanced_offs(T: int, E: int, device, skew: float = 0.0, seed: int = 0) -> torch.Tensor:
    """Cumulative END offsets splitting ``T`` rows over ``E`` experts: even, or Zipf-like with ``skew``."""
    if skew <= 0:
        counts = torch.full((E,), T // E, dtype=torch.int64)
        counts[: T % E] += 1
    else:
        g = torch.Generator().manual_seed(seed)
        p = torch.arange(1, E + 1, dtype=torch.float64) ** (-skew)
        p = p[torch.randperm(E, generator=g)]
        counts = torch.floor(p / p.sum() * T).long()
        counts[0] += T - counts.sum()
    return torch.cumsum(counts, 0).to(torch.int32).to(device)


def _inputs(pass_, T, K, N, E, dtype, device, offs):
    g = torch.Generator(device="cpu").manual_seed(0)
    mk = lambda *s: (torch.randn(*s, generator=g) * 0.1).to(device=device, dtype=dtype)  # noqa: E731
    if pass_ == "fwd":
        return mk(T, K), mk(E, K, N), offs
    if pass_ == "dx":
        return mk(T, N), mk(E, K, N), offs
    return mk(T, K), mk(T, N), offs


def tune(T: int, K: int, N: int, E: int, dtype: torch.dtype = torch.bfloat16, device="cuda",
         passes: Sequence[str] = PASSES, backends: Sequence[str] | None = None, warmup: int = 3, reps: int = 10,
         offs: torch.Tensor | None = None, save: bool = True, check: bool = True) -> list[dict]:
    """Time every available backend on one shape, per pass; cache and return one row per (pass, backend).

    A backend that raises, or (with ``check``) disagrees with the reference beyond dtype tolerance,
    is recorded with ``ms=None`` and an ``error`` and never wins.
    """
    device = torch.device(device)
    offs = balanced_offs(T, E, device) if offs is None else offs.to(device=device, dtype=torch.int32)
    probe = torch.empty(0, device=device, dtype=dtype)
    names = available_backends(probe, backends)
    rows, winners = [], {}
    flops = 2.0 * T * K * N
    tol = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 5e-2}.get(dtype, 5e-2)
    for p in passes:
        a, b, o = _inputs(p, T, K, N, E, dtype, device, offs)
        ref = None
        if check:
            ref = _reference_pass(p, a, b, o).float()
            scale = ref.abs().max().item() + 1e-6
        best = None
        for name in names:
            row = {"op": "grouped_mm", "pass": p, "T": T, "K": K, "N": N, "E": E,
                   "dtype": str(dtype).replace("torch.", ""), "device": device_name(device), "backend": name,
                   "ms": None, "tflops": None, "winner": False, "error": None}
            try:
                if check:
                    got = run_pass(name, p, a, b, o).float()
                    err = (got[: ref.shape[0]] - ref).abs().max().item() / scale if ref.numel() else 0.0
                    if err > tol:
                        raise RuntimeError(f"mismatch vs reference: rel err {err:.3g} > {tol}")
                ms = median_ms(lambda: run_pass(name, p, a, b, o), warmup, reps, device)
                row["ms"] = ms
                row["tflops"] = flops / (ms * 1e-3) / 1e12 if ms > 0 else None
                if best is None or ms < best[1]:
                    best = (name, ms)
            except Exception as exc:  # a backend that cannot run this shape simply loses
                row["error"] = f"{type(exc).__name__}: {exc}"[:200]
            rows.append(row)
        if best is not None:
            winners[cache_key(device, dtype, T, K, N, E, p)] = {
                "backend": best[0], "ms": best[1],
                "times_ms": {r["backend"]: r["ms"] for r in rows if r["pass"] == p},
                "tuned_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            for r in rows:
                if r["pass"] == p and r["backend"] == best[0]:
                    r["winner"] = True
    if winners:
        _MEMO.update({k: v["backend"] for k, v in winners.items()})
        _TIMES.update({k: v["times_ms"] for k, v in winners.items()})
        for mk in [mk for mk in _CHOICE_MEMO if mk[0] in winners]:
            del _CHOICE_MEMO[mk]
        if save:
            _store(winners)
    return rows


def select_backend(T: int, K: int, N: int, E: int, dtype: torch.dtype, device, pass_: str,
                   tune_if_missing: bool = True, candidates: Sequence[str] | None = None) -> str:
    """The backend to use for one pass on this shape: cached winner, else tune now (once), else a default.

    The default (no cache entry and ``tune_if_missing=False``) is ``triton`` where it can run, else
    ``torch`` where it can, else ``loop``.

    ``candidates``: choose only among these names (e.g. the backends that never read the group
    sizes back to the host, for a sync-free caller).  The choice is the fastest candidate in the
    cache entry's ``times_ms`` (a tune always times every available backend, so the entry holds
    them all); on a miss the shape is tuned as usual, and without timings the default order
    applies to the candidates.  Raises ``ValueError`` when no candidate can run here.
    """
    key = cache_key(device, dtype, T, K, N, E, pass_)
    if candidates is not None:
        return _select_among(key, T, K, N, E, dtype, device, pass_, tune_if_missing, list(candidates))
    hit = _MEMO.get(key)
    if hit is None:
        entry = load_cache().get(key)
        if entry is not None and entry.get("backend") in BACKENDS:
            hit = entry["backend"]
        elif tune_if_missing:
            log.info("tuning grouped_mm backends for %s", key)
            tune(m_bucket(T), K, N, E, dtype, device, passes=(pass_,))
            hit = _MEMO.get(key)
        if hit is not None:
            _MEMO[key] = hit
    if hit is None:
        probe = torch.empty(0, device=device, dtype=dtype)
        hit = next(n for n in ("triton", "torch", "loop") if BACKENDS[n].available(probe))
    return hit


def is_tuned(T: int, K: int, N: int, E: int, dtype: torch.dtype, device, pass_: str) -> bool:
    """Whether this shape bucket and pass has timings (tuned in this process, or in the cache file)."""
    key = cache_key(device, dtype, T, K, N, E, pass_)
    return key in _TIMES or key in load_cache()


_CHOICE_MEMO: dict[tuple, str] = {}


def _select_among(key, T, K, N, E, dtype, device, pass_, tune_if_missing, candidates) -> str:
    probe = torch.empty(0, device=device, dtype=dtype)
    allowed = available_backends(probe, candidates)
    if not allowed:
        raise ValueError(f"none of the grouped-GEMM backends {candidates} can run on "
                         f"{device_name(device)} {str(dtype).replace('torch.', '')}")
    memo_key = (key, tuple(allowed))
    if memo_key in _CHOICE_MEMO:
        return _CHOICE_MEMO[memo_key]
    times = (_TIMES.get(key) or load_cache().get(key, {}).get("times_ms") or {})
    timed = {n: times[n] for n in allowed if isinstance(times.get(n), (int, float))}
    if not timed and tune_if_missing and len(allowed) > 1:
        log.info("tuning grouped_mm backends for %s", key)
        tune(m_bucket(T), K, N, E, dtype, device, passes=(pass_,))
        times = _TIMES.get(key) or {}
        timed = {n: times[n] for n in allowed if isinstance(times.get(n), (int, float))}
    if timed:
        choice = min(timed, key=timed.get)
    else:
        order = ["triton", "torch", "loop"] + [n for n in allowed if n not in ("triton", "torch", "loop")]
        choice = next(n for n in order if n in allowed)
    _CHOICE_MEMO[memo_key] = choice
    return choice


def tune_table(shapes: Sequence[tuple[int, int, int, int]] | None = None, dtype: torch.dtype | str = "bfloat16",
               device=None, passes: Sequence[str] = PASSES, backends: Sequence[str] | None = None,
               warmup: int = 3, reps: int = 10, save: bool = True) -> list[dict]:
    """Tune each ``(T, K, N, E)`` shape and return rows for the CLI to print.

    Defaults: on CUDA the DeepSeek-V2-Lite expert GEMMs (hidden 2048, ffn 1408, E=64: up-projection
    K=2048 N=2816, down-projection K=1408 N=2048) for 4K and 16K tokens x top-6; elsewhere a tiny shape.  Each row: op, pass, T, K, N, E, dtype, device,
    backend, ms, tflops, winner, error.
    """
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if shapes is None:
        if torch.device(device).type == "cuda":
            # expert up-projection (gate and up fused: N = 2 * 1408) and down-projection
            shapes = [(4096 * 6, 2048, 2816, 64), (4096 * 6, 1408, 2048, 64),
                      (16384 * 6, 2048, 2816, 64), (16384 * 6, 1408, 2048, 64)]
        else:
            shapes = [(64, 32, 32, 4)]
    rows: list[dict] = []
    for T, K, N, E in shapes:
        rows += tune(T, K, N, E, dtype, device, passes=passes, backends=backends, warmup=warmup, reps=reps,
                     save=save)
    return rows
