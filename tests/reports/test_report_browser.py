"""The HTML report in a real browser: Debian's Chromium driven by Playwright.

Checks what a user sees: no JavaScript errors, every chart drawn (plotly's SVG present and non-empty),
tables sortable, and strings from a hostile trace shown as text, never executed; the verdict on the first
screen; the 2-rank report's and the diff page's layout (test_layout_browser.py's checks, here where the page is
open anyway: conftest.py `shown`).
"""

from __future__ import annotations

import gzip
import json

import pytest

import tracelens
from reports.html import write_report

from ..conftest import MOE_LOOP
from ._browser import (
    every_plot_drawn,
    legends_clear,
    one_line,
    open_report,
    plot_ok,
    save_shots,
)

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def diff_page(site, tmp_path_factory):
    """The loop -> grouped-GEMM diff of the 1-GPU MoE traces, its base labelled with markup from the command line."""
    from reports.diff import write_all
    from tracelens.analysis.diff import check_rules, diff, parse_rule

    r = diff(site.analysis("moe_loop"), site.analysis("moe_grouped"), base_label="loop <b>", new_label="grouped")
    return write_all(r, tmp_path_factory.mktemp("diff"), check_rules(r, [parse_rule("step_time>+5%")]))["diff.html"]


def test_report_renders_charts_and_sorts(site, shown):
    page, errors = shown(site.report("nccl_2rank"))
    for div in ("plot-timeline", "plot-categories", "plot-breakdown", "plot-roofline"):
        assert plot_ok(page, div) > 3, div
    assert page.locator("#findings li").count() >= 3  # ranked findings rendered
    assert "allreduce" in page.inner_text("#comm")
    # the timeline has one bar row per rank and its stacked parts: communication kernels' waits for another rank
    # are their own part (no pipeline here: no pipeline-wait part)
    assert page.evaluate("document.getElementById('plot-timeline').data.map(t => t.name)") == [
        "compute", "exposed comm", "comm wait", "memcpy", "memset", "idle"]
    assert page.locator("#plot-breakdown .slice").count() >= 5  # sunburst sectors drawn
    # sorting: click "count" in the kernels table twice -> ascending then descending order
    table = page.locator("#kernels table.data")
    header = table.locator("th", has_text="count")
    header.click()
    asc = [float(v) for v in table.locator("tbody tr td:nth-child(4)").evaluate_all("els => els.map(e => e.dataset.v)")]
    assert asc == sorted(asc)
    header.click()
    desc = [float(v) for v in table.locator("tbody tr td:nth-child(4)").evaluate_all("els => els.map(e => e.dataset.v)")]
    assert desc == sorted(desc, reverse=True)
    assert errors == []


def test_report_page_multi_rank(site, shown, shots):
    """The 2-rank report at 1400 px (the checks of test_layout_browser.py): no legend over a figure's toolbar,
    op names on one line."""
    page, errors = shown(site.report("nccl_2rank"))
    every_plot_drawn(page)
    legends_clear(page)
    one_line(page, "#ops td.name")
    # every table fits the page's width or scrolls in its own box: the per-step table (15 columns) once widened
    # the whole page past the window, its last columns cut off at the section's edge
    assert page.evaluate("document.documentElement.scrollWidth <= document.documentElement.clientWidth")
    assert page.locator("#timeline .scroll table.data").count() == 1
    save_shots(page, shots, "report_nccl")
    assert errors == []


def test_cpu_only_report(site, shown):
    page, errors = shown(site.report("cpu_only"))
    assert "GPU sections unavailable" in page.inner_text("#timeline")
    # the trace is rank 34 of 300: the 299 missing ranks are named as `tracelens check` names them (the first 16,
    # then how many), in the verdict's warning and in the health section, not as 299 numbers over the first screen
    for sel in (".verdict-health", "#health li.sev-medium"):
        text = page.inner_text(sel)
        assert "0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, … (299 in all)" in text and "298" not in text, text
    assert plot_ok(page, "plot-breakdown") > 0
    assert errors == []


def test_hostile_strings_are_escaped(browser, tmp_path):
    doc = json.loads(gzip.decompress(MOE_LOOP.read_bytes()))
    evil_kernel = "</script><script>window.__pwned=1</script><img src=x onerror=\"window.__pwned=2\">"
    evil_op = "aten::<b onmouseover=alert(1)>evil</b>"
    for e in doc["traceEvents"]:
        if e.get("cat") == "kernel":
            e["name"] = evil_kernel
        if e.get("cat") == "cpu_op" and e.get("name") == "aten::mm":
            e["name"] = evil_op
    src = tmp_path / "evil.json"
    src.write_text(json.dumps(doc))
    a = tracelens.analyze(tracelens.load(src, cache=False))
    report = write_report(a, tmp_path / "evil.html")
    page, errors = open_report(browser, report)
    plot_ok(page, "plot-breakdown")
    assert page.evaluate("window.__pwned") is None
    text = page.inner_text("#kernels")
    assert evil_kernel in text and evil_op in text  # shown literally, as text
    assert page.locator("#kernels img").count() == 0 and page.locator("#ops b").count() == 0
    assert not [e for e in errors if "pwned" in e]
    page.close()


def test_diff_report_renders(diff_page, shown):
    page, errors = shown(diff_page)
    assert plot_ok(page, "plot-bars") > 3 and plot_ok(page, "plot-waterfall") > 3
    assert page.locator("#waterfall .waterfall").count() >= 1 or page.locator("#plot-waterfall path").count() > 3
    assert "loop <b>" in page.inner_text("header")  # a label from the command line, shown as text
    assert "aten::_grouped_mm" in page.inner_text("#ops")
    # count metrics (host syncs, kernels per step): a whole value shown as a whole number, "3" not "3.000"
    rows = page.locator("#metrics table.data tbody tr").evaluate_all(
        "trs => trs.map(tr => Array.from(tr.cells).map(td => [td.textContent, td.dataset.v]))")
    counts = [r for r in rows if r[1][0] == "count"]
    assert [r[0][0] for r in counts] == ["host_syncs", "kernels"]
    cells = [c for r in counts for c in r[2:5] if c[1] not in ("", None) and float(c[1]).is_integer()]
    assert cells and all("." not in text for text, _ in cells), counts
    # the note says what marks a change as noise: Welch's test, not the spread (a change larger than the spread
    # can be noise and a smaller one significant)
    assert "Welch's test" in page.inner_text("#metrics-note") and "p ≥ 0.05" in page.inner_text("#metrics-note")
    assert errors == []


def test_diff_page(diff_page, shown, shots):
    """The diff page at 1400 px (the checks of test_layout_browser.py): the base-vs-new legend clear of the toolbar,
    op names on one line."""
    page, errors = shown(diff_page)
    every_plot_drawn(page)
    boxes = legends_clear(page)
    assert "plot-bars" in {b["id"] for b in boxes}  # base vs new: a legend, clear of the toolbar
    one_line(page, "#ops td.name")
    save_shots(page, shots, "diff")
    assert errors == []


# issue 36: a CPU run, the 2-GPU NCCL traces, a pipeline- and an expert-parallel run. The pipeline run is the
# interleaved 2 x H200 one (its report is test_ppvis_browser.py's too: written once per worker, conftest.py `site`)
VERDICT_RUNS = ["cpu_run", "nccl_2rank", "pp2_vpp2", "ep4_cap_ovl"]


@pytest.mark.parametrize("name", VERDICT_RUNS)
def test_the_verdict_is_the_first_screen(site, shown, shots, name):
    """At 1400 x 900 the first screen holds the bottleneck, the step's bar and the three actions, each with its
    gain (what-if prediction or the finding's estimate); a screenshot of it with $TRACELENS_SCREENSHOTS."""
    page, errors = shown(site.report(name))  # a 1400 x 900 window (_browser.VIEWPORT), scrolled to the top
    assert page.viewport_size == {"width": 1400, "height": 900} and page.evaluate("window.scrollY") == 0
    assert page.evaluate("document.querySelector('main section').id") == "verdict"

    def bottom(selector):
        return page.evaluate("s => document.querySelector(s).getBoundingClientRect().bottom", selector)

    assert page.inner_text("#verdict-bottleneck").lower().startswith("bottleneck: ")
    assert bottom("#verdict-bottleneck") <= 900 and bottom("#verdict-step") <= 900
    heads = page.locator("#verdict-actions > li .head")
    assert heads.count() == 3
    for i in range(3):
        box = heads.nth(i).bounding_box()
        assert box["y"] + box["height"] <= 900, (name, i, box)  # inside the first screen, not scrolled to
        assert heads.nth(i).locator(".gain").inner_text().strip(), (name, i)  # a gain or an estimate beside it
    widths = page.evaluate("Array.from(document.querySelectorAll('#verdict-step .seg')).map(e => e.getBoundingClientRect().width)")
    assert widths and sum(widths) == pytest.approx(page.locator("#verdict-step").bounding_box()["width"] - 2, abs=3)
    if shots is not None:
        page.screenshot(path=str(shots / f"verdict_{name}.png"))  # the first 1400 x 900 screen
    assert not errors, errors
