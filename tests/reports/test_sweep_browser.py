"""The sweep report in headless Chromium: every chart drawn, no JavaScript errors, the guided path with
the finding behind each step, the ready best.yaml shown, and the best-vs-baseline diff linked and
rendering. Trials are replayed from the recorded H200 MoE traces (tests/autotune/_replay_launch.py),
so the findings are a real GPU run's."""

from __future__ import annotations

import sys

import pytest
import yaml

from autotune.space import parse_space
from autotune.sweep import run_sweep
from reports import sweep as sweep_report

from .test_report_browser import browser, open_report, plot_ok  # noqa: F401 - the browser fixture

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    space = parse_space({"config": "tiny", "knobs": {"sync_free_level": [0, 1], "grouped_gemm_backend": ["loop", "torch"]},
                         "command": [sys.executable, "tests/autotune/_replay_launch.py"]}, "space.yaml", check_trainer=False)
    res = run_sweep(space, out, log=lambda m: None)
    return res, space, sweep_report.write(res, space)


def test_sweep_path_is_the_findings(sweep):
    res, _, paths = sweep
    # loop trace: launch-bound (high) on the per-expert loop -> the grouped backend first (+50 %: kept);
    # the grouped trace is launch-bound too -> sync_free_level 1 (+10 %: kept); its small-kernels finding
    # then tries the remaining backend, loop (-39 %: reverted); nothing left
    assert [(p["knobs"]["sync_free_level"], p["knobs"]["grouped_gemm_backend"], p["decision"]) for p in res.path] == [
        (0, "loop", "start"), (0, "torch", "kept"), (1, "torch", "kept"), (1, "loop", "reverted")]
    assert all(p["motivation"].startswith("finding launch_bound (high)") for p in res.path[1:3])
    assert res.path[3]["motivation"].startswith("finding small_kernels (high)")
    assert res.best["objective"] == 1650.0 and res.stopped == "no finding left"
    assert yaml.safe_load(paths["best.yaml"].read_text()) == {"base": "replay", "sync_free_level": 1,
                                                               "grouped_gemm_backend": "torch"}
    assert paths["diff.html"].exists()


def test_sweep_report_renders(browser, sweep):  # noqa: F811
    res, _, paths = sweep
    page, errors = open_report(browser, paths["sweep.html"])
    for div in ("plot-trials", "plot-path", "plot-knobs"):
        assert plot_ok(page, div) > 3, div
    assert page.evaluate("document.getElementById('plot-trials').data[0].y.length") == 4
    assert page.evaluate("document.getElementById('plot-knobs').data.length") == 2  # one trace per knob
    assert page.locator("#plot-trials .bars .point").count() == 4
    assert "grouped_gemm_backend: torch" in page.text_content("#best-yaml")  # collapsed in a <details>
    path_text = page.inner_text("#path")
    assert path_text.count("finding launch_bound (high)") == 2 and "finding small_kernels (high)" in path_text
    assert "reverted" in path_text and "kept" in path_text
    assert "1.65× the baseline" in page.inner_text("#summary")
    assert errors == []
    page.click("#diff-link")
    page.wait_for_load_state("load")
    assert page.url.endswith("diff_best_vs_baseline/diff.html")
    assert plot_ok(page, "plot-bars") > 3
    assert "best (trial 3)" in page.inner_text("header")
    assert errors == []
    page.close()
