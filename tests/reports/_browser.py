"""Opening a report page in headless Chromium (Playwright) and the checks on its rendered boxes that several
test files share. The fixtures (one browser per worker, pages written once, opened once) are in conftest.py.

A page is "open" once its plotly.js is unpacked and every figure drawn: base.html sets
``<html data-figures="drawn">`` (or ``"failed"``); nothing here waits a fixed time.
"""

from __future__ import annotations

import os
from pathlib import Path

CHROMIUM = os.environ.get("TRACELENS_CHROMIUM", "/usr/bin/chromium")
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
# Every page is looked at 1400 px wide (the layout checks) and 900 px high: the first screen the verdict must fit
# (issue 36). No page's layout depends on the window's height (no vh units; every figure has its own height), so
# one window size serves every check and a page opened once serves every test that reads it.
VIEWPORT = {"width": 1400, "height": 900}
# How long a page may take to draw. Generous on purpose: the checks never depend on how fast the page draws, and
# on a loaded 2-core machine (CI with another worker, or another process running) the largest reports take over
# 20 s; a timeout here is a page that never draws, not a slow one.
DRAW_TIMEOUT_MS = 180_000


def open_report(browser, path: Path):
    """A new tab on the page at `path`, its figures drawn; returns (page, errors): every JavaScript error, console
    error and request that leaves the file (a page must work offline) that the page has had since it opened."""
    page = browser.new_page(viewport=VIEWPORT)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("request", lambda r: errors.append(f"network request: {r.url}")
            if not r.url.startswith(("file:", "data:", "blob:")) else None)
    page.goto(Path(path).resolve().as_uri())
    page.wait_for_load_state("load")
    wait_drawn(page)
    return page, errors


def wait_drawn(page):
    """Until the page has unpacked its plotly.js and drawn every figure (base.html marks <html data-figures>)."""
    page.wait_for_function("document.documentElement.dataset.figures !== undefined", timeout=DRAW_TIMEOUT_MS)
    assert page.evaluate("document.documentElement.dataset.figures") == "drawn"


def plot_ok(page, div_id):
    """The number of paths and rects in the figure `div_id` (its SVG must be there)."""
    page.wait_for_selector(f"#{div_id} .main-svg", timeout=DRAW_TIMEOUT_MS)
    return page.evaluate(
        """id => { const el = document.getElementById(id);
                  return el.querySelectorAll('path, rect').length; }""", div_id)


def every_plot_drawn(page):
    """Every figure container of the page holds its SVG."""
    page.wait_for_function("() => Array.from(document.querySelectorAll('.plot')).every(d => !d.id || d.querySelector('.main-svg'))",
                           timeout=DRAW_TIMEOUT_MS)


def save_shots(page, shots: Path | None, name: str):
    """With $TRACELENS_SCREENSHOTS (conftest.py `shots`): the full page and one image per section, for a person."""
    if shots is None:
        return
    page.screenshot(path=str(shots / f"{name}.png"), full_page=True)
    for sec in page.locator("main > section[id]").all():  # one image per section too: easier to look at
        sec.screenshot(path=str(shots / f"{name}--{sec.get_attribute('id')}.png"))


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


def legends_clear(page) -> list[dict]:
    """No plotly legend overlaps its figure's toolbar (modebar); returns every figure's boxes."""
    boxes = page.evaluate(OVERLAPS)
    assert not [b for b in boxes if b["overlap"]], boxes
    return boxes


def one_line(page, sel: str) -> list[dict]:
    """Every non-empty cell matched by `sel` (there are some) takes one line; returns the cells."""
    cells = page.evaluate(NAME_LINES, sel)
    assert cells, sel
    assert all(c["lines"] == 1 for c in cells if c["text"]), [c for c in cells if c["text"] and c["lines"] != 1][:3]
    return cells
