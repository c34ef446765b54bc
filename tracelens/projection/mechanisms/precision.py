"""``dtype``, ``device``: the precision and the device every kernel runs at, refused.

fp32 <-> bf16 changes every GEMM's kernel and every activation's bytes (and FSDP's mixed-precision casts); CPU <->
CUDA is another machine. A trace holds one of each.
"""

from __future__ import annotations

from .base import Mechanism, register


@register
class Precision(Mechanism):
    name = "precision"
    keys = ("dtype", "device")
    order = 202.0
    summary = "refused: every kernel changes with the precision or the device"
    refuses = ("another precision or device: every kernel (GEMM kernel choice, bytes per element, casts) changes and "
               "the trace holds the run's only; profile a run with it")
