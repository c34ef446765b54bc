"""The routed experts' grouped-GEMM backends: the values of ``grouped_gemm_backend`` and what each implies.

The implementations live in ``kernels`` (``kernels.backends``, which also has backends the config does not
offer, e.g. ``triton_tma`` and the ``reference``); this is what the config, the what-if model and the
auto-tuner need to know about them. Standard library only.
"""

from __future__ import annotations

#: every value of ``grouped_gemm_backend``; ``auto`` picks the fastest per pass from the tuner's cache
GROUPED_GEMM_BACKENDS: tuple[str, ...] = ("loop", "multistream", "torch", "triton", "auto")
#: one GEMM launch per local expert (reading the per-expert row counts on the host)
PER_EXPERT_BACKENDS: tuple[str, ...] = ("loop", "multistream")
#: one grouped launch for all local experts; ``grouped_gemm_align`` pads each expert's rows for these
GROUPED_BACKENDS: tuple[str, ...] = tuple(b for b in GROUPED_GEMM_BACKENDS if b not in PER_EXPERT_BACKENDS)
