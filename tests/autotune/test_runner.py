"""Trial runner: failure classification, hang detection and manifest metrics, with stand-in launchers
(`command` hook: tiny Python scripts instead of the trainer)."""

from __future__ import annotations

import json
import sys

import pytest

from autotune.runner import memory_signals, run_trial, step_noise, step_spread, trial_command
from autotune.space import parse_space

WRITE_MANIFEST = """
import json, os, sys
out = sys.argv[sys.argv.index("-o") + 1]
os.makedirs(out, exist_ok=True)
json.dump({"config": {"k": 1}, "metrics": {"tokens_per_s_per_gpu": 1234.5, "step_times_s": [1, 0.5, 0.4, 0.6, 0.5],
           "timed_steps": [1, 2, 3, 4], "peak_memory_bytes": [3 * 2**30, 5 * 2**30], "mfu": None}},
          open(os.path.join(out, "manifest.json"), "w"))
"""


def space_with(script: str, **extra):
    return parse_space({"config": "tiny", "knobs": {"sync_free_level": [0, 1]}, "fixed": {"steps": 2},
                        "command": [sys.executable, "-c", script], **extra}, check_trainer=False)


def test_command_passes_values_as_json(tmp_path):
    s = parse_space({"config": "tiny", "knobs": {"pipeline_schedule": ["1f1b"], "recompute_layer_ids": [[0, 1]]},
                     "fixed": {"loss_fusion": True, "dp": None}}, check_trainer=False)
    cmd = trial_command(s, {"pipeline_schedule": "1f1b", "recompute_layer_ids": [0, 1]}, tmp_path)
    assert cmd[1:3] == ["-m", "trainer.launch"]
    sets = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"]
    assert sets == ["loss_fusion=true", "dp=null", 'pipeline_schedule="1f1b"', "recompute_layer_ids=[0,1]"]


@pytest.mark.parametrize("script, failure, reason", [
    ("import sys; print('config error: ep: bad', file=sys.stderr); sys.exit(2)", "config", "config: exit 2: config error: ep: bad"),
    ("raise RuntimeError('CUDA out of memory. Tried to allocate 2 GiB')", "oom", "oom: exit 1: RuntimeError: CUDA out of memory."),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "killed", "killed: exit -9: killed by SIGKILL"),
    ("raise SystemExit(3)", "crash", "crash: exit 3: "),
    ("pass", "crash", "crash: exit 0 but no readable manifest.json"),
])
def test_failures_are_classified(tmp_path, script, failure, reason):
    r = run_trial(space_with(script), {"sync_free_level": 1}, tmp_path / "t")
    assert (r.status, r.failure, r.objective) == ("failed", failure, None)
    assert r.reason.startswith(reason)
    assert (tmp_path / "t" / "trial.log").read_text().startswith("$ ")


def test_hangs_are_killed(tmp_path):
    silent = "import time; time.sleep(60)"
    r = run_trial(space_with(silent, trial={"timeout_s": 2}), {"sync_free_level": 0}, tmp_path / "a")
    assert (r.status, r.failure) == ("failed", "timeout") and r.reason.startswith("timeout: no exit within 2 s")
    assert 2 <= r.metrics["wall_s"] < 10
    stalls = "import time; print('step 0', flush=True); time.sleep(60)"
    r = run_trial(space_with(stalls, trial={"timeout_s": 50, "stall_s": 2}), {"sync_free_level": 0}, tmp_path / "b")
    assert r.failure == "timeout" and r.reason.startswith("timeout: no output for 2 s") and r.metrics["wall_s"] < 10


def test_ok_trial_metrics_and_memory_limit(tmp_path):
    r = run_trial(space_with(WRITE_MANIFEST), {"sync_free_level": 0}, tmp_path / "t")
    assert (r.status, r.objective) == ("ok", 1234.5)
    # timed steps 0.5, 0.4, 0.6, 0.5: p90 0.57, p10 0.43, median 0.5 -> spread 0.28; mean 0.5,
    # sample std sqrt(0.02 / 3) -> standard error of the mean / mean = sqrt(0.02 / 3) / 2 / 0.5
    assert r.metrics["spread"] == pytest.approx((0.57 - 0.43) / 0.5)
    assert r.metrics["noise"] == pytest.approx((0.02 / 3) ** 0.5 / 2 / 0.5)
    assert r.metrics["signals"]["peak_memory_gib"] == 5.0 and "analysis_error" in r.metrics["signals"]  # no traces
    r = run_trial(space_with(WRITE_MANIFEST, limits={"memory_gib": 4}), {"sync_free_level": 0}, tmp_path / "m")
    assert (r.status, r.failure, r.objective) == ("failed", "memory", 1234.5)
    assert r.reason == "memory: peak 5.00 GiB is over the limit 4 GiB"
    assert r.metrics["signals"]["memory_used_share"] == 1.25
    r = run_trial(space_with(WRITE_MANIFEST, objective="mfu"), {"sync_free_level": 0}, tmp_path / "n")
    assert (r.failure, r.reason) == ("no-objective", "no-objective: manifest metric 'mfu' is None")


def test_noise_and_memory_signals():
    assert step_spread({"step_times_s": [9, 1, 1, 1], "timed_steps": [1, 2, 3]}) == 0.0  # warm-up step 0 left out
    assert step_noise({"step_times_s": [9, 1, 1, 1], "timed_steps": [1, 2, 3]}) == 0.0
    # all four: sorted 1, 1, 1, 9; p90 at position 2.7 = 1 + 0.7 * 8 = 6.6, p10 = 1, median 1
    assert step_spread({"step_times_s": [9, 1, 1, 1]}) == pytest.approx(5.6)
    # mean 3, sample variance (36 + 3 * 4) / 3 = 16 -> std 4, standard error 4 / 2 = 2, relative 2 / 3
    assert step_noise({"step_times_s": [9, 1, 1, 1]}) == pytest.approx(2 / 3)
    # the standard error shrinks with more steps of the same spread; the spread does not
    few, many = {"step_times_s": [1.0, 1.1] * 3}, {"step_times_s": [1.0, 1.1] * 48}
    assert step_spread(few) == pytest.approx(step_spread(many))
    assert step_noise(many) < step_noise(few) / 3.5
    for f in (step_spread, step_noise):
        assert f({"step_times_s": [1, 2], "timed_steps": [0, 1]}) == 0.0  # fewer than 3: unknown
    assert memory_signals({"peak_memory_bytes": [2**30]}, 4 * 2**30, None) == {
        "peak_memory_gib": 1.0, "memory_capacity_gib": 4.0, "memory_used_share": 0.25}
    assert memory_signals({"peak_memory_bytes": [2**30]}, 4 * 2**30, 2.0)["memory_used_share"] == 0.5  # limit wins
    assert memory_signals({}, None, None) == {}
