"""Where Triton can run: availability, interpreter mode, and small launch helpers.

Triton decides at decoration time (``@triton.jit``) whether a kernel is compiled for a GPU or
run by its CPU interpreter (``TRITON_INTERPRET=1``), so the mode is fixed when this package is
first imported.  :func:`triton_ok` tells an op whether its Triton kernel can take given tensors:
CUDA tensors always (when Triton is installed), CPU tensors only under the interpreter.

May import: torch, triton, stdlib.
"""

from __future__ import annotations

import logging
import os
import statistics
import time

import torch

log = logging.getLogger("kernels")

try:  # pragma: no cover - exercised by the import itself
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAS_TRITON = True
    _IMPORT_ERROR: str | None = None
except Exception as exc:  # ImportError, or a broken install
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    HAS_TRITON = False
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"


def _interpret_flag() -> bool:
    if not HAS_TRITON:
        return False
    try:
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except Exception:  # older triton without knobs
        return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


#: True when the kernels of this package were built for Triton's CPU interpreter.
INTERPRET: bool = _interpret_flag()


def _patch_interpreter_index() -> None:
    """Compatibility shim for Triton's interpreter with NumPy >= 2.4 (interpreter mode only).

    The interpreter stores scalars as 1-element arrays and implements ``__index__`` (used by
    ``range(n)`` on a runtime value, i.e. every data-dependent loop) as ``int(array)``, which NumPy
    2.4 rejects for arrays with ``ndim > 0``.  We wrap the interpreter's tensor patching so that
    ``__index__`` goes through ``.item()``.  Harmless where NumPy still accepts the old form.
    """
    try:
        from triton.runtime import interpreter as _interp
    except Exception:
        return
    orig = getattr(_interp, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_tracelens_shim", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._tracelens_shim = True  # type: ignore[attr-defined]
    _interp._patch_lang_tensor = patched


def _patch_interpreter_bf16_rounding() -> None:
    """Make the interpreter round fp32 -> bf16 to nearest-even, as the GPU does (interpreter mode only).

    Triton 3.6's interpreter casts fp32 to bf16 (``.to(tl.bfloat16)``, or a store of an fp32 value
    into a bf16 tensor) by dropping the low 16 bits, i.e. rounding toward zero, so every bf16 result
    of a kernel was up to one bf16 ulp off what the compiled kernel (and PyTorch) gives.  We route
    that one conversion through the standard integer RTNE formula; NaNs stay quiet NaNs.
    """
    try:
        import numpy as np
        from triton.runtime import interpreter as _interp
    except Exception:
        return
    builder = getattr(_interp, "InterpreterBuilder", None)
    orig = getattr(builder, "cast_impl", None)
    if orig is None or getattr(orig, "_tracelens_shim", False):
        return

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32)
            rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
            nan = np.isnan(src.data)
            if np.any(nan):
                rounded = np.where(nan, ((bits >> 16) | 0x40).astype(np.uint16), rounded)
            return _interp.TensorHandle(rounded.reshape(np.shape(src.data)), dst_type.scalar)
        return orig(self, src, dst_type)

    cast_impl._tracelens_shim = True  # type: ignore[attr-defined]
    builder.cast_impl = cast_impl


def _patch_interpreter_nested_calls() -> None:
    """Patch ``triton.language`` once per launch instead of on every nested ``@triton.jit`` call.

    A kernel launch (``GridExecutor``) patches the language modules that the kernel's globals name
    (``triton.language``) for the interpreter.  Every call of a ``@triton.jit`` function *inside* the
    kernel -- Triton's own ``tl.cdiv``, ``tl.sum``, ``tl.cumsum``... live in modules that name
    ``triton.language.core`` -- patches its modules again, scanning them with ``inspect.getmembers``,
    once per call per program: about a third of the interpreter's time in the grouped GEMM.  Those
    patches are never undone by the interpreter, so repeating them within one launch changes
    nothing: we let the first call per set of modules per launch patch, and skip the repeats.
    """
    try:
        from triton.runtime import interpreter as _interp
    except Exception:
        return
    grid_cls = getattr(_interp, "GridExecutor", None)
    fn_cls = getattr(_interp, "InterpretedFunction", None)
    if grid_cls is None or fn_cls is None or getattr(fn_cls.__call__, "_tracelens_shim", False):
        return
    state = {"depth": 0, "patched": set()}
    grid_call, fn_call = grid_cls.__call__, fn_cls.__call__
    lang_modules = (tl, tl.core)

    def run_grid(self, *args, **kwargs):
        if state["depth"] == 0:
            state["patched"] = set()
        state["depth"] += 1
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            state["depth"] -= 1

    def device_call(self, *args, **kwargs):
        langs = self.__dict__.get("_tracelens_langs")
        if langs is None:
            langs = frozenset(id(v) for v in self.fn.__globals__.values() if any(v is m for m in lang_modules))
            self.__dict__["_tracelens_langs"] = langs
        if state["depth"] == 0 or langs not in state["patched"]:
            state["patched"].add(langs)
            return fn_call(self, *args, **kwargs)  # patches, then runs
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise _interp.InterpreterError(repr(e)) from e

    device_call._tracelens_shim = True  # type: ignore[attr-defined]
    grid_cls.__call__ = run_grid
    fn_cls.__call__ = device_call


if INTERPRET:
    _patch_interpreter_index()
    _patch_interpreter_bf16_rounding()
    _patch_interpreter_nested_calls()

_warned = False


def triton_ok(t: torch.Tensor) -> bool:
    """Whether this package's Triton kernels can run on tensors living where ``t`` lives."""
    global _warned
    if HAS_TRITON and (t.device.type == "cuda" or (INTERPRET and t.device.type == "cpu")):
        return True
    if not _warned:  # import-time warning covers a missing triton; this covers CPU without the interpreter
        if HAS_TRITON:
            log.info("Triton cannot run on %s tensors (set TRITON_INTERPRET=1 before importing "
                     "kernels to use its CPU interpreter); using the PyTorch reference ops", t.device.type)
        _warned = True
    return False


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def m_bucket(m: int) -> int:
    """Shape bucket for a row count: the next power of two (at least 16)."""
    return max(16, next_pow2(m))


def median_ms(fn, warmup: int, reps: int, device) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` runs after ``warmup``: CUDA events around each run on
    a CUDA device (the kernel time, no host overhead between runs), ``perf_counter`` elsewhere.
    The one timer of the package, the tuner, ``calibrate`` and ``benchmarks/bench_kernels.py``."""
    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize(device)
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
