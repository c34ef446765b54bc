"""Event kinds and kernel categories, defined once for every analysis and report.

Two questions are answered here and nowhere else:
- which trace events are GPU activity (kernels, memcpy, memset) and which are host-side launches;
- which category a GPU event falls into (GEMM, grouped GEMM, attention, elementwise, reduction/norm,
  communication, memory, other), from the kernel's name and the op that launched it.
Rules are ordered: the first that matches wins. AMD (ROCm/HIP) names are handled like CUDA's.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

# Kineto categories (current names first, legacy capitalized ones after).
KERNEL_CATS = frozenset({"kernel", "Kernel"})
MEMCPY_CATS = frozenset({"gpu_memcpy", "Memcpy"})
MEMSET_CATS = frozenset({"gpu_memset", "Memset"})
GPU_CATS = KERNEL_CATS | MEMCPY_CATS | MEMSET_CATS
RUNTIME_CATS = frozenset({"cuda_runtime", "cuda_driver", "Runtime"})
OP_CATS = frozenset({"cpu_op", "Operator"})
ANNOTATION_CATS = frozenset({"user_annotation"})
PYTHON_CATS = frozenset({"python_function", "Python"})

# Profiler-step markers: torch.profiler's "ProfilerStep#N" and the common "## step N" style.
STEP_RE = re.compile(r"^(?:ProfilerStep#|##\s*step\s*#?)(\d+)\b", re.IGNORECASE)

COMM_RE = re.compile(r"nccl|rccl|nvshmem|deep_?ep|mscclpp|cross_device_reduce|ncclKernel", re.IGNORECASE)

CATEGORIES = (
    "GEMM", "grouped GEMM", "attention", "elementwise", "reduction/norm", "communication", "memory", "other",
)

# (category, kernel-name regex, launching-op regex); either match suffices.
_RULES: tuple[tuple[str, re.Pattern | None, re.Pattern | None], ...] = (
    ("communication", COMM_RE, re.compile(r"^(c10d|nccl|record_param_comms)", re.IGNORECASE)),
    ("grouped GEMM",
     re.compile(r"grouped_?gemm|group_?gemm|grouped_?mm|GroupedGemm|moe_?gemm|_grouped_", re.IGNORECASE),
     re.compile(r"_grouped_mm|grouped_mm|grouped_gemm|gmm\b", re.IGNORECASE)),
    ("attention",
     re.compile(r"flash|fmha|attention|attn|sdpa|\bmha", re.IGNORECASE),
     re.compile(r"scaled_dot_product|flash_attention|efficient_attention|cudnn_attention|_fused_attention", re.IGNORECASE)),
    ("GEMM",
     re.compile(r"gemm|gemv|xmma|nvjet|cublas|cutlass|Cijk_|matmul|wgmma|s16816|s1688|h16816|_mma_|splitKreduce", re.IGNORECASE),
     re.compile(r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_scaled_mm|addbmm|conv|cudnn_convolution|convolution)", re.IGNORECASE)),
    ("memory",
     re.compile(r"memcpy|memset|copy_kernel|CatArrayBatchedCopy|direct_copy|fill_kernel|FillFunctor", re.IGNORECASE),
     re.compile(r"^aten::(copy_|to|_to_copy|contiguous|clone|cat|fill_|zero_|zeros|empty|index_put|stack)$", re.IGNORECASE)),
    ("reduction/norm",
     re.compile(r"reduce|norm|softmax|rms|cross_entropy|nll_loss|argmax|topk|layernorm|welford|triton_per|triton_red", re.IGNORECASE),
     re.compile(r"norm|softmax|cross_entropy|nll_loss|sum|mean|topk|amax|max|min", re.IGNORECASE)),
    ("elementwise",
     re.compile(r"elementwise|vectorized|unrolled|triton_poi|multi_tensor_apply|pointwise|activation|silu|gelu|relu|dropout", re.IGNORECASE),
     None),
)


def is_comm_kernel(names: pd.Series) -> np.ndarray:
    """Vectorized over a (categorical) name column: True for communication kernels."""
    return _map_names(names, lambda s: bool(COMM_RE.search(s)))


def _map_names(names: pd.Series, fn) -> np.ndarray:
    if isinstance(names.dtype, pd.CategoricalDtype):
        lut = np.array([fn(str(c)) for c in names.cat.categories] + [fn("")])
        codes = names.cat.codes.to_numpy()
        return lut[codes]  # code -1 (missing) picks the last entry
    return np.array([fn("" if v is None or v != v else str(v)) for v in names])


def categorize(kernel_name: str, op_name: str | None = None, gpu_cat: str = "kernel") -> str:
    """Category of one GPU event. memcpy/memset events are always 'memory'."""
    if gpu_cat in MEMCPY_CATS or gpu_cat in MEMSET_CATS:
        return "memory"
    op = op_name or ""
    for cat, name_re, op_re in _RULES:
        if name_re is not None and name_re.search(kernel_name):
            return cat
        if op_re is not None and op and op_re.search(op):
            return cat
    return "other"


def categorize_frame(kernel_names: pd.Series, op_names: pd.Series, gpu_cats: pd.Series) -> pd.Series:
    """Vectorized `categorize` over columns; evaluates each distinct (name, op, cat) once."""
    key = pd.DataFrame({"k": kernel_names.astype(str), "o": op_names.astype(str).replace("nan", ""), "c": gpu_cats.astype(str)})
    uniq = key.drop_duplicates()
    uniq = uniq.assign(category=[categorize(k, o, c) for k, o, c in zip(uniq.k, uniq.o, uniq.c)])
    out = key.merge(uniq, on=["k", "o", "c"], how="left")["category"]
    out.index = kernel_names.index
    return out.astype(pd.CategoricalDtype(list(CATEGORIES)))


_TEMPLATE = re.compile(r"<[^<>]*>")


def short_kernel_name(name: str, width: int = 80) -> str:
    """Readable kernel label: template arguments and parameter lists dropped, 'void ' stripped."""
    s = name
    if s.startswith("void "):
        s = s[5:]
    prev = None
    while prev != s:  # strip nested templates from the inside out
        prev = s
        s = _TEMPLATE.sub("", s)
    s = s.split("(", 1)[0].strip() or name
    return s if len(s) <= width else s[: width - 1] + "…"
