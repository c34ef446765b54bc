"""The report's critical-path section in a real browser (Chromium via Playwright, as test_report_browser.py):
the path figure drawn with one row per rank it runs through, the statement naming the rank and cause, the tables,
and a one-line note instead of the section when the input has no path across ranks."""

from __future__ import annotations

import gzip
import json

import pytest

import tracelens
from reports.html import write_report

from ..conftest import FIXTURES, NCCL_2RANK, write_json_gz
from ._browser import open_report, plot_ok

pytestmark = pytest.mark.browser
EP4 = FIXTURES / "h100_4gpu" / "ep4_L0_loop"


def test_critpath_section_renders(browser, shots, tmp_path):
    a = tracelens.analyze(tracelens.load(EP4, cache=False, progress=False))
    report = write_report(a, tmp_path / "report.html")
    page, errors = open_report(browser, report)
    assert plot_ok(page, "plot-critpath") > 10
    # one row per rank on the path, and the bars of each label sum to the path's time on that rank
    rows = page.evaluate("[...new Set(document.getElementById('plot-critpath').data.flatMap(t => t.y))]")
    cp = a.critical_path()
    assert sorted(rows) == [f"rank {r}" for r in sorted(cp.by_rank()["rank"])]
    drawn = page.evaluate("document.getElementById('plot-critpath').data.flatMap(t => t.x).reduce((s, v) => s + v, 0)")
    assert drawn == pytest.approx(cp.span_ns / 1e6, rel=1e-3)
    text = page.inner_text("#critpath-statement")
    assert "rank 0" in text and "largest part is launch-bound (78% of its time there)" in text
    assert "launch-bound" in page.inner_text("#critpath-causes") and "waits for rank" in page.inner_text("#critpath-hops")
    if shots:  # $TRACELENS_SCREENSHOTS (tests/reports/conftest.py)
        page.locator("#critpath").screenshot(path=str(shots / "critpath.png"))
    assert errors == []
    page.close()


def test_critpath_unavailable_is_one_line(browser, tmp_path):
    src = tmp_path / "run"
    src.mkdir()
    for f in sorted(NCCL_2RANK.glob("rank*.json.gz")):
        with gzip.open(f) as fh:
            doc = json.load(fh)
        if f.name.startswith("rank1"):  # rank 1 from "another run": none of its collectives match rank 0's
            for e in doc["traceEvents"]:
                if "Collective name" in (e.get("args") or {}):
                    e["args"]["Collective name"] = "broadcast"
                if e.get("name") in ("c10d::send", "c10d::recv_"):
                    e["name"] = "c10d::barrier"
        write_json_gz(doc, src / f.name)
    a = tracelens.analyze(tracelens.load(src, cache=False, progress=False))
    page, errors = open_report(browser, write_report(a, tmp_path / "report.html"))
    note = page.inner_text("#critpath-unavailable")
    assert note.startswith("No critical path:") and "no collective or send/receive is matched" in note and "\n" not in note
    assert page.locator("#plot-critpath").count() == 0
    assert errors == []
    page.close()
