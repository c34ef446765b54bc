"""`ppvis.html` and the pipeline section of report.html in headless Chromium (see test_report_browser.py)."""

from __future__ import annotations

import pytest

import tracelens
from reports.html import write_report
from reports.pipeline import write_ppvis
from tracelens.analysis.pipeline import load_pipeline

from ..tracelens import _pipeline_sim as S
from .test_report_browser import browser, open_report, plot_ok  # noqa: F401  (fixture)

pytestmark = pytest.mark.browser

U = 1000
EVIL = "</script><img src=x onerror=\"window.__pwned=1\">"


def make_run(tmp_path, traces=False):
    """1F1B, p=4, m=8, two steps; stage 2 holds 3 layers, stage 3 one, the others two (see test_ppvis)."""
    layers = (2, 2, 3, 1)
    recs = []
    for st in range(2):
        recs += S.simulate(4, 8, [n * U for n in layers], [2 * n * U for n in layers], step=st, t0=st * 1000 * U)
    run = tmp_path / "run"
    S.write_jsonl(run, recs)
    S.write_manifest(run, pp=4, vpp=1, schedule="1f1b", torch_schedule=EVIL, microbatches=8, layout="Ett|tt|ttt|tL",
                     stage_layers=[[0, 1], [2, 3], [4, 5, 6], [7]], stage_to_rank=[0, 1, 2, 3])
    if traces:
        for r in range(4):
            S.write_kineto(run / "traces" / f"rank{r}.json.gz", r, 4, [x for x in recs if x["rank"] == r])
    return run


def test_ppvis_page(browser, tmp_path):  # noqa: F811
    run = make_run(tmp_path)
    page, errors = open_report(browser, write_ppvis(load_pipeline(run), tmp_path / "ppvis.html"))
    for div in ("plot-pp-lanes", "plot-pp-bubble", "plot-pp-stages"):
        assert plot_ok(page, div) > 3, div
    # lanes: one trace per kind and one for bubbles; 4 ranks x 8 microbatches of F and of B in the shown step
    names = page.evaluate("document.getElementById('plot-pp-lanes').data.map(t => t.name)")
    assert names == ["forward (F)", "backward (B)", "bubble (idle)"]
    assert page.evaluate("document.getElementById('plot-pp-lanes').data[0].x.length") == 32
    assert page.evaluate("document.getElementById('plot-pp-lanes').data[1].x.length") == 32
    drawn = page.locator("#plot-pp-lanes g.trace.bars").nth(0).locator("g.point").count()
    assert drawn == 32
    lanes = page.evaluate("document.getElementById('plot-pp-lanes').layout.yaxis.categoryarray")
    assert lanes == [f"rank {r} · pp {r}" for r in range(4)]
    statement = page.locator("p.statement.flagged").inner_text()
    assert statement.startswith("stage 2 is 1.50x slower than the mean: move 1 layer to stage 3")
    # bubble chart: measured per rank + overall, theory 3/11 for 1F1B, p=4, m=8
    theory = page.evaluate("document.getElementById('plot-pp-bubble').data[1].y")
    assert theory == pytest.approx([100 * 3 / 11] * 5, abs=1e-3)
    # a string from the manifest is shown as text, never run
    assert EVIL in page.inner_text("#pipeline")
    assert page.evaluate("window.__pwned") is None and page.locator("#pipeline img").count() == 0
    # sortable table: bubble % descending puts rank 3 (idle 60 of 84) first
    table = page.locator("#pipeline table.data").first
    header = table.locator("th", has_text="bubble %")
    header.click()
    header.click()
    assert table.locator("tbody tr td:nth-child(1)").first.inner_text() == "3"
    assert errors == []
    page.close()


def test_main_report_pipeline_section(browser, tmp_path):  # noqa: F811
    run = make_run(tmp_path, traces=True)
    a = tracelens.analyze(tracelens.load(run, cache=False))
    page, errors = open_report(browser, write_report(a, tmp_path / "report.html"))
    for div in ("plot-pp-lanes", "plot-pp-bubble", "plot-pp-stages"):
        assert plot_ok(page, div) > 3, div
    assert "move 1 layer to stage 3" in page.inner_text("#pipeline")
    assert errors == []
    page.close()
