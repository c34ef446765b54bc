"""kernels: Triton kernels for MoE training, each with a plain-PyTorch reference.

May import: torch, triton.

Public API (details in docs/kernels.md; the specification of each op is its function in
:mod:`kernels.reference`):

- :func:`grouped_mm` ``(x [T,K], w [E,K,N], offs int32 [E]) -> [T,N]``: one GEMM per expert over
  contiguous row groups given by cumulative END offsets (like ``torch._grouped_mm``),
  autograd-capable, device-side offsets (no host sync).  ``backend=`` picks an implementation per
  pass (``"triton"``, ``"torch"``, ``"loop"``, ``"multistream"``, ``"auto"``); see
  :mod:`kernels.backends` for the registry, the tuner and its on-disk cache
  (:func:`select_backend`, :func:`tune`, :func:`tune_table`).
- :func:`permute` / :func:`unpermute`: sync-free expert-sorted token order, device counts and
  offsets, gather and routing-weighted combine, autograd-capable. :func:`gather_rows` builds any
  buffer of token copies (padding rows: index -1) in one gather whose backward is a gather-reduce.
- :func:`fused_router`: logits -> softmax/sigmoid -> (group-limited) top-k -> weights + aux-loss
  statistics in one kernel (and one for the backward).
- :func:`linear_cross_entropy`: ``hidden @ weight.T`` fused with cross-entropy in row chunks,
  never materialising the full logits.
- :func:`swiglu` ``(h [R, 2F]) -> [R, F]``: ``silu(gate) * up`` of the expert MLP in one kernel, its
  backward in one (writing ``dh`` in ``h``'s layout), saving only ``h``.
- :mod:`kernels.calibrate` (imported on demand): measured matmul TFLOP/s per dtype and memory
  bandwidth of the device, as the ceilings JSON of ``tracelens calibrate``.

Every op uses its Triton kernel where Triton can run — CUDA tensors, or CPU tensors when the
package was imported with ``TRITON_INTERPRET=1`` — and otherwise falls back to the reference
(logged once).  ``import kernels`` works without triton installed.
"""

from __future__ import annotations

from ._runtime import HAS_TRITON, INTERPRET, log, triton_ok
from .backends import PASSES, available_backends, grouped_mm, register_backend, select_backend, tune, tune_table
from .cross_entropy import linear_cross_entropy
from .permutation import Permutation, gather_rows, permute, unpermute
from .router import fused_router
from .activation import swiglu

if not HAS_TRITON:
    from ._runtime import _IMPORT_ERROR

    log.warning("triton is not importable (%s); every op uses its PyTorch reference", _IMPORT_ERROR)

__all__ = [
    "HAS_TRITON", "INTERPRET", "triton_ok",
    "grouped_mm", "permute", "unpermute", "gather_rows", "Permutation", "fused_router", "linear_cross_entropy", "swiglu",
    "PASSES", "available_backends", "register_backend", "select_backend", "tune", "tune_table",
]
