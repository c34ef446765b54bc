"""What each report page looks like at 1400 px in headless Chromium, checked on the rendered boxes:

- no plotly legend overlaps the figure's toolbar (modebar),
- names in tables (ops, roofline ops, kernels) stay on one line, never broken mid-word,
- C++ kernel names are demangled and shortened in the cell, the full name in the cell's title,
- the ppvis verdict's colour matches its words (red only for a fixable imbalance),
- the sweep page shows its chart first and best.yaml collapsed below, with each trial's noise.

With $TRACELENS_SCREENSHOTS set, every page is also saved there as a full-page PNG (and one per section) so a
person can look at it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import tracelens
from reports.html import write_report

from ..conftest import FIXTURES, MOE_GROUPED, MOE_LOOP, NCCL_2RANK
from ..tracelens.test_ppvis import unbalanced_run
from .test_report_browser import browser, open_report, plot_ok  # noqa: F401 - the browser fixture

pytestmark = pytest.mark.browser

PP2 = FIXTURES / "h200_pp2_run"



@pytest.fixture(scope="module")
def pages(tmp_path_factory) -> dict[str, Path]:
    """Every kind of report page, written once from real fixtures."""
    from reports.diff import write_all
    from reports.memory import write_memory_report
    from reports.pipeline import write_ppvis
    from tracelens.analysis import memory as M
    from tracelens.analysis.diff import check_rules, diff, parse_rule
    from tracelens.analysis.pipeline import load_pipeline

    out = tmp_path_factory.mktemp("pages")
    loop = tracelens.analyze(tracelens.load(MOE_LOOP, cache=False))
    grouped = tracelens.analyze(tracelens.load(MOE_GROUPED, cache=False))
    p = {"report": write_report(grouped, out / "report.html"),
         "report_nccl": write_report(tracelens.analyze(tracelens.load(NCCL_2RANK, cache=False)), out / "nccl.html")}
    r = diff(loop, grouped, base_label="loop", new_label="grouped")
    p["diff"] = write_all(r, out / "diff", check_rules(r, [parse_rule("step_time>+5%")]))["diff.html"]
    mc = M.load_model_config("gpu_proxy", [])
    lay = M.resolve_layout(mc.config, world=1, source="gpu_proxy")
    sweep = M.sweep(M.load_model_config("deepseek_v2_lite", []).config, 16, 80 * M.GIB, 64, top=4)
    dsv2 = M.load_model_config("deepseek_v2_lite", []).config
    projs = [M.project(mc.config, lay)] + [
        M.project(dsv2, M.resolve_layout(dsv2, world=16, pp=int(x.pp), vpp=int(x.vpp), ep=int(x.ep), tp=int(x.tp),
                                         cp=int(x.cp), mbs=int(x.mbs), microbatches=int(x.microbatches),
                                         schedule=x.schedule, recompute=x.recompute))
        for x in sweep.head(2).itertuples(index=False)]
    p["memory"] = write_memory_report(projs, out / "memory.html", device_bytes=80 * M.GIB)
    for run in ("1f1b", "vpp2", "zb1p"):
        p[f"ppvis_{run}"] = write_ppvis(load_pipeline(PP2 / run, cache=False), out / f"ppvis_{run}.html")
    # stage 2 of the synthetic run holds 3 layers: a move that lowers it
    p["ppvis_unbalanced"] = write_ppvis(load_pipeline(unbalanced_run(out)[0], cache=False), out / "ppvis_unbalanced.html")
    return p


@pytest.fixture(scope="module")
def sweep_page(tmp_path_factory) -> Path:
    """A guided sweep replayed from the recorded H200 traces (tests/autotune/_replay_launch.py)."""
    from autotune.space import parse_space
    from autotune.sweep import run_sweep
    from reports import sweep as sweep_report

    out = tmp_path_factory.mktemp("sweep")
    space = parse_space({"config": "tiny", "knobs": {"sync_free_level": [0, 1], "grouped_gemm_backend": ["loop", "torch"]},
                         "command": [sys.executable, "tests/autotune/_replay_launch.py"]}, "space.yaml", check_trainer=False)
    return sweep_report.write(run_sweep(space, out, log=lambda m: None), space)["sweep.html"]


def _open(browser, path, shots, name):  # noqa: F811
    page, errors = open_report(browser, path)
    page.wait_for_function("() => Array.from(document.querySelectorAll('.plot')).every(d => !d.id || d.querySelector('.main-svg'))",
                           timeout=30000)
    if shots:  # $TRACELENS_SCREENSHOTS (tests/reports/conftest.py)
        page.screenshot(path=str(shots / f"{name}.png"), full_page=True)
        for sec in page.locator("main > section[id]").all():  # one image per section too: easier to look at
            sec.screenshot(path=str(shots / f"{name}--{sec.get_attribute('id')}.png"))
    return page, errors


OVERLAPS = """() => {
  const box = el => el.getBoundingClientRect();
  const hit = (a, b) => a.width > 0 && b.width > 0 && a.left < b.right && b.left < a.right && a.top < b.bottom && b.top < a.bottom;
  const out = [];
  document.querySelectorAll('.js-plotly-plot').forEach(div => {
    const legend = div.querySelector('g.legend'), bar = div.querySelector('.modebar');
    if (!legend || !bar) return;
    const l = box(legend), m = box(bar);
    out.push({id: div.id, overlap: hit(l, m), legend: [l.left, l.top, l.right, l.bottom], modebar: [m.left, m.top, m.right, m.bottom]});
  });
  return out;
}"""

# every name cell: the number of line boxes its text takes (1 = on one line)
NAME_LINES = """sel => Array.from(document.querySelectorAll(sel)).map(td => {
  const r = document.createRange(); r.selectNodeContents(td);
  const tops = new Set(Array.from(r.getClientRects()).map(x => Math.round(x.top)));
  return {text: td.textContent, lines: tops.size, title: td.getAttribute('title')};
})"""


def _legends_clear(page) -> list[dict]:
    boxes = page.evaluate(OVERLAPS)
    assert not [b for b in boxes if b["overlap"]], boxes
    return boxes


def _one_line(page, sel: str) -> list[dict]:
    cells = page.evaluate(NAME_LINES, sel)
    assert cells, sel
    assert all(c["lines"] == 1 for c in cells if c["text"]), [c for c in cells if c["text"] and c["lines"] != 1][:3]
    return cells


def test_report_page(browser, pages, shots):  # noqa: F811
    page, errors = _open(browser, pages["report"], shots, "report")
    boxes = _legends_clear(page)
    assert {"plot-timeline", "plot-categories", "plot-roofline"} <= {b["id"] for b in boxes}
    # roofline op column and every other name column: one line each, the full name in the title
    roof = _one_line(page, "#roofline table.data td.name")
    assert all(c["title"] == c["text"] for c in roof if c["text"])
    _one_line(page, "#ops td.name")
    kern = _one_line(page, "#kernels td.name")
    # the three CUTLASS grouped-GEMM kernels are mangled in the trace (1,300 characters each)
    cutlass = [c for c in kern if c["title"] and "_ZN7cutlass13device_kernel" in c["title"]]
    assert len(cutlass) == 3 and all(c["text"] == "cutlass::device_kernel<…>" for c in cutlass)
    assert all(c["title"].startswith("cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x") for c in cutlass)
    # demangled names (as Kineto writes them) are shortened, the full one on hover
    long = [c for c in kern if c["title"] and c["title"].startswith("void at::native::")]
    assert long and all(len(c["text"]) < len(c["title"]) and "…" in c["text"] for c in long)
    assert not any(c["text"].startswith("_Z") for c in kern)
    assert errors == []
    page.close()


def test_report_page_multi_rank(browser, pages, shots):  # noqa: F811
    page, errors = _open(browser, pages["report_nccl"], shots, "report_nccl")
    _legends_clear(page)
    _one_line(page, "#ops td.name")
    assert errors == []
    page.close()


def test_diff_page(browser, pages, shots):  # noqa: F811
    page, errors = _open(browser, pages["diff"], shots, "diff")
    boxes = _legends_clear(page)
    assert "plot-bars" in {b["id"] for b in boxes}  # base vs new: a legend, clear of the toolbar
    _one_line(page, "#ops td.name")
    assert errors == []
    page.close()


def test_memory_page(browser, pages, shots):  # noqa: F811
    page, errors = _open(browser, pages["memory"], shots, "memory")
    boxes = _legends_clear(page)
    assert [b["id"] for b in boxes] == ["plot-memory"]
    text = page.inner_text("#memory-bars")
    # the codes on the page are explained on it
    assert "F forward end" in text and "S optimizer step" in text and "FBES" in text
    assert "L0…L3 the trainer's sync-free level" in text and "pp pipeline stages" in text
    assert errors == []
    page.close()


def test_ppvis_verdict_colours(browser, pages, shots):  # noqa: F811
    red, green = "rgb(138, 31, 20)", "rgb(29, 91, 47)"
    # vpp2: stage 3 holds one layer and the loss head: no layer can leave it (issue 34), so not red
    for run, cls in (("unbalanced", "flagged"), ("zb1p", "ok"), ("1f1b", "neutral"), ("vpp2", "neutral")):
        page, errors = _open(browser, pages[f"ppvis_{run}"], shots, f"ppvis_{run}")
        _legends_clear(page)
        st = page.locator("p.statement")
        text, colour = st.inner_text(), st.evaluate("e => getComputedStyle(e).color")
        assert st.get_attribute("class") == f"statement {cls}", (run, text)
        if cls == "flagged":  # red: a layer move that lowers the bottleneck
            assert "move 1 layer to stage" in text and colour == red
        elif cls == "ok":
            assert text.startswith("stages are balanced") and colour == green
        else:  # uneven, but no whole-layer move helps: neither alarm nor all-clear
            assert ("would not lower" in text or "no layer move can lower" in text) and colour not in (red, green)
        assert errors == []
        page.close()


def test_sweep_page(browser, sweep_page, shots):  # noqa: F811
    page, errors = _open(browser, sweep_page, shots, "sweep")
    _legends_clear(page)
    # the chart comes before the best.yaml, which is collapsed
    chart_top = page.locator("#plot-trials").bounding_box()["y"]
    details = page.locator("#best-yaml-details")
    assert details.bounding_box()["y"] > chart_top
    assert details.evaluate("e => e.open") is False
    assert not page.locator("#best-yaml").is_visible()
    assert "grouped_gemm_backend: torch" in page.locator("#best-yaml").text_content()
    # per-knob panels: each knob on its own x axis; no two tick labels overlap
    labels = page.evaluate("""() => Array.from(document.querySelectorAll('#plot-knobs .xaxislayer-above text')).map(t => {
        const b = t.getBoundingClientRect(); return [b.left, b.right, b.top, b.bottom, t.textContent]; })""")
    assert len(labels) == 4
    for i, a in enumerate(labels):
        for b in labels[i + 1:]:
            assert a[1] <= b[0] or b[1] <= a[0] or a[3] <= b[2] or b[3] <= a[2], (a, b)
    # repeat noise per trial: the s.e. column and the whiskers' data
    headers = page.locator("#trials table.data th").all_inner_texts()
    assert "s.e. %" in headers
    assert page.evaluate("document.getElementById('plot-trials').data[0].error_y.array.length") == 4
    assert errors == []
    page.close()
