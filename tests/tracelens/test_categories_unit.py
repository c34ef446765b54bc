"""`categories.map_strings` and `categories.strings`: per-category string work on categorical columns,
checked against plain per-row Python on the same values."""

from __future__ import annotations

import numpy as np
import pandas as pd

from tracelens import categories as C


def _subset_column(n_cats: int, rows: np.ndarray) -> pd.Series:
    """A categorical column keeping a large dictionary while its rows use a few values (as the GPU table
    keeps every event name), with missing values."""
    cats = [f"name_{i}" for i in range(n_cats)]
    codes = np.asarray(rows, dtype=np.int64)
    return pd.Series(pd.Categorical.from_codes(codes, categories=cats))


def test_map_strings_tests_only_values_used_and_matches_per_row():
    rows = np.array([5, 7, 5, -1, 199, 7, 0])
    col = _subset_column(200, rows)  # more than 64 categories: the used-values path
    seen = []

    def fn(s):
        seen.append(s)
        return len(s) * (2 if s.endswith("7") else 1)

    got = C.map_strings(col, fn, dtype=np.int64)
    expect = [len(s) * (2 if s.endswith("7") else 1) for s in ("name_5", "name_7", "name_5", "", "name_199", "name_7", "name_0")]
    assert got.tolist() == expect
    assert sorted(seen) == sorted(["name_0", "name_5", "name_7", "name_199", ""])  # 5 calls, not 201


def test_map_strings_small_dictionary_and_plain_columns():
    col = pd.Series(pd.Categorical(["b", "a", None, "b"]))
    assert C.map_strings(col, lambda s: s == "b").tolist() == [True, False, False, True]
    plain = pd.Series(["x", None, "yy"], dtype=object)
    assert C.map_strings(plain, len, dtype=np.int64).tolist() == [1, 0, 2]


def test_strings_matches_astype_and_fills_missing():
    col = _subset_column(100, np.array([3, -1, 99, 3]))
    assert C.strings(col).tolist() == ["name_3", "", "name_99", "name_3"]
    assert C.strings(col, missing="(none)")[1] == "(none)"
    assert C.strings(col).dtype == object
    present = col[col.notna()]
    assert C.strings(present).tolist() == [str(v) for v in present]  # what astype(str) gives per row
    assert C.strings(pd.Series(["a", None], dtype=object)).tolist() == ["a", ""]


_TRICKY = ["", "NCCL", "ncclDevKernel_AllReduce", "Ncclkernel_X", "GROUPED_GEMM", "x_GROUPED_y", "aten::MM", "aTen::addmm",
           "GMM", "gmm_", "gmm", "FlashAttn", "void cutlass::Kernel<Sm90GemmTma>", "triton_PER_fused_0",
           "CatArrayBatchedCopy", "deep_EP", "DeepEP", "cross_device_REDUCE", "MHA_fwd", "xmha", "Cijk_Ailk",
           # not ASCII: through the patterns as written (IGNORECASE folds U+017F to s, U+212A to k)
           "ſoftmax", "\u212aernel_gemm", "İnorm", "résumé_gemm", "NCCL\u00e9"]


def test_folded_rules_match_the_case_insensitive_patterns():
    """The lowered patterns (`_first_rule`, `is_comm_kernel`) find what the IGNORECASE ones do, ASCII or not."""
    import re

    def first_rule(text, which):
        for i, rule in enumerate(C._RULES):
            if text and rule[which] is not None and rule[which].search(text):
                return i
        return len(C._RULES)

    assert all(f is not None for _, f, _ in C._RULES_FOLDED) and C._COMM_FOLDED is not None  # every rule folds
    for text in _TRICKY + [t.lower() for t in _TRICKY] + [t.upper() for t in _TRICKY]:
        for which in (1, 2):
            assert C._first_rule(text, which) == first_rule(text, which), (text, which)
        assert C.search_folded(C.COMM_RE, C._COMM_FOLDED, text) == bool(C.COMM_RE.search(text)), text
    col = pd.Series(pd.Categorical(_TRICKY))
    assert C.is_comm_kernel(col).tolist() == [bool(C.COMM_RE.search(t)) for t in _TRICKY]
    # patterns whose meaning lowering would change are not folded
    for pat in (r"\S+gemm", r"\x41", r"\Dx", r"(?x) a b"):
        assert C._folded(re.compile(pat, re.IGNORECASE)) is None, pat
    assert C._folded(re.compile("gemm")) is None  # not case-insensitive: nothing to fold


def test_category_strings_is_str_of_each_category():
    import pandas as pd

    from tracelens.categories import category_strings

    for cats in (pd.Index(["b", "a", "ProfilerStep#1"], dtype="str"), pd.Index([3, 1, 2]), pd.Index([1.5, 2.0]),
                 pd.Index(["x", "y"], dtype=object), pd.Index([], dtype="str")):
        got = category_strings(cats)
        assert got == [str(c) for c in cats] and all(type(x) is str for x in got), cats
