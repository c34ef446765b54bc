"""moespec is the one place each shared concept is defined, and it stands alone.

* It imports only the standard library (and PyYAML when a config file is read): no torch, numpy or
  pandas, and no other package of this repository.
* tracelens and reports import nothing from trainer (they read the trainer's rules from moespec).
* Schedule names, grouped-GEMM backend names, device tables, the layout grammar and the parameter
  counts are not written out again outside moespec (a scan of the packages' source).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from moespec import devices, schedules
from moespec.backends import GROUPED_GEMM_BACKENDS, PER_EXPERT_BACKENDS

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("trainer", "tracelens", "reports", "autotune", "kernels")
REPO_PACKAGES = PACKAGES + ("moespec",)
MODULES = ("moespec", "moespec.config", "moespec.schedules", "moespec.layout", "moespec.params", "moespec.devices",
           "moespec.gemm_shapes", "moespec.backends")


def _sources(*packages: str) -> list[Path]:
    return sorted(p for pkg in packages for p in (ROOT / pkg).rglob("*.py"))


def _imported_roots(path: Path) -> set[str]:
    """Top-level names of every absolute import in a file (relative imports stay inside the package)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_imports_without_torch_numpy_pandas_or_yaml():
    """Importing every module, loading and checking a config: none of the heavy libraries is loaded
    (``sys.modules[...] = None`` makes an import of them fail), and PyYAML only to read the file."""
    code = ("import sys\n"
            "for m in ('torch', 'triton', 'numpy', 'pandas', 'pyarrow'):\n    sys.modules[m] = None\n"
            f"import {', '.join(MODULES)}\n"
            "assert 'yaml' not in sys.modules, 'yaml imported before a config was read'\n"
            "from moespec.config import load_config\n"
            "from moespec.layout import resolve_layout\n"
            "cfg = load_config('tiny', ['pp=2', 'microbatches=2', 'n_layers=4', 'pipeline_schedule=zbv', 'vpp=2',"
            " 'dp_mode=ddp'])\n"
            "print(resolve_layout(cfg), moespec.params.model_flops_per_token(cfg) > 0, "
            "moespec.devices.peak_bf16_flops('NVIDIA H100 80GB HBM3'))\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            f"{REPO_PACKAGES!r} and not m.startswith('moespec')))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == ["Et|t|t|tL True 989400000000000.0", "[]"]


def test_moespec_imports_only_the_standard_library_and_yaml():
    allowed = set(sys.stdlib_module_names) | {"yaml", "moespec", "__future__"}
    for path in _sources("moespec"):
        bad = _imported_roots(path) - allowed
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


@pytest.mark.parametrize("package", ["tracelens", "reports"])
def test_analyzer_never_imports_the_trainer(package):
    for path in _sources(package):
        assert "trainer" not in _imported_roots(path), f"{path.relative_to(ROOT)} imports trainer"


# ------------------------------------------------------------------------------ one definition each
SCHEDULE_NAMES = set(schedules.PIPELINE_SCHEDULES) | set(schedules.ALIASES)
BACKEND_NAMES = set(GROUPED_GEMM_BACKENDS)
DEVICE_WORDS = ("H100", "H200", "A100", "B200", "MI250", "MI300X", "MI325X", "MI355X", "V100", "L40S")


def _string_lists(node: ast.AST) -> list[list[str]]:
    """The string elements of a tuple/list/set literal (of a list of (str, ...) tuples: their first items),
    and the keys and the values of a dict literal, where all are strings."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        elts = node.elts
        if elts and all(isinstance(e, ast.Tuple) and e.elts for e in elts):
            elts = [e.elts[0] for e in elts]  # [("H100", 989e12), ...]
        candidates = [elts]
    elif isinstance(node, ast.Dict):
        candidates = [[k for k in node.keys if k is not None], node.values]
    else:
        return []
    return [[e.value for e in elts] for elts in candidates
            if elts and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in elts)]


def _collections(path: Path):
    """(line, strings, at module level) of every literal collection of strings in a file."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(n.value) for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None}
    for node in ast.walk(tree):
        for strings in _string_lists(node):
            yield node.lineno, strings, id(node) in top


def _copies(is_copy) -> list[str]:
    found = []
    for path in _sources(*PACKAGES):
        for line, strings, top in _collections(path):
            if is_copy(strings, top):
                found.append(f"{path.relative_to(ROOT)}:{line}: {strings}")
    return found


def test_schedule_names_are_listed_only_in_moespec():
    """A list of schedule names (module-level, or three or more anywhere) outside moespec.schedules is a
    second definition; a formula's branch on two names (``schedule in ("1f1b", "zb1p")``) is not."""
    def is_copy(strings, top):
        names = [s for s in strings if s in SCHEDULE_NAMES]
        return len(names) == len(strings) and (len(names) >= 3 or (top and len(names) >= 2))
    assert _copies(is_copy) == []


def test_backend_names_are_listed_only_in_moespec():
    """The config's backend list, the per-expert ones, the grouped ones (with ``auto``) are moespec's;
    kernels keeps its own registry of implementations (and an order to fall back in), which is not."""
    def is_copy(strings, top):
        names = set(strings)
        return len(strings) >= 2 and names <= BACKEND_NAMES and (set(PER_EXPERT_BACKENDS) <= names or "auto" in names)
    assert _copies(is_copy) == []


def test_device_table_is_only_in_moespec():
    def is_copy(strings, top):
        hits = [s for s in strings if any(w in s for w in DEVICE_WORDS)]
        return len(hits) >= 3
    assert _copies(is_copy) == []
    assert set(devices.HBM_BYTES) <= set(devices.DEVICES)
    assert set(devices.MEMORY_ALIASES.values()) <= set(devices.HBM_BYTES)


def test_layout_grammar_and_parameter_counts_are_only_in_moespec():
    """No function outside moespec parses a layout's repeats or counts attention weights: the grammar is
    `moespec.layout`, the counts `moespec.params` (the memory projection's activation sizes read the
    attention dims, but never count its weights)."""
    found = []
    for path in _sources(*PACKAGES):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            body = ast.unparse(node)
            in_fstring = {id(c) for j in ast.walk(node) if isinstance(j, ast.JoinedStr) for c in ast.walk(j)}
            strings = [c.value for c in ast.walk(node)
                       if isinstance(c, ast.Constant) and isinstance(c.value, str) and id(c) not in in_fstring]
            if "|" in strings and any(x == "*" or "\\*" in x for x in strings):  # stages and repeats
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.name} expands layout repeats")
            if "param" in node.name and "kv_lora_rank" in body and "'d_model'" in body:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.name} counts attention weights")
    assert found == []
