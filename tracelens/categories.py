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

# Runtime calls that block the host until the device catches up (device-to-host synchronizations).
SYNC_RUNTIME = frozenset({
    "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMemcpy2D",
    "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize", "cuMemcpyDtoH_v2", "cuMemcpy",
    "hipStreamSynchronize", "hipDeviceSynchronize", "hipEventSynchronize", "hipMemcpy", "hipMemcpy2D",
})

# Wrapper ranges: cpu_op ranges that are not an op the program called but a dispatch step inside one.
# "PythonSubclass": an op reaching a tensor subclass's __torch_dispatch__ (DTensor under FSDP2), recorded
# between the op called and the same op on the local tensors (aten::sqrt > PythonSubclass > aten::sqrt);
# its self time is that subclass's Python dispatch of the op, and host self-time views count it in the op
# enclosing it (tracelens.analysis.steps.host_top_ops).
WRAPPER_RANGES = frozenset({"PythonSubclass"})

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


MODULE_PREFIX = "nn.Module: "  # python_function events of this name are nn.Module ranges


def is_call_tree_event(ph: str, cat: str, name: str) -> bool:
    """Whether an event is a node of the call tree (tracelens.analysis.calltree): a complete event (ph
    X) that is a CPU op, a user annotation, a runtime/driver call, or an nn.Module range (a Python
    event named "nn.Module: ..."). The loader puts these rows first in the events table
    (tracelens/io/roworder.py), so that the tree shares their columns instead of copying them."""
    return ph == "X" and (cat in OP_CATS or cat in ANNOTATION_CATS or cat in RUNTIME_CATS
                          or (cat in PYTHON_CATS and name.startswith(MODULE_PREFIX)))


def call_tree_mask(ph: tuple[np.ndarray, list], cat: tuple[np.ndarray, list], name: tuple[np.ndarray, list]
                   ) -> np.ndarray:
    """`is_call_tree_event` per row of dictionary-coded columns, each given as (codes, distinct values);
    code -1 is a missing value (never a tree event). Tests each distinct value once, as map_strings does."""
    def lut(col, fn):
        codes, values = col
        out = np.zeros(len(values) + 1, dtype=bool)  # the last entry: code -1
        if len(values) <= 64:  # (ph, cat: a few values; testing them all costs less than finding those used)
            used = range(len(values))
        else:
            used = np.flatnonzero(np.bincount(codes.astype(np.intp) + 1, minlength=len(values) + 1)[1:]).tolist()
        out[:-1][list(used)] = [fn("" if values[i] is None else str(values[i])) for i in used]
        return out[codes]

    m = lut(ph, lambda v: v == "X")
    m &= lut(cat, lambda c: is_call_tree_event("X", c, MODULE_PREFIX))  # the tree's categories (Python: maybe)
    py = m & lut(cat, PYTHON_CATS.__contains__)
    if py.any():  # Python events: only nn.Module ranges
        m[py] = lut((name[0][py], name[1]), lambda v: v.startswith(MODULE_PREFIX))
    return m


# Case-insensitive patterns searched on ASCII text lowered once, against the pattern lowered, without the
# IGNORECASE flag: the same matches (for ASCII text, IGNORECASE folds ASCII letters only, and a pattern whose
# escapes do not name a case `_folded` lowers without changing what it matches), ~5x faster (Python's `re` has
# no literal-prefix search under IGNORECASE, and kernel names are long: 323 names of a 200 MB trace's kernels
# took 35 ms through the rules below, 6 ms folded). Text that is not ASCII goes through the pattern as written.
_CASE_FREE_ESCAPES = frozenset("bdsw.()[]{}|\\+*?-/#:<>^$ _&~=!,'\"%@;`")


def _folded(rx: re.Pattern | None) -> re.Pattern | None:
    """`rx` (compiled with IGNORECASE alone) lowered and compiled without it, for ASCII text lowered first;
    None where lowering could change what it matches (an escape such as \\S or \\x41, other flags)."""
    if rx is None or rx.flags & ~re.UNICODE != re.IGNORECASE or not rx.pattern.isascii():
        return None
    if any(c not in _CASE_FREE_ESCAPES for c in re.findall(r"\\(.)", rx.pattern, re.DOTALL)):
        return None
    return re.compile(rx.pattern.lower())


def search_folded(rx: re.Pattern, folded: re.Pattern | None, text: str, lowered: str | None = None) -> bool:
    """Whether case-insensitive `rx` matches somewhere in `text` (`folded` = `_folded(rx)`; `lowered`:
    text.lower() when the caller has it and text is ASCII)."""
    if folded is not None and (lowered is not None or text.isascii()):
        return folded.search(text.lower() if lowered is None else lowered) is not None
    return rx.search(text) is not None


_COMM_FOLDED = _folded(COMM_RE)


def is_comm_kernel(names: pd.Series) -> np.ndarray:
    """Vectorized over a (categorical) name column: True for communication kernels."""
    return map_strings(names, lambda s: search_folded(COMM_RE, _COMM_FOLDED, s))


# torch.profiler's step markers: names "ProfilerStep#N", N in ASCII digits (1 to 18 of them, so that N fits an int64)
# and nothing after them. A trace of many short steps has one such distinct name per step (800,000 in a 2 GB trace
# of 8M events): found over the whole names' dictionary at once (`step_marker_numbers`), so that the per-name tests
# of `map_strings` can leave them out where the caller knows its test's value on every one of them.
STEP_MARKER_PREFIX = "ProfilerStep#"
_STEP_MARKER_RE2 = r"^ProfilerStep#[0-9]{1,18}$"  # (RE2, in Arrow: ASCII only, no case folding; $ = the end)
STEP_NUMBER = object()  # `map_strings(..., on_markers=STEP_NUMBER)`: each marker's N
_NO_VALUE = object()
_marker_cache: dict[int, tuple[pd.Index, np.ndarray]] = {}


def step_number(name: str) -> int:
    """N of a profiler-step name (`STEP_RE`: "ProfilerStep#N", "## step N", ...), else -1."""
    m = STEP_RE.match(name)
    return int(m.group(1)) if m else -1


def step_marker_numbers(cats: pd.Index) -> np.ndarray:
    """int64 per category of a categorical's categories: N where it is exactly "ProfilerStep#N" (N: 1 to 18 ASCII
    digits), else -1; -1 for all unless the categories are strings (pandas' string dtype). Vectorized (Arrow), and
    kept for the last few categories objects asked about (the names' dictionary is shared by the events table and
    its subsets: the call tree, the GPU table). For such a name `step_number` is N (STEP_RE's first branch matches
    "ProfilerStep#", (\\d+) takes every digit, and the string's end is a word boundary)."""
    hit = _marker_cache.get(id(cats))
    if hit is not None and hit[0] is cats:
        return hit[1]
    out = np.full(len(cats), -1, dtype=np.int64)
    if len(cats) and isinstance(cats.dtype, pd.StringDtype):
        import pyarrow as pa
        import pyarrow.compute as pc
        arr = pa.array(cats.array)
        if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
            ok = pc.starts_with(arr, STEP_MARKER_PREFIX).to_numpy(zero_copy_only=False)
            if ok.any():
                idx = np.flatnonzero(ok)
                sub = arr.take(pa.array(idx))
                ok = pc.match_substring_regex(sub, _STEP_MARKER_RE2).to_numpy(zero_copy_only=False)
                idx, sub = idx[ok], sub.filter(pa.array(ok))
                out[idx] = pc.cast(pc.utf8_slice_codeunits(sub, len(STEP_MARKER_PREFIX)), pa.int64()).to_numpy()
    if len(_marker_cache) >= 4:
        _marker_cache.pop(next(iter(_marker_cache)))
    _marker_cache[id(cats)] = (cats, out)
    return out


def map_strings(col: pd.Series, fn, dtype=bool, on_markers=_NO_VALUE) -> np.ndarray:
    """fn applied once per distinct value of a (categorical) string column, broadcast to all rows.

    Missing values are passed to fn as "". This is how every analysis tests names: per category,
    never per row, so a 10M-event trace costs as much as its few thousand distinct names.
    on_markers: fn's value on every profiler-step marker "ProfilerStep#N" (`step_marker_numbers`), when the caller
    knows it (STEP_NUMBER: N, as `step_number` gives): those names are then not passed to fn (a trace of many short
    steps has a distinct name per step).
    """
    if isinstance(col.dtype, pd.CategoricalDtype):
        codes = col.cat.codes.to_numpy()
        cats = col.cat.categories
        if len(cats) <= 64:
            lut = np.array([fn(str(c)) for c in cats] + [fn("")], dtype=dtype)
        else:  # a subset of rows keeps the whole dictionary (all event names): test only the values used
            used = np.flatnonzero(np.bincount(codes.astype(np.intp) + 1, minlength=len(cats) + 1)[1:])
            lut = np.zeros(len(cats) + 1, dtype=dtype)
            if on_markers is not _NO_VALUE and len(used):
                num = step_marker_numbers(cats)[used]
                mark = num >= 0
                if mark.any():
                    lut[used[mark]] = num[mark] if on_markers is STEP_NUMBER else on_markers
                    used = used[~mark]
            values = cats.take(used).tolist()
            if len(used):
                lut[used] = np.array([fn(str(c)) for c in values], dtype=dtype)
            lut[-1] = fn("")
        return lut.take(codes)  # code -1 (missing) picks the last entry (take: ~1.5x faster than lut[codes])
    return np.array([fn("" if v is None or v != v else str(v)) for v in col], dtype=dtype)


def strings(col: pd.Series, missing: str = "") -> np.ndarray:
    """A (categorical) string column as an object array of str, missing values as `missing`.

    Looks each row's code up in the categories turned to str once: ~30x faster than
    `col.astype(str).to_numpy()`, which builds a string per row."""
    if isinstance(col.dtype, pd.CategoricalDtype):
        codes = col.cat.codes.to_numpy()
        lut = np.concatenate([category_values(col.cat.categories, codes), np.array([missing], dtype=object)])
        return lut.take(codes)  # code -1 (missing) picks the last entry
    return np.array([missing if v is None or v != v else str(v) for v in col], dtype=object)


def category_values(cats: pd.Index, codes: np.ndarray) -> np.ndarray:
    """``np.array(category_strings(cats), dtype=object)`` at every position `codes` (a categorical's codes, -1:
    missing) reads; where a large dictionary has few of its values used (the GPU table's names keep every event
    name: one per profiler step in a trace of short steps), only those are made str, the others left None."""
    n = len(cats)
    if n > 4096:
        used = np.flatnonzero(np.bincount(np.asarray(codes).astype(np.intp) + 1, minlength=n + 1)[1:])
        if len(used) * 4 < n:
            out = np.full(n, None, dtype=object)
            out[used] = category_strings(cats.take(used))
            return out
    return np.array(category_strings(cats), dtype=object)


def category_strings(cats: pd.Index) -> list[str]:
    """``[str(c) for c in cats]`` for a categorical's categories, without a Python step per category where they are
    strings already (pandas' string dtype: a trace of 80,000 profiler steps has as many distinct event names, and
    iterating an Arrow-backed index boxes each one: 48 ms against 6 ms)."""
    if isinstance(cats.dtype, pd.StringDtype):
        return cats.to_numpy(dtype=object).tolist()
    return [str(c) for c in cats]


def decode_codes(cats: pd.Index, codes: np.ndarray) -> np.ndarray:
    """``np.asarray([str(c) for c in cats] + [""], dtype=object)[codes]`` (code -1: ""), turning only the categories
    used into str: a categorical's whole dictionary can be much larger than the codes decoded (the event names of
    a trace of many short steps: one per step)."""
    codes = np.asarray(codes)
    if codes.size == 0:
        return np.empty(codes.shape, dtype=object)
    u, inv = np.unique(codes, return_inverse=True)
    full = len(cats) + 1  # (the list indexed: the categories, then "")
    pos = np.where(u < 0, u + full, u)
    if pos.min() < 0 or pos.max() >= full:
        raise IndexError(f"code out of range for {len(cats)} categories")
    missing = pos == len(cats)
    lut = np.empty(len(u), dtype=object)
    lut[missing] = ""
    lut[~missing] = category_strings(cats.take(pos[~missing]))
    return lut[inv.reshape(codes.shape)]


def categories_with_prefix(cats: pd.Index, prefix: str) -> list[str]:
    """``[s for s in category_strings(cats) if s.startswith(prefix)]``: over a large dictionary of strings by Arrow's
    prefix test (on UTF-8 bytes: the same answer as str.startswith), turning only those found into str."""
    if len(cats) > 64 and isinstance(cats.dtype, pd.StringDtype):
        import pyarrow as pa
        import pyarrow.compute as pc
        arr = pa.array(cats.array)
        if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
            return category_strings(cats[pc.starts_with(arr, prefix).to_numpy(zero_copy_only=False)])
    return [s for s in category_strings(cats) if s.startswith(prefix)]


def isin(col: pd.Series, values: frozenset) -> np.ndarray:
    """Whether each row's value is one of `values` (strs); missing values as "". Over a large dictionary of strings
    (event names: one per profiler step in a trace of many short steps) by Arrow's hashed lookup of the whole
    dictionary, not a Python test per distinct value."""
    if isinstance(col.dtype, pd.CategoricalDtype):
        cats = col.cat.categories
        if len(cats) > 64 and isinstance(cats.dtype, pd.StringDtype) and all(type(v) is str for v in values):
            lut = np.append(np.asarray(cats.isin(list(values)), dtype=bool), "" in values)
            return lut.take(col.cat.codes.to_numpy())
    return map_strings(col, values.__contains__)


def positions(index: pd.Index, labels: np.ndarray) -> np.ndarray:
    """`index.get_indexer(labels)` (row positions, -1 where a label is absent) for the indexes analyses
    look rows up in, without the hash table pandas builds on a first lookup and keeps for the index's
    life (~30 bytes per row: ~130 MB on the call tree of a 2 GB trace): a RangeIndex (the events table)
    by arithmetic, a sorted unique one (the tree and GPU tables keep event order) by binary search;
    any other index by `get_indexer`."""
    n = len(index)
    if isinstance(index, pd.RangeIndex) and index.step == 1 and index.start == 0:
        # (the call tree and the events table: positions are labels; in the labels' own integer type,
        # int32 for the tree's links, and with two bool temporaries, not five int64 ones)
        labels = np.asarray(labels)
        if labels.dtype.kind not in "iu" or labels.dtype.itemsize > 8 or (labels.dtype.kind == "u" and labels.dtype.itemsize == 8):
            labels = labels.astype(np.int64)
        ok = labels >= 0
        ok &= labels < n
        return np.where(ok, labels, np.array(-1, dtype=labels.dtype if labels.dtype.kind == "i" else np.int64))
    labels = np.asarray(labels, dtype=np.int64)
    if isinstance(index, pd.RangeIndex) and index.step > 0:
        rel = labels - index.start
        pos = rel // index.step
        return np.where((rel % index.step == 0) & (pos >= 0) & (pos < n), pos, -1)
    if index.dtype.kind in "iu" and index.is_monotonic_increasing and index.is_unique:
        keys = index.to_numpy()
        if n == 0:
            return np.full(len(labels), -1, dtype=np.int64)
        pos = np.minimum(np.searchsorted(keys, labels), n - 1)
        return np.where(keys[pos] == labels, pos, -1)
    return index.get_indexer(labels)


LOOKUP_KEEP_MAX = 1 << 16  # an Index of more values loses pandas' lookup table once a check has built it


def forget_lookup(index: pd.Index) -> pd.Index:
    """`index` (returned) without the hash table pandas caches on an Index for lookups, when it has more than
    LOOKUP_KEEP_MAX values. pandas builds it for the uniqueness check a Categorical makes of its categories, and
    for `in` and `get_loc`, then keeps it as long as the Index lives: ~70 MB for the 800,000 event names of a 2 GB
    trace of short steps, twice at its peak (the names, and the names with "" appended by `take_strings`). The
    checks' answers stay cached (`is_unique`); a later lookup builds the table again. pandas keeps it in the
    private `_cache`; where an Index has none, nothing is done."""
    cache = getattr(index, "_cache", None)
    if isinstance(cache, dict) and len(index) > LOOKUP_KEEP_MAX:
        cache.pop("_engine", None)
    return index


def forget_lookups(frame: pd.DataFrame) -> pd.DataFrame:
    """`forget_lookup` on the categories of each categorical column of `frame` (returned)."""
    for dtype in frame.dtypes.tolist():
        if isinstance(dtype, pd.CategoricalDtype):
            forget_lookup(dtype.categories)
    return frame


def _position(cats: pd.Index, value: str) -> int:
    """`cats.get_loc(value)` if `value in cats`, else -1; over a large Index by comparing its values (a hash table
    of them would be built for one lookup and kept: `forget_lookup`)."""
    if len(cats) <= LOOKUP_KEEP_MAX:
        return cats.get_loc(value) if value in cats else -1
    at = np.flatnonzero(np.asarray(cats == value, dtype=bool))
    return int(at[0]) if len(at) else -1


# per (categories, fill) asked about last: (the categories, fill's code, the results' dtype: its categories are
# those categories, with fill appended where it is not one of them)
_with_fill: dict[tuple[int, str], tuple[pd.Index, int, pd.CategoricalDtype]] = {}


def _dtype_of_unique(cats: pd.Index) -> pd.CategoricalDtype:
    """The unordered CategoricalDtype of categories known to be unique, without pandas' check that they are (it
    hashes every value and keeps the table: ~0.2 s and ~70 MB for 800,000 names). pandas' own fast path where it has
    one (a private constructor, there since pandas 0.21), else the checked constructor."""
    fast = getattr(pd.CategoricalDtype, "_from_fastpath", None)
    if fast is not None:
        try:
            dtype = fast(cats, False)
        except TypeError:  # (another signature: the public way)
            pass
        else:
            if isinstance(dtype, pd.CategoricalDtype) and dtype.categories is cats:
                return dtype
    return pd.CategoricalDtype(cats)


def take_strings(col: pd.Series, rows: np.ndarray, fill: str = "") -> pd.Categorical:
    """Categorical of col's values at row labels `rows` (-1 -> fill), without materializing strings. Where `fill` is
    not a category it is appended, as the last: the categories with it (and their dtype) are kept for the last few
    (categories, fill) asked about and shared by the results (each new Index hashed all its values again, in
    get_loc and in the categorical's check that they are unique: ~0.1 s a call for the 800,000 event names of a 2 GB
    trace of short steps, and a copy of the names each). They are unique by construction (a categorical's
    categories and a value not among them), so that check is not made (`_dtype_of_unique`)."""
    cats = col.cat.categories
    hit = _with_fill.get((id(cats), fill))
    if hit is None or hit[0] is not cats:
        at = _position(cats, fill)
        if at >= 0:  # (the column's own dtype where it is unordered, as from_codes(categories=cats) would give)
            hit = (cats, at, col.dtype if not col.dtype.ordered else pd.CategoricalDtype(cats))
        else:
            hit = (cats, len(cats), _dtype_of_unique(cats.append(pd.Index([fill]))))
        if len(_with_fill) >= 4:
            _with_fill.pop(next(iter(_with_fill)))
        _with_fill[(id(cats), fill)] = hit
    _, fill_code, dtype = hit
    code_t = np.int32 if len(dtype.categories) < 2**31 else np.int64
    codes = np.full(len(rows), fill_code, dtype=code_t)
    ok = rows >= 0
    got = col.cat.codes.to_numpy()[positions(col.index, rows[ok])].astype(code_t)  # rows are labels of col
    got[got < 0] = fill_code
    codes[ok] = got
    del got, ok
    out = pd.Categorical.from_codes(codes, dtype=dtype)
    forget_lookup(out.categories)  # (where a check built it: kept, it is ~70 MB at 800,000 names)
    return out


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


_RULES_FOLDED = tuple((cat, _folded(name_re), _folded(op_re)) for cat, name_re, op_re in _RULES)


def _first_rule(text: str, which: int) -> int:
    """Index of the first rule whose kernel-name (which=1) or op (which=2) pattern matches, else len(_RULES)."""
    if text:
        lowered = text.lower() if text.isascii() else None  # (folded patterns: see `search_folded`)
        for i, rule in enumerate(_RULES):
            if rule[which] is not None and search_folded(rule[which], _RULES_FOLDED[i][which], text, lowered):
                return i
    return len(_RULES)


_RULE_CATEGORY = np.array([CATEGORIES.index(r[0]) for r in _RULES] + [CATEGORIES.index("other")])


def categorize_frame(kernel_names: pd.Series, op_names: pd.Series, gpu_cats: pd.Series) -> pd.Series:
    """Vectorized `categorize` over categorical columns.

    The first rule that matches the kernel name or the op wins, so an event's rule is the smaller of
    the first rule matching its name and the first matching its op: each distinct name and each
    distinct op is tested once, whatever pairs of them occur.
    """
    by_name = map_strings(kernel_names, lambda s: _first_rule(s, 1), dtype=np.int64)
    by_op = map_strings(op_names, lambda s: _first_rule(s, 2), dtype=np.int64)
    is_memory = isin(gpu_cats, MEMCPY_CATS | MEMSET_CATS)
    code = np.where(is_memory, CATEGORIES.index("memory"), _RULE_CATEGORY[np.minimum(by_name, by_op)])
    out = pd.Categorical.from_codes(code, categories=list(CATEGORIES))
    return pd.Series(out, index=kernel_names.index)


_TEMPLATE = re.compile(r"<[^<>]*>")
_HASHY = re.compile(r"(?<![A-Za-z])(?:0x)?[0-9a-f]{8,}(?![A-Za-z])|_[0-9a-f]{12,}\b")


def normalize_kernel_name(name: str) -> str:
    """Kernel identity for matching across traces: template arguments, parameter lists and hash-like
    tokens (build ids, Triton cache hashes) dropped, so a rebuild does not make a kernel look new."""
    return _HASHY.sub("#", short_kernel_name(name, width=10_000))


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
