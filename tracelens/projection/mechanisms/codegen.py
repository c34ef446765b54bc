"""``compile``, ``cuda_graphs``, ``use_triton_kernels``: code generation, refused.

What they buy is the generated kernels' (fusion, graph replay, the Triton router / permutation / fused loss), which
no trace of the unchanged run shows: the guided search measures each of their values once and predicts within it
(``autotune/model_search.py``, docs/whatif.md "How the guided search uses it").
"""

from __future__ import annotations

from .base import Mechanism, register


@register
class CodeGen(Mechanism):
    name = "codegen"
    keys = ("compile", "cuda_graphs", "use_triton_kernels")
    order = 201.0
    summary = "refused: the generated kernels are not in the trace of a run without them"
    refuses = ("code generation: the kernels it generates (fused regions, graph replay, Triton kernels) are not in this "
               "run's trace; profile a run with it and predict the other knobs from that trace")
