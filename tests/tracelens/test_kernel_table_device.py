"""The kernel table stands in for a run's grouped GEMMs only with timings of that run's device and dtype.

A CPU tuning run (a test, `grouped_gemm_backend=auto` on a laptop) writes the tuner's cache
(``$TRACELENS_CACHE_DIR/kernels/grouped_mm.json``), which the what-if reads by default. Its rows once took the
place of an H100 run's measured expert kernels, and the 4-GPU layout predictions moved by up to 6 points (median
2.7 -> 7.7 % from the EP baseline) with nothing said. Rows of another device or dtype are left out, and the
prediction says how many.
"""

from __future__ import annotations

import json
from pathlib import Path

from tracelens.projection import kerneltable as KT
from tracelens.projection.whatif import Model

RUN = Path(__file__).resolve().parents[1] / "fixtures" / "h100_4gpu_layouts" / "dp4_mbs16"
H100 = "NVIDIA H100 80GB HBM3"


def _cache(tmp_path: Path, device: str, dtype: str) -> Path:
    """A tuner cache (kernels/backends.py's format) with the run's expert shapes timed on ``device``."""
    entries = {}
    for T in (4096, 65536):
        for pass_, K, N in (("fwd", 2048, 2816), ("fwd", 1408, 2048)):
            entries[f"{device}|{dtype}|T{T}|K{K}|N{N}|E64|{pass_}"] = {
                "backend": "loop", "ms": 1e3, "times_ms": {"loop": 1e3, "torch": 2e3}}
    p = tmp_path / "kernels" / "grouped_mm.json"
    p.parent.mkdir(parents=True)
    p.write_text(json.dumps({"version": 1, "entries": entries}))
    return p


def test_rows_keep_their_device_and_dtype_and_filter_by_them(tmp_path):
    table = KT.load(_cache(tmp_path, "cpu", "float32"))
    assert {(r["device"], r["dtype"]) for r in table.rows} == {("cpu", "float32")} and len(table) == 8
    assert table.for_device(H100, "bf16") == (None, 8)
    same, left = table.for_device("cpu", "fp32")
    assert left == 0 and len(same) == 8 and same.ms("fwd", 4096, 2048, 2816, 64, "loop") == 1e3
    # a file the user wrote without device or dtype is theirs to vouch for: kept
    rows = [{"pass": "fwd", "T": 4096, "K": 8, "N": 8, "E": 2, "backend": "loop", "ms": 1.0}]
    assert len(KT.KernelTable(rows, "mine").for_device(H100, "bf16")[0]) == 1


def test_another_devices_cache_changes_no_prediction(tmp_path, monkeypatch):
    change = {"micro_batch_size": 8}
    monkeypatch.setenv("TRACELENS_CACHE_DIR", str(tmp_path / "empty"))
    clean = Model.from_run(RUN).predict(change)
    monkeypatch.setenv("TRACELENS_CACHE_DIR", str(tmp_path))
    _cache(tmp_path, "cpu", "float32")  # the default source: the tuner's cache of this machine
    model = Model.from_run(RUN)
    assert model.table is None
    got = model.predict(change)
    assert got.tokens_per_s_per_gpu == clean.tokens_per_s_per_gpu and got.step_s == clean.step_s
    assert any("8 timing(s) of other devices or dtypes left out (this run: NVIDIA H100 80GB HBM3, bf16)" in n
               for n in model.notes), model.notes
    # the same shapes timed on the run's own device are used
    (tmp_path / "kernels" / "grouped_mm.json").unlink()
    (tmp_path / "kernels").rmdir()
    _cache(tmp_path, H100, "bfloat16")
    assert len(Model.from_run(RUN).table) == 8
