"""Fixtures shared by the real-browser tests of the HTML pages (helpers in _browser.py).

What a browser test costs, and so what these fixtures share (measured on 2 cores): writing a 4-GPU run's report
is 4-7 s of analysis; opening a page in Chromium is 2-7 s of CPU (unpacking and running plotly.js, drawing every
figure, laying out the tables), most of it in renderer processes that `time` does not see; starting Chromium is
~1 s. So:

* `browser`: one Chromium per pytest worker (session);
* `site`: each fixture run's analysis and report.html, made once per worker, for every file that looks at it;
* `shown`: a page opened once per test file for the tests that only read it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from ..conftest import CPU_ONLY, FIXTURES, MOE_GROUPED, MOE_LOOP, NCCL_2RANK
from ._browser import CHROMIUM, FLAGS, open_report


@pytest.fixture(scope="module")
def shots() -> Path | None:
    """Where the tests' screenshots go: $TRACELENS_SCREENSHOTS, to look at them; None (no screenshots) when it is
    unset. A screenshot is for a person, never checked: a full page and each of its sections cost Chromium more
    time than every check of the page together (test_layout_browser.py: ~50 of its ~90 s), so a plain run
    takes none."""
    d = os.environ.get("TRACELENS_SCREENSHOTS")
    if not d:
        return None
    out = Path(d)
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.fixture(scope="session")
def browser():
    """Headless Chromium, started once per worker; each test opens its own tabs in it."""
    if not shutil.which(CHROMIUM) and not os.path.exists(CHROMIUM):
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM} not installed: CI must run the browser test (apt-get install chromium)")
        pytest.skip(f"{CHROMIUM} not installed (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        yield b
        b.close()


@pytest.fixture(scope="module")
def shown(browser):
    """`shown(path)` -> (page, errors): the page opened once for this test file (open_report), then handed to each
    test that asks for it, scrolled back to the top. For tests that read the page: they may scroll, hover and sort
    a table (no check reads a table's row order except the sorting test's own), never navigate or resize it; a
    test that does opens its own tab (open_report). `errors` holds every error since the page opened. The tabs
    close with the module: a drawn report holds ~200 MB in Chromium."""
    opened: dict[Path, tuple] = {}

    def show(path):
        key = Path(path).resolve()
        if key not in opened:
            opened[key] = open_report(browser, key)
        page, errors = opened[key]
        page.evaluate("window.scrollTo(0, 0)")
        return page, errors

    yield show
    for page, _ in opened.values():
        page.close()


RUNS = {  # the fixture runs whose report more than one test looks at
    "cpu_run": FIXTURES / "cpu_whatif_grid" / "rep0" / "base",  # the tiny trainer on the CPU
    "cpu_only": CPU_ONLY,  # a trace with no GPU events
    "nccl_2rank": NCCL_2RANK,  # 2 x H200, NCCL all-reduce
    "moe_loop": MOE_LOOP,  # 1 GPU, the per-expert loop
    "moe_grouped": MOE_GROUPED,  # 1 GPU, grouped GEMMs (CUTLASS)
    "pp2_vpp2": FIXTURES / "h200_pp2_run" / "vpp2",  # 2 x H200, interleaved pipeline
    "ep4_cap_ovl": FIXTURES / "h100_4gpu" / "ep4_cap_ovl",  # 4 x H100, expert parallel, capacity + overlap
    "ep4_L3_routing": FIXTURES / "h100_4gpu_routing" / "ep4_L3_torch",  # ... level 3, with its routing counts
}


class Site:
    """Each run's analysis and report.html, made on first use and kept for the session (per pytest worker; under
    `--dist loadfile` the files that share one mostly share a worker). An Analysis computes each view once and
    keeps it, so a test that reads `analysis(name).moe()` after the report was written reads what the page shows."""

    def __init__(self, root: Path):
        self.root = root
        self._analyses: dict = {}
        self._reports: dict[str, Path] = {}

    def analysis(self, name: str):
        import tracelens

        if name not in self._analyses:
            self._analyses[name] = tracelens.analyze(tracelens.load(RUNS[name], cache=False, progress=False))
        return self._analyses[name]

    def report(self, name: str) -> Path:
        from reports.html import write_report

        if name not in self._reports:
            self._reports[name] = write_report(self.analysis(name), self.root / f"{name}.html")
        return self._reports[name]


@pytest.fixture(scope="session")
def site(tmp_path_factory) -> Site:
    return Site(tmp_path_factory.mktemp("site"))
