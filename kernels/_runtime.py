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


if INTERPRET:
    _patch_interpreter_index()

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
