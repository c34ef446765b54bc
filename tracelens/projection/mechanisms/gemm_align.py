"""``grouped_gemm_align``: each expert's rows padded to a multiple, refused.

The padding adds ``align - 1`` rows per expert at most, but what it buys is the grouped GEMM's choice of tiles at
aligned sizes, which neither the trace (one alignment) nor the kernel table (``tracelens kernels tune``: no
alignment axis) times: no measured ratio exists to scale the run's GEMMs by.
"""

from __future__ import annotations

from .base import Mechanism, register


@register
class GemmAlign(Mechanism):
    name = "gemm_align"
    keys = ("grouped_gemm_align",)
    order = 205.0
    summary = "refused: the grouped GEMM's speed at aligned row counts is not measured"
    refuses = ("per-expert row alignment: the grouped GEMM's time at aligned row counts is measured neither in this "
               "trace nor in the kernel table (it has no alignment axis); profile a run with it")
