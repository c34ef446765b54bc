"""The MoE section of report.html in headless Chromium (see test_report_browser.py): the 4-GPU level-3 run
recorded with its routing counts (tests/fixtures/h100_4gpu_routing/ep4_L3_torch) and the same run without them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import tracelens
from reports.html import write_report

from ._browser import open_report, plot_ok

pytestmark = pytest.mark.browser

FIX = Path(__file__).resolve().parents[1] / "fixtures"
R_L3 = FIX / "h100_4gpu_routing" / "ep4_L3_torch"
L3 = FIX / "h100_4gpu" / "ep4_L3_torch"
EP2_L3 = FIX / "h200_ep2_run" / "L3_torch"  # no layer/<i> ranges: its expert GEMMs are in no layer



def test_moe_section_heatmaps_and_tables(site, shown, shots):
    a = site.analysis("ep4_L3_routing")  # R_L3 (test_tables.py reads the same analysis: conftest.py `site`)
    rep = a.moe()
    page, errors = shown(site.report("ep4_L3_routing"))
    for div in ("plot-moe-pairs", "plot-moe-experts", "plot-moe-gemm"):
        assert plot_ok(page, div) > 3, div
    # bytes per rank pair: 4 x 4 cells in MB per step, as the view computed them
    pairs = "document.getElementById('plot-moe-pairs').data[0]"
    assert page.evaluate(f"{pairs}.type") == "heatmap"
    z = page.evaluate(f"{pairs}.z")
    want = (rep.pair_matrix("sent_bytes") / 1e6).to_numpy()
    assert len(z) == 4 and all(len(row) == 4 for row in z)
    for i, row in enumerate(z):
        assert row == pytest.approx(want[i].tolist(), abs=1e-3)
    hover = page.evaluate(f"{pairs}.text[0][1]")
    assert hover.startswith("rank 0 → rank 1<br>sent 100.663 MB<br>routed ") and "% padding" in hover
    # beside it, what those calls had to carry (the routing counts): its own panel and colour scale
    routed = page.evaluate("document.getElementById('plot-moe-pairs').data[1]")
    assert routed["name"] == "routed" and routed["xaxis"] == "x2"
    want_r = (rep.pair_matrix("routed_bytes") / 1e6).to_numpy()
    for i, row in enumerate(routed["z"]):
        assert row == pytest.approx(want_r[i].tolist(), abs=1e-3)
    # tokens per expert: one row per MoE layer, one column per expert, the routing file's sums over ranks
    doc = json.loads((R_L3 / "routing.json").read_text())
    loads = [sum(r["layers"][0]["steps"][0]["counts"][e] for r in doc["ranks"]) for e in range(64)]
    assert page.evaluate("document.getElementById('plot-moe-experts').data[0].z") == [loads]
    drawn = page.evaluate("document.querySelectorAll('#plot-moe-experts .hm image, #plot-moe-experts .heatmaplayer image').length")
    assert drawn >= 1  # plotly draws a heatmap as an image in its layer
    text = page.inner_text("#moe")
    assert "75.0% padding" in text and "Straggler: rank" in text and "late_rank finding" in text
    assert page.locator("#moe table.data").count() == 2  # per layer, per layer and rank
    assert page.locator("#moe-missing").count() == 0  # the routing file is there: nothing missing
    if shots:
        page.locator("#moe").screenshot(path=str(shots / "moe_section.png"))
    assert errors == []


def test_moe_section_without_routing_counts_says_what_is_missing(browser, shots, tmp_path):
    a = tracelens.analyze(tracelens.load(L3, cache=False))
    page, errors = open_report(browser, write_report(a, tmp_path / "report.html"))
    assert plot_ok(page, "plot-moe-pairs") > 3
    assert page.locator("#plot-moe-experts").count() == 0  # no routing counts: no tokens per expert
    missing = page.inner_text("#moe-missing")
    assert missing.startswith("No routing file (") and "routing.json" in missing and "\n" not in missing.strip()
    assert "grouped-GEMM rows: 75.0% padding" in page.inner_text("#moe-headline")
    if shots:
        page.locator("#moe").screenshot(path=str(shots / "moe_section_no_routing.png"))
    assert errors == []
    page.close()


def test_moe_tables_show_no_layer_as_a_dash_not_the_sentinel(browser, tmp_path):
    """Kernels outside any layer/<i> range (moe_view.NO_LAYER = -1): the tables' layer cell says "–", as the
    expert-GEMM figure's labels and `tracelens moe` do, never "-1"."""
    a = tracelens.analyze(tracelens.load(EP2_L3, cache=False))
    assert set(a.moe().layers["layer"]) == {-1}
    page, errors = open_report(browser, write_report(a, tmp_path / "report.html"))
    assert plot_ok(page, "plot-moe-gemm") > 3
    ticks = page.locator("#plot-moe-gemm .xtick text").evaluate_all("els => els.map(e => e.textContent)")
    assert ticks == ["rank 0 · –", "rank 1 · –"]
    cells = page.locator("#moe table.data tbody tr td:first-child").all_inner_texts()
    assert len(cells) == 3 and set(cells) == {"–"}, cells  # the per-layer row and one row per rank
    assert errors == []
    page.close()
