"""What each report page looks like at 1400 px in headless Chromium, checked on the rendered boxes:

- no plotly legend overlaps the figure's toolbar (modebar),
- names in tables (ops, roofline ops, kernels) stay on one line, never broken mid-word,
- C++ kernel names are demangled and shortened in the cell, the full name in the cell's title,
- the ppvis verdict's colour matches its words (red only for a fixable imbalance),
- the sweep page shows its chart first and best.yaml collapsed below, with each trial's noise.

This file holds the pages no other file opens (report.html of the grouped-GEMM trace, memory.html); the same
checks of the other pages sit beside that page's other tests, which open it anyway (each page costs Chromium
seconds to draw): the 2-rank report and the diff page in test_report_browser.py, the ppvis colours in
test_ppvis_browser.py, the sweep page in test_sweep_browser.py. The helpers are _browser.py's.

With $TRACELENS_SCREENSHOTS set, every page is also saved there as a full-page PNG (and one per section) so a
person can look at it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ._browser import every_plot_drawn, legends_clear, one_line, save_shots

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def memory_page(tmp_path_factory) -> Path:
    """memory.html: the 1-GPU proxy as run and the two best 16-GPU layouts of DeepSeek-V2-Lite for 80 GiB."""
    from reports.memory import write_memory_report
    from tracelens.analysis import memory as M

    out = tmp_path_factory.mktemp("memory")
    mc = M.load_model_config("gpu_proxy", [])
    lay = M.resolve_layout(mc.config, world=1, source="gpu_proxy")
    dsv2 = M.load_model_config("deepseek_v2_lite", []).config
    sweep = M.sweep(dsv2, 16, 80 * M.GIB, 64, top=4)
    projs = [M.project(mc.config, lay)] + [
        M.project(dsv2, M.resolve_layout(dsv2, world=16, pp=int(x.pp), vpp=int(x.vpp), ep=int(x.ep), tp=int(x.tp),
                                         cp=int(x.cp), mbs=int(x.mbs), microbatches=int(x.microbatches),
                                         schedule=x.schedule, recompute=x.recompute))
        for x in sweep.head(2).itertuples(index=False)]
    return write_memory_report(projs, out / "memory.html", device_bytes=80 * M.GIB)


def _open(shown, path, shots, name):
    page, errors = shown(path)
    every_plot_drawn(page)
    save_shots(page, shots, name)
    return page, errors


def test_report_page(site, shown, shots):
    page, errors = _open(shown, site.report("moe_grouped"), shots, "report")
    boxes = legends_clear(page)
    assert {"plot-timeline", "plot-categories", "plot-roofline"} <= {b["id"] for b in boxes}
    # roofline op column and every other name column: one line each, the full name in the title
    roof = one_line(page, "#roofline table.data td.name")
    assert all(c["title"] == c["text"] for c in roof if c["text"])
    one_line(page, "#ops td.name")
    kern = one_line(page, "#kernels td.name")
    # the three CUTLASS grouped-GEMM kernels are mangled in the trace (1,300 characters each)
    cutlass = [c for c in kern if c["title"] and "_ZN7cutlass13device_kernel" in c["title"]]
    assert len(cutlass) == 3 and all(c["text"] == "cutlass::device_kernel<…>" for c in cutlass)
    assert all(c["title"].startswith("cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x") for c in cutlass)
    # demangled names (as Kineto writes them) are shortened, the full one on hover
    long = [c for c in kern if c["title"] and c["title"].startswith("void at::native::")]
    assert long and all(len(c["text"]) < len(c["title"]) and "…" in c["text"] for c in long)
    assert not any(c["text"].startswith("_Z") for c in kern)
    assert errors == []


def test_memory_page(memory_page, shown, shots):
    page, errors = _open(shown, memory_page, shots, "memory")
    boxes = legends_clear(page)
    assert [b["id"] for b in boxes] == ["plot-memory"]
    text = page.inner_text("#memory-bars")
    # the codes on the page are explained on it
    assert "F forward end" in text and "S optimizer step" in text and "FBES" in text
    assert "L0…L3 the trainer's sync-free level" in text and "pp pipeline stages" in text
    assert errors == []
