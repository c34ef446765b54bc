import json
import os
import subprocess
import sys

import pytest
import torch

from kernels import backends, select_backend, tune, tune_table
from kernels.backends import BACKENDS, PASSES, cache_key, cache_path, load_cache, run_pass


@pytest.fixture(autouse=True)
def _fresh_memo():
    backends._MEMO.clear()
    yield
    backends._MEMO.clear()


def test_registry_and_availability_on_cpu():
    assert {"triton", "torch", "loop", "multistream", "reference"} <= set(BACKENDS)
    probe = torch.empty(0)
    avail = backends.available_backends(probe)
    assert "loop" in avail and "torch" not in avail and "multistream" not in avail and "reference" not in avail
    with pytest.raises(ValueError, match="unknown grouped-GEMM backend"):
        run_pass("nope", "fwd", probe, probe, probe)
    with pytest.raises(ValueError, match="unknown pass"):
        run_pass("loop", "bwd", probe, probe, probe)


@pytest.mark.parametrize("pass_", PASSES)
def test_every_available_backend_matches_reference(needs_triton, pass_):
    T, K, N, E = 30, 16, 24, 4
    offs = torch.tensor([7, 7, 20, 28], dtype=torch.int32)  # empty expert, 2 tail rows
    a, b, o = backends._inputs(pass_, T, K, N, E, torch.float32, "cpu", offs)
    want = backends._reference_pass(pass_, a, b, o)
    for name in backends.available_backends(a):
        got = run_pass(name, pass_, a, b, o)
        assert torch.allclose(got[:28], want[:28], atol=1e-4, rtol=1e-4), (name, pass_)


def test_cache_dir_follows_env(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACELENS_CACHE_DIR", str(tmp_path))
    assert cache_path() == tmp_path / "kernels" / "grouped_mm.json"
    monkeypatch.delenv("TRACELENS_CACHE_DIR")
    assert str(backends.cache_dir()).endswith(os.path.join(".cache", "tracelens", "kernels"))


def test_cache_key_buckets_rows_and_separates_passes():
    k = lambda T, p: cache_key("cpu", torch.bfloat16, T, 2048, 1408, 64, p)  # noqa: E731
    assert k(20000, "fwd") == k(30000, "fwd") != k(40000, "fwd")
    assert k(20000, "fwd") != k(20000, "dx") != k(20000, "dw")
    assert k(20000, "dw") == "cpu|bfloat16|T32768|K2048|N1408|E64|dw"


def test_tune_caches_winner_per_pass_and_select_reads_it(needs_triton, monkeypatch):
    rows = tune(48, 16, 16, 4, torch.float32, "cpu", warmup=1, reps=2)
    assert {r["pass"] for r in rows} == set(PASSES)
    for p in PASSES:
        prow = [r for r in rows if r["pass"] == p]
        assert {r["backend"] for r in prow} >= {"triton", "loop"}
        assert sum(r["winner"] for r in prow) == 1
        assert all(r["ms"] is not None and r["error"] is None for r in prow)
    doc = json.loads(cache_path().read_text())
    assert doc["version"] == backends.CACHE_VERSION
    entries = load_cache()
    assert len(entries) == 3
    for p in PASSES:
        entry = entries[cache_key("cpu", torch.float32, 48, 16, 16, 4, p)]
        assert entry["backend"] in ("triton", "loop") and set(entry["times_ms"]) >= {"triton", "loop"}

    # Round trip: a fresh process state (empty memo) reads the winner from disk, never re-tunes.
    backends._MEMO.clear()
    monkeypatch.setattr(backends, "tune", lambda *a, **k: pytest.fail("select_backend re-tuned a cached shape"))
    for p in PASSES:
        want = entries[cache_key("cpu", torch.float32, 48, 16, 16, 4, p)]["backend"]
        assert select_backend(40, 16, 16, 4, torch.float32, "cpu", p) == want  # same bucket (64)


def test_select_backend_uses_hand_written_cache_entry(monkeypatch):
    key = cache_key("cpu", torch.float32, 100, 8, 8, 2, "dx")
    cache_path().parent.mkdir(parents=True, exist_ok=True)
    cache_path().write_text(json.dumps({"version": backends.CACHE_VERSION, "entries": {key: {"backend": "loop"}}}))
    assert select_backend(100, 8, 8, 2, torch.float32, "cpu", "dx", tune_if_missing=False) == "loop"


def test_select_backend_tunes_once_on_miss(needs_triton, monkeypatch):
    calls = []
    real = backends.tune

    def spy(*a, **k):
        calls.append(k.get("passes"))
        return real(*a, **k, warmup=0, reps=1)

    monkeypatch.setattr(backends, "tune", spy)
    first = select_backend(32, 16, 16, 2, torch.float32, "cpu", "fwd")
    again = select_backend(32, 16, 16, 2, torch.float32, "cpu", "fwd")
    assert first == again and calls == [("fwd",)]


def test_corrupt_or_stale_cache_is_ignored():
    cache_path().parent.mkdir(parents=True, exist_ok=True)
    cache_path().write_text("{not json")
    assert load_cache() == {}
    cache_path().write_text(json.dumps({"version": -1, "entries": {"x": {"backend": "loop"}}}))
    assert load_cache() == {}
    assert select_backend(16, 8, 8, 2, torch.float32, "cpu", "fwd", tune_if_missing=False) in BACKENDS


def test_failing_backend_never_wins(needs_triton, monkeypatch):
    def broken(pass_, a, b, offs):
        raise RuntimeError("boom")

    backends.register_backend("broken", broken)
    try:
        rows = tune(32, 16, 16, 2, torch.float32, "cpu", passes=("fwd",), backends=["broken", "loop"], warmup=0,
                    reps=1, save=False)
    finally:
        del backends.BACKENDS["broken"]
    by = {r["backend"]: r for r in rows}
    assert by["broken"]["error"].startswith("RuntimeError") and not by["broken"]["winner"]
    assert by["loop"]["winner"]


def test_tune_table_rows_for_cli(needs_triton):
    rows = tune_table(shapes=[(32, 16, 16, 2)], dtype="float32", device="cpu", warmup=0, reps=1)
    assert rows and set(rows[0]) == {"op", "pass", "T", "K", "N", "E", "dtype", "device", "backend", "ms",
                                     "tflops", "winner", "error"}
    assert cache_path().exists()


def test_import_without_triton_falls_back_and_says_so_once():
    code = (
        "import sys, logging\n"
        "sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "logging.basicConfig(level=logging.INFO, format='%(name)s:%(message)s')\n"
        "import torch, kernels\n"
        "assert not kernels.HAS_TRITON\n"
        "x = torch.randn(6, 4, requires_grad=True); w = torch.randn(2, 4, 3, requires_grad=True)\n"
        "y = kernels.grouped_mm(x, w, torch.tensor([2, 6], dtype=torch.int32)); y.sum().backward()\n"
        "kernels.grouped_mm(x, w, torch.tensor([2, 6], dtype=torch.int32))\n"
        "p = kernels.permute(x, torch.tensor([[0], [1], [1], [0], [0], [1]]), 2)\n"
        "kernels.fused_router(torch.randn(5, 8), 2)\n"
        "kernels.linear_cross_entropy(torch.randn(3, 4), torch.randn(9, 4), torch.tensor([1, 2, 3]))\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"
    assert res.stderr.count("triton is not importable") == 1, res.stderr
