"""The efficiency knobs of issue 19: ``step_timing`` (sync | events), ``compile`` (none | dense) and
``cuda_graphs`` (off | on), on a CPU: validation, the CPU fallbacks, step-time consistency in the
manifest, and compiled-vs-eager losses. The CUDA paths of StepTimer and the loss watch run here on a
fake CUDA event clock (their host logic: when events are read, that nothing syncs per step)."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moespec.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ validation
@pytest.mark.parametrize("over, key, words", [
    ({"step_timing": "async"}, "step_timing", "not one of sync, events"),
    ({"compile": "full"}, "compile", "not one of none, dense"),
    ({"compile": True}, "compile", "not one of none, dense"),
    ({"cuda_graphs": "maybe"}, "cuda_graphs", "not one of off, on"),
    ({"cuda_graphs": "on"}, "cuda_graphs", "needs CUDA (device=cpu)"),
    ({"cuda_graphs": "on", "device": "auto"}, "cuda_graphs", "needs sync_free_level 3"),
    ({"cuda_graphs": "on", "device": "auto", "sync_free_level": 3}, "cuda_graphs", "set compile=dense"),
    ({"cuda_graphs": "on", "device": "auto", "sync_free_level": 3, "compile": "dense", "pp": 2, "n_layers": 4,
      "microbatches": 2}, "cuda_graphs", "pipeline parallelism"),
    ({"expert_swiglu": "fused"}, "expert_swiglu", "not one of torch, triton"),
])
def test_bad_knob_values_are_one_line_errors(over, key, words):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", over)
    assert e.value.key == key and words in str(e.value) and "\n" not in str(e.value)


def test_knob_values_and_yaml_on_off():
    assert {k: load_config("tiny")[k] for k in ("step_timing", "compile", "cuda_graphs")} == \
        {"step_timing": "sync", "compile": "none", "cuda_graphs": "off"}
    # YAML 1.1 reads a bare on/off as a boolean: --set cuda_graphs=off is the word "off"
    from moespec.config import parse_override

    assert load_config("tiny", dict([parse_override("cuda_graphs=off")]))["cuda_graphs"] == "off"
    cfg = load_config("tiny", {"step_timing": "events", "compile": "dense", "device": "auto", "sync_free_level": 3,
                               "cuda_graphs": True})
    assert cfg["cuda_graphs"] == "on" and load_config(None, cfg) == cfg  # round-trips as the manifest's config


def test_knobs_have_cli_flags():
    from trainer.cli import build_parser, config_from_args

    args = build_parser().parse_args(["--config", "tiny", "--step-timing", "events", "--compile", "dense",
                                      "--optimizer", "adamw_fused", "--cuda-graphs", "off",
                                      "--expert-swiglu", "triton"])
    cfg = config_from_args(args)
    assert (cfg["step_timing"], cfg["compile"], cfg["optimizer"], cfg["cuda_graphs"], cfg["expert_swiglu"]) == \
        ("events", "dense", "adamw_fused", "off", "triton")
    assert load_config("tiny")["expert_swiglu"] == "torch"


@pytest.mark.parametrize("sets, msg", [
    (["cuda_graphs=on"], "config error: cuda_graphs: on needs CUDA (device=cpu): CUDA graphs do not exist on a CPU"),
    # device=auto resolves to the CPU at run time: refused there, before the run dir exists
    (["cuda_graphs=on", "device=auto", "sync_free_level=3", "compile=dense"],
     "config error: cuda_graphs: on needs CUDA, and this run is on cpu (CUDA graphs do not exist on a CPU)"),
    (["cuda_graphs=on", "device=auto", "sync_free_level=2", "compile=dense"],
     "config error: cuda_graphs: on needs sync_free_level 3 (static shapes, no host sync in the step), "
     "got sync_free_level=2"),
    # compile where inductor has no C++ compiler: one line
    (["compile=dense", "env={CXX: /nonexistent/g++}"],
     "config error: compile: dense needs a C++ compiler for inductor's CPU code ('/nonexistent/g++', from $CXX or "
     "torch's default), and none is on PATH (install g++ or set CXX), or use compile=none"),
])
def test_cli_refuses_knobs_the_machine_cannot_run(tmp_path, capsys, sets, msg):
    """The trainer's command line (``trainer.cli.main``, what ``python -m trainer`` runs) in this process: the
    refusals decided from the config and those decided at the start of train(), once the device is resolved
    (``python -m trainer`` itself, its exit status and stderr, is run by the next test)."""
    if "device=auto" in sets and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from trainer.cli import main

    import torch._inductor.config as inductor_config  # noqa: PLC0415

    # Inductor reads $CXX once, when its config is first imported: imported here, before the run sets CXX, so the
    # compiler it keeps for the rest of this process is the machine's (a later compile=dense test in this worker)
    cxx = inductor_config.cpp.cxx
    argv = ["--config", "tiny", "-o", str(tmp_path / "run")]
    for s in sets:
        argv += ["--set", s]
    env = dict(os.environ)
    try:
        rc = main(argv)
    finally:  # train() sets the config's env knobs (CXX here) in this process: taken back
        for k in set(os.environ) - set(env):
            del os.environ[k]
        os.environ.update(env)
    assert inductor_config.cpp.cxx == cxx and os.environ.get("CXX") == env.get("CXX")
    err = capsys.readouterr().err
    assert rc == 2, err[-2000:]
    assert err.strip().splitlines() == [msg]
    assert not (tmp_path / "run").exists()
    # the refused run took its note handler with it: a later run in this process says each note once
    assert not logging.getLogger("trainer").handlers


def test_cli_refuses_expert_swiglu_triton_without_triton_on_the_device(tmp_path):
    """expert_swiglu=triton on a CPU without Triton's interpreter: one line, exit 2, no traceback, no run dir,
    from ``python -m trainer`` itself (a fresh process: this one may hold the interpreter; the fused kernel itself
    is tested under the interpreter in tests/kernels/test_swiglu.py)."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "trainer", "--config", "tiny", "-o", str(tmp_path / "run"),
                        "--expert-swiglu", "triton"], cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr
    assert lines[0].startswith("config error: expert_swiglu: triton needs ") and "TRITON_INTERPRET=1" in lines[0]
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ step timing
class _FakeEvent:
    """torch.cuda.Event on a fake device clock: record() stamps ``clock``, which the test advances by each step's
    device time (no host clock read: the times it checks are the same on a loaded machine)."""

    synchronized = 0
    clock = 0.0

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.t = None

    def record(self, stream=None):
        self.t = _FakeEvent.clock

    def synchronize(self):
        assert self.t is not None
        _FakeEvent.synchronized += 1

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3  # ms, as CUDA's


def test_event_timer_reads_events_only_when_asked(monkeypatch):
    from trainer import timing

    syncs = []
    monkeypatch.setattr(timing.torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    _FakeEvent.synchronized = 0
    t = timing.StepTimer("events", torch.device("cuda", 0))
    assert t.events and t.deferred and t.method == "cuda_events"
    sleeps = [0.02, 0.005, 0.01, 0.015]
    for i, s in enumerate(sleeps):
        t.start()
        time.sleep(s)  # the host waits as long as the step's device time, which the fake events measure exactly
        _FakeEvent.clock += s
        t.stop()
        if i == 1:  # a log point: the values so far, one wait on the last event
            assert t.last() == t.times[1] and len(t.times) == 2 and _FakeEvent.synchronized == 1
    assert syncs == [] and _FakeEvent.synchronized == 1  # no device sync per step
    times = t.finish()
    assert len(times) == 4 and syncs == [torch.device("cuda", 0)]  # one at the end
    assert times == pytest.approx(sleeps, rel=1e-9)  # each step's time is what its events measured
    assert sum(times) <= t.wall_s  # within the host's wall clock, which slept at least as long


def test_sync_timer_syncs_every_step(monkeypatch):
    from trainer import timing

    syncs = []
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    t = timing.StepTimer("sync", torch.device("cuda", 0))
    assert not t.deferred and t.method == "host_sync"
    for _ in range(3):
        t.start()
        t.stop()
    assert len(syncs) == 3 and len(t.finish()) == 3
    cpu = timing.StepTimer("events", torch.device("cpu"))
    assert not cpu.events and not cpu.deferred and cpu.method == "wall_clock"


def test_deferred_loss_watch_names_the_first_bad_step():
    from trainer.train import TrainingError, _LossWatch

    w = _LossWatch(torch.device("cpu"), deferred=True)
    for step, v in enumerate([1.0, 2.0, math.inf, math.nan]):
        w.post(torch.tensor(v), step)
        w.check(step)  # deferred: nothing read here
    with pytest.raises(TrainingError, match=r"^step 2: the loss is inf"):
        w.flush()
    assert w.pending == []
    w.post(torch.tensor(3.0), 4)
    w.flush()  # fine


@pytest.mark.parametrize("mode", ["sync", "events"])
def test_manifest_step_times_are_consistent(tmp_path, capsys, mode):
    """The manifest's step times (what tracelens and autotune read) in both modes: every step timed, the
    mean over the timed steps, the sum within the loop's wall time, which is within the command's. Both modes
    run the command line in this process (``trainer.cli.main``: a process start and a torch import fewer; ``python -m
    trainer`` as a process of its own runs in the expert_swiglu refusal below, tests/trainer/test_balance.py and
    test_ep_placement.py); ``events`` says its note once on stderr, ``sync`` has none."""
    from trainer.cli import main

    run = tmp_path / mode
    argv = ["--config", "tiny", "-o", str(run), "--set", "steps=5", "--set", "log_every=2",
            "--set", "profile_step_start=2", "--set", "profile_step_end=3", "--set", f"step_timing={mode}"]
    t0 = time.perf_counter()
    rc = main(argv)
    stderr = capsys.readouterr().err
    wall = time.perf_counter() - t0
    assert rc == 0, stderr[-3000:]
    m = json.loads((run / "manifest.json").read_text())
    mt = m["metrics"]
    assert m["toggles"]["step_timing"] == mode
    assert mt["step_timing"] == "wall_clock"  # CPU: no CUDA events, no sync to make
    times = mt["step_times_s"]
    assert len(times) == 5 and all(t > 0 for t in times)
    assert mt["timed_steps"] == [1, 4]  # warm-up 0, profiled 2, exporting 3 excluded
    assert mt["mean_step_time_s"] == pytest.approx((times[1] + times[4]) / 2, rel=1e-12)
    assert mt["tokens_per_s_per_gpu"] == pytest.approx(4 * 64 / mt["mean_step_time_s"], rel=1e-9)
    assert sum(times) <= mt["steps_wall_s"] < wall
    notes = [n for n in m["notes"] if n.startswith("step_timing=events")]
    assert notes == (["step_timing=events: no CUDA events on cpu, steps are timed by the wall clock (no sync "
                      "either)"] if mode == "events" else [])
    assert stderr.count("no CUDA events on cpu") == (mode == "events")  # said once


# ------------------------------------------------------------------ compile
@pytest.mark.slow
def test_compiled_dense_matches_eager_on_cpu(tmp_path):
    """compile=dense on the tiny model (1 dense + 1 MoE layer): same losses as eager over 3 steps (fp32,
    inductor's CPU code: float reassociation only), and the trace keeps the layer/ and moe/ ranges."""
    import gzip

    from trainer.cli import main

    runs = {}
    for mode in ("none", "dense"):
        run = tmp_path / mode
        argv = ["--config", "tiny", "-o", str(run), "--set", "steps=3", "--set", "n_layers=2",
                "--set", "profile_step_start=2", "--set", "profile_step_end=3", "--set", f"compile={mode}"]
        if mode == "none":  # eager: the same command line in this process (a process start and a torch import fewer)
            assert main(argv) == 0
        else:  # compiled in a process of its own (dynamo's and inductor's state stay out of the test process);
            # inductor compiles in that process (COMPILE_THREADS=1), not in a pool of workers that each import torch
            r = subprocess.run([sys.executable, "-m", "trainer", *argv], cwd=REPO, capture_output=True, text=True,
                               timeout=600, env={**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1"}, check=False)
            assert r.returncode == 0, r.stderr[-3000:]
        runs[mode] = json.loads((run / "manifest.json").read_text())
    eager, comp = (runs[k]["metrics"]["loss"] for k in ("none", "dense"))
    assert len(eager) == len(comp) == 3
    assert eager[0] != eager[-1]  # it trains
    for a, b in zip(eager, comp):
        assert abs(a - b) <= 1e-4 * abs(a), (eager, comp)
    assert runs["dense"]["toggles"]["compile"] == "dense"
    assert [n for n in runs["dense"]["notes"] if n.startswith("compile=dense")] == [
        "compile=dense: torch.compile of 3 regions (layer/0.dense_block, layer/1.attn_half, layer/1.ffn.shared); "
        "MoE routing/dispatch/experts eager"]
    # one graph per region, none broken; nothing compiled in the eager run
    assert runs["dense"]["compile"] == {"mode": "default", "unique_graphs": 3, "graph_breaks": 0,
                                        "graph_break_reasons": [], "cudagraph_skips": 0}
    assert runs["none"]["compile"] is None
    with gzip.open(tmp_path / "dense" / "traces" / "rank0.json.gz", "rt") as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert {"layer/0", "layer/1", "moe/router", "moe/permute", "moe/experts", "moe/unpermute"} <= names
    assert any(n and n.startswith("Torch-Compiled Region") for n in names)  # it did run compiled


def test_knobs_are_autotune_knobs():
    """The shipped space over the six knobs: the trainer's own loader accepts every value (autotune asks it),
    and the constraint leaves the 48 points where cuda_graphs has its compiled regions."""
    from autotune.space import load_space

    s = load_space(REPO / "autotune" / "spaces" / "gpu_proxy_knobs.yaml")
    grid = s.grid()
    assert len(grid) == 48 and s.baseline in grid
    assert {p["expert_swiglu"] for p in grid} == {"torch", "triton"}
    assert {p["use_triton_kernels"] for p in grid} == {False, True}
    assert all(p["compile"] == "dense" for p in grid if p["cuda_graphs"] == "on")
    for p in grid:  # each point is a valid trainer config (on a GPU machine: device checked at run time)
        load_config("gpu_proxy", {**s.fixed, **p, "device": "auto"})
