"""The sweep report in headless Chromium: every chart drawn, no JavaScript errors, the guided path with
the finding behind each step, the ready best.yaml shown, and the best-vs-baseline diff linked and
rendering. Trials are replayed from the recorded H200 MoE traces (tests/autotune/_replay_launch.py),
so the findings are a real GPU run's.

The what-if sections (issue 18) on a real tiny sweep of the trainer on the CPU, steered by the model:
predicted vs measured per model-driven trial, the configs predicted out of memory (not run), and the
step decomposition of the baseline vs each kept move. Expected numbers come from the store file and the
trials' manifests, read here with sqlite3 and json."""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path

import pytest
import yaml

from autotune.space import parse_space
from autotune.sweep import run_sweep
from reports import sweep as sweep_report

from ._browser import every_plot_drawn, legends_clear, plot_ok, save_shots, wait_drawn

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
    # loop trace: small kernels (high; it claims the launch-bound idle before its ops, so it ranks first) on the
    # per-expert loop -> the grouped backend first (+50 %: kept); the grouped trace is launch-bound -> sync_free_level
    # 1 (+10 %: kept); its small-kernels finding then tries the remaining backend, loop (-39 %: reverted); nothing left
    assert [(p["knobs"]["sync_free_level"], p["knobs"]["grouped_gemm_backend"], p["decision"]) for p in res.path] == [
        (0, "loop", "start"), (0, "torch", "kept"), (1, "torch", "kept"), (1, "loop", "reverted")]
    assert [p["motivation"].split(":")[0] for p in res.path[1:]] == [
        "finding small_kernels (high)", "finding launch_bound (high)", "finding small_kernels (high)"]
    assert res.best["objective"] == 1650.0 and res.stopped == "no finding left"
    assert yaml.safe_load(paths["best.yaml"].read_text()) == {"base": "replay", "sync_free_level": 1,
                                                               "grouped_gemm_backend": "torch"}
    assert paths["diff.html"].exists()


def test_sweep_report_renders(sweep, shown):
    _, _, paths = sweep
    page, errors = shown(paths["sweep.html"])
    for div in ("plot-trials", "plot-path", "plot-knobs"):
        assert plot_ok(page, div) > 3, div
    assert page.evaluate("document.getElementById('plot-trials').data[0].y.length") == 4
    assert page.evaluate("document.getElementById('plot-knobs').data.length") == 2  # one trace per knob
    assert page.locator("#plot-trials .bars .point").count() == 4
    assert "grouped_gemm_backend: torch" in page.text_content("#best-yaml")  # collapsed in a <details>
    path_text = page.inner_text("#path")
    assert path_text.count("finding small_kernels (high)") == 2 and path_text.count("finding launch_bound (high)") == 1
    assert "reverted" in path_text and "kept" in path_text
    assert "1.65× the baseline" in page.inner_text("#summary")
    assert errors == []
    # the link to the best-vs-baseline diff, clicked (with Ctrl: in a new tab, so the sweep page stays for the
    # other tests that read it); the tab's errors from its first moment on, through its context
    ctx, diff_errors = page.context, []

    def on_error(e):
        diff_errors.append(str(e.error))

    ctx.on("weberror", on_error)
    with ctx.expect_page() as opened:
        page.click("#diff-link", modifiers=["ControlOrMeta"])
    diff = opened.value
    diff.wait_for_load_state("load")
    assert diff.url.endswith("diff_best_vs_baseline/diff.html")
    wait_drawn(diff)
    assert plot_ok(diff, "plot-bars") > 3
    assert "best (trial 3)" in diff.inner_text("header")
    diff.close()
    ctx.remove_listener("weberror", on_error)
    assert diff_errors == [] and errors == []


def test_rule_driven_sweep_says_there_is_no_model_section(sweep, shown):
    """The replayed traces hold no profiled step: no model, no decomposition; each section says so in one line."""
    _, _, paths = sweep
    page, errors = shown(paths["sweep.html"])
    assert "No model-driven trial in this sweep" in page.inner_text("#predicted-none")
    text = page.inner_text("#decomp-compare")
    assert "No decomposition to compare" in text and "no profiled step with device work" in text
    assert page.locator("#plot-predicted .main-svg").count() == 0
    assert errors == []


def test_sweep_page(sweep, shown, shots):
    """At 1400 px (test_layout_browser.py's checks): the chart first and best.yaml collapsed below it, the knobs'
    tick labels apart, each trial's noise (s.e. column, whiskers); no legend over a figure's toolbar."""
    page, errors = shown(sweep[2]["sweep.html"])
    every_plot_drawn(page)
    save_shots(page, shots, "sweep")
    legends_clear(page)
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


MODEL_SPACE = {
    "config": "tiny",
    "knobs": {"sync_free_level": [0, 3], "grouped_gemm_backend": ["loop", "torch"], "micro_batch_size": [2, 8, 4096]},
    "constraints": ["not (grouped_gemm_backend == 'loop' and sync_free_level >= 2)"],
    "fixed": {"steps": 8, "profile_step_start": 4, "profile_step_end": 5, "log_every": 4, "timing_warmup_steps": 2},
    "trial": {"timeout_s": 300, "env": {"OMP_NUM_THREADS": 1}},
    # micro-batch 4096 projects ~4.6 GiB on the tiny config: predicted out of memory, never run; the trials
    # that run stay near 0.4 GiB of RSS
    "limits": {"memory_gib": 2.0},
}


@pytest.fixture(scope="module")
def model_sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("model_sweep")
    space = parse_space(MODEL_SPACE, "space.yaml")
    res = run_sweep(space, out, log=lambda m: None)
    con = sqlite3.connect(str(out / "sweep.sqlite"))
    preds = json.loads(con.execute("SELECT v FROM autotune_meta WHERE k = 'predictions'").fetchone()[0])
    con.close()
    return res, space, sweep_report.write(res, space), preds


def _manifest(run_dir) -> dict:
    return json.loads((Path(run_dir) / "manifest.json").read_text())


def test_model_driven_sweep_predicted_vs_measured(model_sweep, shown, shots):
    res, _, paths, preds = model_sweep
    ran = [p for p in preds if p["trial"] is not None and p["measured"] is not None]
    oom = [p for p in preds if p["trial"] is None]
    assert ran, preds  # the baseline predicts a larger micro-batch / grouped backend: at least one trial ran
    assert oom and all(p["knobs"]["micro_batch_size"] == 4096 for p in oom)
    assert all(t["knobs"]["micro_batch_size"] != 4096 for t in res.trials)  # never run
    page, errors = shown(paths["sweep.html"])
    assert plot_ok(page, "plot-predicted") > 3
    traces = page.evaluate("document.getElementById('plot-predicted').data")
    line, points = traces[0], traces[1:]
    assert line["x"] == line["y"]  # the y = x line
    xs = [x for t in points for x in t["x"]]
    ys = [y for t in points for y in t["y"]]
    labels = [lbl for t in points for lbl in t["text"]]
    trials = {t["id"]: t for t in res.trials}
    for p in ran:
        i = labels.index(f"#{p['trial']}")
        assert xs[i] == pytest.approx(p["predicted"])
        # the measured objective is the trial's own: its manifest's tokens/s/GPU
        assert ys[i] == pytest.approx(_manifest(trials[p["trial"]]["run_dir"])["metrics"]["tokens_per_s_per_gpu"])
        err = [e for t in points for e in t["error_x"]["array"]][i]
        assert err == pytest.approx(p["predicted"] * p["uncertainty"], rel=1e-4)
    assert len(xs) == len(ran)
    assert page.locator("#plot-predicted .scatterlayer .point").count() == len(ran)
    oom_text = page.inner_text("#predicted-oom")
    assert oom_text.count("micro_batch_size=4096") == len(oom)
    if shots:  # $TRACELENS_SCREENSHOTS (tests/reports/conftest.py)
        page.locator("#predicted").screenshot(path=str(shots / "predicted.png"))
    assert errors == []


def test_model_driven_sweep_decomposition_baseline_vs_kept(model_sweep, shown, shots):
    res, _, paths, _ = model_sweep
    kept = [p["trial"] for p in res.path if p["decision"] == "kept"]
    page, errors = shown(paths["sweep.html"])
    assert plot_ok(page, "plot-decomp-compare") > 3
    traces = page.evaluate("document.getElementById('plot-decomp-compare').data")
    names = [t["name"] for t in traces]
    assert names[0].startswith(f"baseline #{res.baseline['id']}")
    assert len(traces) == 1 + len(kept)  # the baseline and every kept move (the last is the best)
    if kept:
        assert names[-1].startswith(f"best #{res.best['id']}")
    # each side's parts add up to its measured step: per token when the micro-batch changed
    order = [res.baseline["id"]] + kept
    toks = [_manifest(res.trials[i - 1]["run_dir"])["metrics"]["tokens_per_step_per_gpu"] for i in order]
    per_token = len(set(toks)) > 1
    assert page.evaluate("document.getElementById('plot-decomp-compare').layout.xaxis.title.text") == (
        "µs per token" if per_token else "ms per step")
    for tid, tr in zip(order, traces):
        m = _manifest(res.trials[tid - 1]["run_dir"])["metrics"]
        want = 1e3 * m["mean_step_time_s"] * (1e3 / m["tokens_per_step_per_gpu"] if per_token else 1.0)
        assert sum(tr["x"]) == pytest.approx(want, rel=1e-3), tid
    table = page.inner_text("#decomp-compare table")
    assert "optimizer step" in table and "tokens per step per GPU" in table if per_token else True
    if shots:
        page.locator("#decomp-compare").screenshot(path=str(shots / "decomp.png"))
        page.screenshot(path=str(shots / "sweep_full.png"), full_page=True)
    assert errors == []


@pytest.fixture(scope="module")
def noise_stop_sweep(tmp_path_factory):
    """A model-driven sweep in which no prediction beats the noise (issue 36: the README's tiny CPU space):
    a stand-in model and runner (tests/autotune/test_model_search_unit.py), trials with 1 timed step each
    (standard error unknown) and one neighbour check allowed."""
    from autotune.model_search import ModelSearch
    from autotune.space import key_of
    from tests.autotune._fake import FakeRunner
    from tests.autotune.test_model_search_unit import FLAT, KNOBS, _FlatModel, _pt

    out = tmp_path_factory.mktemp("noise_stop")
    space = parse_space({"config": "tiny", "knobs": KNOBS, "baseline": _pt("loop", 2), "guided": {"explore": 1}},
                        "space.yaml", check_trainer=False)
    fake = FakeRunner({key_of(_pt(b, m)): (v, [], {}, 0.0) for (b, m), v in FLAT.items()})

    def runner(space, point, run_dir, on_start):
        r = fake(space, point, run_dir, on_start)
        r.metrics["timed_steps"] = [1]
        return r

    mp = pytest.MonkeyPatch()
    mp.setattr(ModelSearch, "model_of", lambda self, t: _FlatModel(t["knobs"], {}, set()))
    try:
        res = run_sweep(space, out, log=lambda m: None, runner=runner)
    finally:
        mp.undo()
    return res, space, sweep_report.write(res, space)


def test_a_sweep_stopped_on_the_noise_says_why_in_numbers(noise_stop_sweep, shown, shots):
    res, _, paths = noise_stop_sweep
    assert [p["source"] for p in res.path] == ["", "explore"]
    page, errors = shown(paths["sweep.html"])
    why = page.inner_text("#stop-note")
    # the numbers: the best remaining prediction's gain vs the threshold, and where the threshold comes from
    assert ("the best remaining prediction, grouped_gemm_backend=torch, micro_batch_size=8, gains +1.5 % over "
            "trial 1 (the search's incumbent); the noise threshold is 2.0 %") in why
    assert "guided.min_gain (2.0 %), the smallest gain that counts" in why
    assert "trial 1's standard error is unknown: 1 timed step, fewer than the 3 a standard error needs" in why
    assert "after 1 neighbour check" in why
    # the trials table: beside each s.e. (unknown here) the count of timed steps that explains it
    heads = [h.strip() for h in page.locator("#trials table th").all_inner_texts()]
    assert heads[heads.index("s.e. %") + 1] == "timed steps"
    cells = page.locator("#trials table tbody tr").first.locator("td").all_inner_texts()
    assert cells[heads.index("timed steps")] == "1"
    assert plot_ok(page, "plot-predicted") > 3  # the neighbour check: predicted vs measured, one point
    if shots:
        page.locator("#summary").screenshot(path=str(shots / "sweep_noise_stop_summary.png"))
        page.screenshot(path=str(shots / "sweep_noise_stop.png"), full_page=True)
    assert errors == []
