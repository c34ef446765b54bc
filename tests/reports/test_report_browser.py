"""The HTML report in a real browser: Debian's Chromium driven by Playwright.

Checks what a user sees: no JavaScript errors, every chart drawn (plotly's SVG present and non-empty),
tables sortable, and strings from a hostile trace shown as text, never executed.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil

import pytest

import tracelens
from reports.html import write_report

from ..conftest import CPU_ONLY, FIXTURES, MOE_LOOP, NCCL_2RANK

CHROMIUM = os.environ.get("TRACELENS_CHROMIUM", "/usr/bin/chromium")
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def browser():
    if not shutil.which(CHROMIUM) and not os.path.exists(CHROMIUM):
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM} not installed: CI must run the browser test (apt-get install chromium)")
        pytest.skip(f"{CHROMIUM} not installed (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        yield b
        b.close()


def open_report(browser, path):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("request", lambda r: errors.append(f"network request: {r.url}") if not r.url.startswith(("file:", "data:", "blob:")) else None)
    page.goto(path.resolve().as_uri())
    page.wait_for_load_state("load")
    wait_drawn(page)
    return page, errors


def wait_drawn(page):
    """Until the page has unpacked its plotly.js and drawn every figure (base.html marks <html data-figures>)."""
    page.wait_for_function("document.documentElement.dataset.figures !== undefined", timeout=20000)
    assert page.evaluate("document.documentElement.dataset.figures") == "drawn"


def plot_ok(page, div_id):
    page.wait_for_selector(f"#{div_id} .main-svg", timeout=20000)
    return page.evaluate(
        """id => { const el = document.getElementById(id);
                  return el.querySelectorAll('path, rect').length; }""", div_id)


def test_report_renders_charts_and_sorts(browser, tmp_path):
    a = tracelens.analyze(tracelens.load(NCCL_2RANK, cache=False))
    report = write_report(a, tmp_path / "report.html")
    page, errors = open_report(browser, report)
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
    page.close()


def test_cpu_only_report(browser, tmp_path):
    a = tracelens.analyze(tracelens.load(CPU_ONLY, cache=False))
    report = write_report(a, tmp_path / "cpu.html")
    page, errors = open_report(browser, report)
    assert "GPU sections unavailable" in page.inner_text("#timeline")
    assert plot_ok(page, "plot-breakdown") > 0
    assert errors == []
    page.close()


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


def test_diff_report_renders(browser, tmp_path):
    from reports.diff import write_all
    from tracelens.analysis.diff import check_rules, diff, parse_rule

    from ..conftest import MOE_GROUPED

    b = tracelens.analyze(tracelens.load(MOE_LOOP, cache=False))
    n = tracelens.analyze(tracelens.load(MOE_GROUPED, cache=False))
    r = diff(b, n, base_label="loop <b>", new_label="grouped")
    paths = write_all(r, tmp_path / "d", check_rules(r, [parse_rule("step_time>+5%")]))
    page, errors = open_report(browser, paths["diff.html"])
    assert plot_ok(page, "plot-bars") > 3 and plot_ok(page, "plot-waterfall") > 3
    assert page.locator("#waterfall .waterfall").count() >= 1 or page.locator("#plot-waterfall path").count() > 3
    assert "loop <b>" in page.inner_text("header")  # a label from the command line, shown as text
    assert "aten::_grouped_mm" in page.inner_text("#ops")
    assert errors == []
    page.close()


VERDICT_RUNS = {  # issue 36: a CPU run, the 2-GPU NCCL traces, a pipeline- and an expert-parallel run
    "cpu_run": FIXTURES / "cpu_whatif_grid" / "rep0" / "base",
    "nccl_2rank": NCCL_2RANK,
    "pp4_1f1b": FIXTURES / "h100_4gpu" / "pp4_1f1b",
    "ep4_cap_ovl": FIXTURES / "h100_4gpu" / "ep4_cap_ovl",
}


@pytest.mark.parametrize("name", list(VERDICT_RUNS))
def test_the_verdict_is_the_first_screen(browser, tmp_path, shots, name):
    """At 1400 x 900 the first screen holds the bottleneck, the step's bar and the three actions, each with its
    gain (what-if prediction or the finding's estimate); a screenshot of it with $TRACELENS_SCREENSHOTS."""
    a = tracelens.analyze(tracelens.load(VERDICT_RUNS[name], cache=False))
    report = write_report(a, tmp_path / "report.html")
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(report.resolve().as_uri())
    page.wait_for_load_state("load")
    wait_drawn(page)
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
    page.close()
