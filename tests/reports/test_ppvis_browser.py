"""`ppvis.html` and the pipeline section of report.html in headless Chromium (see test_report_browser.py), and the
colour of each ppvis page's verdict (test_layout_browser.py's check, on the pages this file opens)."""

from __future__ import annotations

import pytest

import tracelens
from reports.html import write_report
from reports.pipeline import write_ppvis
from tracelens.analysis.pipeline import load_pipeline

from ..conftest import FIXTURES
from ..tracelens import _pipeline_sim as S
from ._browser import every_plot_drawn, legends_clear, open_report, plot_ok, save_shots

pytestmark = pytest.mark.browser

U = 1000
PP2 = FIXTURES / "h200_pp2_run"  # the 2 x H200 pipeline runs: 1f1b, vpp2 (interleaved), zb1p (zero bubble)
PARTS = ["schedule theory", "stage imbalance", "p2p / comm wait", "host / launch overhead", "other"]
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


@pytest.fixture(scope="module")
def ppvis_pages(tmp_path_factory) -> dict:
    """ppvis.html of the synthetic run (make_run, no traces) and of each 2 x H200 run, with their analyses."""
    out = tmp_path_factory.mktemp("ppvis")
    runs = {"synthetic": make_run(out), **{r: PP2 / r for r in ("1f1b", "vpp2", "zb1p")}}
    res = {name: load_pipeline(run, cache=False) for name, run in runs.items()}
    return {name: (r, write_ppvis(r, out / f"ppvis_{name}.html")) for name, r in res.items()}


def test_ppvis_page(ppvis_pages, shown):
    page, errors = shown(ppvis_pages["synthetic"][1])
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
    # bubble account: one stacked bar per rank, five parts; no traces, so no comm/host and no overhead here
    acc = "document.getElementById('plot-pp-account')"
    assert plot_ok(page, "plot-pp-account") > 3
    assert page.evaluate(f"{acc}.data.map(t => t.name)") == PARTS
    stacked = page.evaluate(f"{acc}.data.map(t => t.y)")
    # per step (step 1), ms: theory min(18, idle) = 18, 18, 12, 18 µs; imbalance 18, 18, 0, 42 µs
    assert stacked[0] == pytest.approx([0.018, 0.018, 0.012, 0.018]) and stacked[1] == pytest.approx([0.018, 0.018, 0, 0.042])
    assert [sum(col) for col in zip(*stacked)] == pytest.approx([0.036, 0.036, 0.012, 0.060])  # = idle per rank
    drawn = page.evaluate("""[...document.querySelectorAll('#plot-pp-account g.trace.bars g.point path')]
                             .filter(p => p.getBBox().height > 0).length""")
    assert drawn == 4 + 3  # theory on every rank, imbalance on all but rank 2 (the slow stage)
    assert "Bubble account (step 1)" in page.inner_text("#pipeline")
    assert page.locator("table.account-advice tr").count() == 5
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


def test_main_report_pipeline_section(browser, tmp_path):
    run = make_run(tmp_path, traces=True)
    a = tracelens.analyze(tracelens.load(run, cache=False))
    page, errors = open_report(browser, write_report(a, tmp_path / "report.html"))
    for div in ("plot-pp-lanes", "plot-pp-bubble", "plot-pp-stages"):
        assert plot_ok(page, div) > 3, div
    assert "move 1 layer to stage 3" in page.inner_text("#pipeline")
    assert errors == []
    page.close()


def test_account_on_a_real_run(ppvis_pages, site, shown, shots):
    """The interleaved 2 x H200 run: ppvis.html and report.html show each rank's idle split into the five
    parts; the bars add up to the measured idle, and the page's numbers are the analysis's."""
    res, ppvis = ppvis_pages["vpp2"]
    pr = res.account.per_rank.sort_values("rank")
    page, errors = shown(ppvis)
    assert plot_ok(page, "plot-pp-account") > 3
    data = page.evaluate("document.getElementById('plot-pp-account').data.map(t => [t.name, t.x, t.y])")
    assert [d[0] for d in data] == PARTS and data[0][1] == ["rank 0 · pp 0", "rank 1 · pp 1"]
    for i, key in enumerate(["theory", "imbalance", "comm", "host", "other"]):
        assert data[i][2] == pytest.approx((pr[f"{key}_ns"] / 1e6).tolist(), abs=1e-6)  # one step (4)
    assert [sum(d[2][r] for d in data) for r in (0, 1)] == pytest.approx((pr["idle_ns"] / 1e6).tolist(), abs=1e-5)
    # every part drawn on both ranks except imbalance on the slow stage's rank 1 (it waits on nobody)
    drawn = page.evaluate("""[...document.querySelectorAll('#plot-pp-account g.trace.bars g.point path')]
                             .filter(p => p.getBBox().height > 0).length""")
    assert drawn == 9
    text = page.inner_text("#pipeline")
    assert "Bubble account (step 4)" in text and "the traces cover" in text
    advice = page.locator("table.account-advice").inner_text()
    # stage 3 holds one layer and the loss head: no layer can leave it, so the advice says what helps instead
    assert "move 1 layer" not in advice and "single layer and the loss head" in advice
    assert "CUDA graphs" in advice and "communication kernel" in advice
    if shots:  # $TRACELENS_SCREENSHOTS (tests/reports/conftest.py)
        page.locator("#plot-pp-account").scroll_into_view_if_needed()
        page.screenshot(path=str(shots / "account.png"), full_page=False)
    assert errors == []
    # the main report's pipeline section has the same account (its report is test_report_browser.py's too)
    page, errors = shown(site.report("pp2_vpp2"))
    assert plot_ok(page, "plot-pp-account") > 3
    data = page.evaluate("document.getElementById('plot-pp-account').data.map(t => t.y)")
    assert [sum(col) for col in zip(*data)] == pytest.approx((pr["idle_ns"] / 1e6).tolist(), abs=1e-5)
    assert errors == []


def test_ppvis_verdict_colours(ppvis_pages, shown, shots):
    """At 1400 px (test_layout_browser.py's checks): the verdict's colour matches its words, no legend over a
    figure's toolbar."""
    red, green = "rgb(138, 31, 20)", "rgb(29, 91, 47)"
    # synthetic: stage 2 holds 3 layers, a move that lowers it (make_run); vpp2: stage 3 holds one layer and the
    # loss head: no layer can leave it (issue 34), so not red
    for run, cls in (("synthetic", "flagged"), ("zb1p", "ok"), ("1f1b", "neutral"), ("vpp2", "neutral")):
        page, errors = shown(ppvis_pages[run][1])
        every_plot_drawn(page)
        save_shots(page, shots, f"ppvis_{run}")
        legends_clear(page)
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
