"""`tracelens diff`: numbers against the raw JSON, self-diff, cross-device warnings, the CI gate."""

from __future__ import annotations

import gzip
import json
from decimal import Decimal

import pytest

import tracelens
from tracelens.analysis.diff import check_rules, diff, parse_rule
from tracelens.errors import TraceError

from ..conftest import (
    DIFF_CONTROL,
    DIFF_TEST,
    MOE_GROUPED,
    MOE_LOOP,
    NCCL_2RANK,
    raw_events,
)
from ._cli import run_cli, subprocess_cli

GPU = {"kernel", "gpu_memcpy", "gpu_memset"}


def raw_step_time_ms(path):
    """GPU span / optimizer steps, from the raw events (the fixtures mark no profiler steps)."""
    ev = raw_events(path)
    g = [e for e in ev if e.get("cat") in GPU]
    span = max(Decimal(e["ts"]) + Decimal(e["dur"]) for e in g) - min(Decimal(e["ts"]) for e in g)
    steps = sum(1 for e in ev if e.get("cat") == "user_annotation" and e["name"].startswith("Optimizer.step#"))
    return float(span / steps / 1000), steps


def raw_syncs_per_step(path, steps):
    ev = [e for e in raw_events(path) if e.get("ph") == "X"]
    ops = [(Decimal(e["ts"]), Decimal(e["ts"]) + Decimal(e["dur"])) for e in ev if e.get("cat") in ("cpu_op", "user_annotation")]
    syncs = [e for e in ev if e.get("cat") == "cuda_runtime" and e["name"] == "cudaStreamSynchronize"]
    inside = [s for s in syncs if any(a <= Decimal(s["ts"]) < b for a, b in ops)]
    return len(inside) / steps


def _analysis(path, cache={}):  # noqa: B006 - one analysis per fixture for the module (diff only reads them)
    if path not in cache:
        cache[path] = tracelens.analyze(tracelens.load(path, cache=False))
    return cache[path]


@pytest.fixture(scope="module")
def moe():
    b = tracelens.analyze(tracelens.load(MOE_LOOP, cache=False))
    n = tracelens.analyze(tracelens.load(MOE_GROUPED, cache=False))
    return b, n, diff(b, n, base_label="loop", new_label="grouped")


def test_loop_to_grouped_numbers_match_raw(moe):
    _, _, r = moe
    st = r.metric("step_time")
    base_ms, base_steps = raw_step_time_ms(MOE_LOOP)
    new_ms, new_steps = raw_step_time_ms(MOE_GROUPED)
    assert (base_steps, new_steps) == (2, 2)
    assert st["base"] == pytest.approx(base_ms, abs=1e-6) and st["new"] == pytest.approx(new_ms, abs=1e-6)
    assert st["delta"] < 0 and st["rel_pct"] < -40  # the step got much faster
    hs = r.metric("host_syncs")
    assert hs["base"] == raw_syncs_per_step(MOE_LOOP, 2) and hs["new"] == raw_syncs_per_step(MOE_GROUPED, 2)
    assert hs["delta"] < 0


def test_per_expert_gemms_replaced_by_grouped(moe):
    _, _, r = moe
    k = r.kernels
    removed = k[(k["status"] == "removed") & (k["category"] == "GEMM")]
    added = k[(k["status"] == "added") & (k["category"] == "grouped GEMM")]
    assert len(removed) >= 3 and len(added) >= 3
    raw_nvjet = {e["name"] for e in raw_events(MOE_LOOP) if e.get("cat") == "kernel" and e["name"].startswith("nvjet")}
    raw_nvjet_new = {e["name"] for e in raw_events(MOE_GROUPED) if e.get("cat") == "kernel" and e["name"].startswith("nvjet")}
    assert set(removed["kernel"]) <= raw_nvjet - raw_nvjet_new
    ops = r.ops
    assert (ops[(ops["status"] == "added")]["op"] == "aten::_grouped_mm").any()
    assert (ops[(ops["status"] == "removed")]["op"] == "aten::mm").any()


def test_tolist_syncs_gone(moe):
    _, _, r = moe
    s = r.syncs.set_index("op")
    # the .tolist() copies to the host (aten::to -> copy_ + cudaStreamSynchronize) are gone; the syncs
    # inside aten::bincount (both traces call it) stay
    assert s.loc["aten::to", "base_per_step"] == 2 and s.loc["aten::to", "new_per_step"] == 0
    assert (s.loc["aten::bincount", "delta"] == 0).all()


def test_delta_attributed_to_expert_computation(moe):
    _, _, r = moe
    top = r.top_ops().set_index("top_op")["delta_wall_ms"]
    expert = [o for o in top.index if any(k in o for k in ("Mm", "matmul", "grouped_mm", "Select", "Slice"))]
    step_delta = r.metric("step_time")["delta"]
    assert r.ops["delta_wall_ms"].sum() == pytest.approx(step_delta, abs=1e-6)  # shares add up to the step
    assert top[expert].sum() / step_delta > 0.6


def test_markdown_op_names_render_as_written(moe):
    """diff.md is read rendered (a PR comment): an in-place or private op name such as aten::_foreach_mul_ would
    render as 'aten::' + italic 'foreach_mul' (its '_' pair is an emphasis), so a '_' that can delimit one (at a
    word's edge) and every '*' are escaped; an underscore inside a word (step_time) cannot and stays as is."""
    from reports.diff import to_markdown

    r = moe[2]
    names = list(r.top_ops()["top_op"])
    assert "aten::_foreach_mul_" in names
    md = to_markdown(r, top=len(names))
    assert "| aten::\\_foreach_mul\\_ |" in md, md
    assert "aten::_foreach_mul_" not in md
    assert "| step_time (ms) |" in md


def test_self_diff_no_change_any_rule_passes():
    a = _analysis(NCCL_2RANK)
    r = diff(a, a)
    assert (r.metrics["delta"].fillna(0) == 0).all()
    assert set(r.ops["status"]) <= {"same"} and set(r.kernels["status"]) <= {"changed"}
    rules = [parse_rule(x) for x in ("step_time>+5%", "delta(host_syncs)>0", "gpu.idle>+10%", "step_time>=+0",
                                     "delta(kernels)<=0", "gpu.busy<-1%")]
    assert not any(v["tripped"] for v in check_rules(r, rules))


def test_noise_from_several_steps(tmp_path):
    a = _analysis(NCCL_2RANK)
    st = diff(a, a).metric("step_time")
    # steady state: steps 1-2 (step 0 holds rank 1's profiler start-up wait and is left out): a spread, but
    # too few samples for a p-value (diff.MIN_SAMPLES)
    assert st["steps_base"] == 2 and st["spread"] > 0 and st["p_value"] != st["p_value"]
    # six steps a side (ProfilerStep#1009..1014): a p-value; 10 ns more on every kernel is within noise, no
    # rule trips
    c = _analysis(DIFF_CONTROL)
    st = diff(c, c).metric("step_time")
    assert st["steps_base"] == 6 and st["spread"] > 0 and st["p_value"] == 1.0
    doc = json.loads(gzip.decompress(DIFF_CONTROL.read_bytes()))
    for e in doc["traceEvents"]:
        if e.get("cat") == "kernel":
            e["dur"] = e["dur"] + 0.01
    (tmp_path / "new.json.gz").write_bytes(gzip.compress(json.dumps(doc).encode()))
    r2 = diff(c, tracelens.analyze(tracelens.load(tmp_path / "new.json.gz", cache=False)))
    busy = r2.metric("gpu.busy")
    assert busy["delta"] > 0 and busy["within_noise"] and busy["noise"] == "within noise"
    assert not check_rules(r2, [parse_rule("delta(gpu.busy)>0")])[0]["tripped"]


def test_cross_device_diff_warns():
    r = diff(_analysis(DIFF_CONTROL), _analysis(DIFF_TEST))
    assert any("different devices" in w for w in r.warnings)
    assert any("different world sizes" in w for w in r.warnings)
    assert r.info["base"]["steps"] == r.info["new"]["steps"] == 6  # ProfilerStep#1009..1014
    assert r.metric("step_time")["spread"] > 0
    assert not r.metrics.empty


def test_bad_rules():
    for bad in ("step_time", "step_time>>5", "nosuch>5", "step_time>5%%", ""):
        with pytest.raises(TraceError):
            parse_rule(bad)
    assert parse_rule("category.grouped_gemm > -2.5").value == -2.5


def test_cli_exit_codes_and_outputs(tmp_path):
    p = run_cli("diff", MOE_LOOP, MOE_GROUPED, "-o", tmp_path / "d", "--fail-on", "step_time>+5%", "--fail-on",
            "delta(host_syncs)>0")
    assert p.returncode == 0, p.stderr
    j = json.loads((tmp_path / "d" / "diff.json").read_text())
    assert j["failed"] is False and {m["metric"] for m in j["metrics"]} >= {"step_time", "host_syncs", "gpu.idle"}
    md = (tmp_path / "d" / "diff.md").read_text()
    assert "performance gate passed" in md and "| step_time (ms) |" in md
    assert "<script" in (tmp_path / "d" / "diff.html").read_text()
    # the gate's exit statuses from a real process (the entry point CI calls): 1 on a tripped rule, 2 on bad input
    p = subprocess_cli("diff", MOE_GROUPED, MOE_LOOP, "--fail-on", "step_time>+5%", "-q")
    assert p.returncode == 1 and "FAIL" in p.stdout
    p = run_cli("diff", MOE_LOOP, MOE_LOOP, "--fail-on", "step_time>+5%", "--fail-on", "delta(host_syncs)>0", "-q")
    assert p.returncode == 0
    p = run_cli("diff", MOE_LOOP, tmp_path / "missing.json", "--fail-on", "step_time>+5%")
    assert p.returncode == 2 and "no such file" in p.stderr
    p = subprocess_cli("diff", MOE_LOOP, MOE_GROUPED, "--fail-on", "step_time>>5")
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1


def test_run_dirs_compare_manifest_metrics(tmp_path):
    for name, tps, loss, mfu in (("base", 1000.0, [5.0, 4.0, 3.5], 0.0312), ("new", 900.0, [5.0, 4.1, 3.6, 3.0], 0.0539)):
        run = tmp_path / name
        (run / "traces").mkdir(parents=True)
        for f in ("rank0.json.gz", "rank1.json.gz"):
            (run / "traces" / f).write_bytes((NCCL_2RANK / f).read_bytes())
        (run / "manifest.json").write_text(json.dumps({"schema_version": 1, "metrics": {
            "tokens_per_s": tps, "mfu": mfu, "loss": loss, "peak_memory_bytes": [2**30, 3 * 2**30]}}))
    p = run_cli("diff", tmp_path / "base", tmp_path / "new", "-o", tmp_path / "d", "--fail-on", "run.tokens_per_s<-5%")
    assert p.returncode == 1, p.stderr  # throughput dropped 10 %
    j = json.loads((tmp_path / "d" / "diff.json").read_text())
    m = {x["metric"]: x for x in j["metrics"]}
    assert m["run.tokens_per_s"]["rel_pct"] == pytest.approx(-10.0)
    assert m["run.loss_at_step_2"]["base"] == 3.5 and m["run.loss_at_step_2"]["new"] == 3.6
    assert m["run.peak_memory_gb"]["new"] == pytest.approx(3.0)
    assert m["step_time"]["delta"] == 0  # same traces
    # each run metric with its unit: 3 * 2**30 bytes is 3.0 GiB; a loss has none
    assert {k: m[k]["unit"] for k in ("run.tokens_per_s", "run.mfu", "run.peak_memory_gb", "run.loss_final")} == \
        {"run.tokens_per_s": "tokens/s", "run.mfu": "fraction", "run.peak_memory_gb": "GiB", "run.loss_final": ""}
    # diff.md (and the terminal) keep a small value's size: an MFU of 0.0312 -> 0.0539 is not '0.03 -> 0.05',
    # its change not '+0.02'; a unitless metric has no empty '()' after its name
    md = (tmp_path / "d" / "diff.md").read_text()
    assert "| run.mfu (fraction) | 0.0312 | 0.0539 | +0.0227 (+72.8%)  noise unknown |" in md, md
    assert "| run.loss_final | 3.50 | 3.60 | +0.100 (+2.9%)  noise unknown |" in md, md
    # a rule in a code span as written: GitHub shows '&lt;' inside backticks literally, so it is not escaped there
    assert "| `run.tokens_per_s<-5%` | **FAIL** |" in md, md
    assert "()" not in md and "()" not in p.stdout
    assert "run.mfu (fraction)" in p.stdout and "0.0539" in p.stdout


def _cpu_only_trace(path, step_durs_us):
    """A CPU-only Kineto trace: one ProfilerStep#N range per step with an op inside, no GPU events."""
    ev, ts = [], 1000.0
    for i, d in enumerate(step_durs_us):
        ev.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{i + 3}", "pid": 1, "tid": 1,
                   "ts": ts, "dur": d})
        ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": ts + 1.0,
                   "dur": d / 2, "args": {"Input Dims": [[4, 4], [4, 4]]}})
        ts += d + 10.0
    path.write_text(json.dumps({"traceEvents": ev}))
    return path


def test_cpu_only_diff_uses_host_step_time(tmp_path):
    """CPU-only runs (the trainer on a CPU, autotune on CI): step time comes from the host profiler-step
    ranges, GPU metrics are unavailable (not zero), and diff.html renders without a waterfall."""
    base = _cpu_only_trace(tmp_path / "base.json", [2000.0, 2200.0])
    new = _cpu_only_trace(tmp_path / "new.json", [1000.0, 1100.0])
    r = diff(tracelens.analyze(tracelens.load(base, cache=False)), tracelens.analyze(tracelens.load(new, cache=False)))
    m = r.metrics.set_index("metric")
    # medians of the per-step host ranges: (2000, 2200) -> 2.1 ms, (1000, 1100) -> 1.05 ms
    assert m.loc["step_time", "base"] == pytest.approx(2.1)
    assert m.loc["step_time", "new"] == pytest.approx(1.05)
    assert m.loc["step_time", "steps_base"] == 2
    assert all(m.loc[k, "base"] != m.loc[k, "base"] for k in ("gpu.busy", "gpu.idle"))  # NaN: unavailable
    out = tmp_path / "out"
    res = run_cli("diff", base, new, "-o", out, "--fail-on", "step_time>+5%")
    assert res.returncode == 0, res.stderr
    assert (out / "diff.html").stat().st_size > 0 and "Traceback" not in res.stderr


def test_a_gate_that_cannot_look_never_passes(tmp_path):
    """CPU-only traces have no GPU metrics: a rule on one cannot be evaluated, and the gate says so (exit 2, one
    line naming the rule and the side) instead of passing; a rule that trips still exits 1; a change in % from a
    base of 0 (the host syncs of a CPU trace: none) is undefined and says to write delta()."""
    base = _cpu_only_trace(tmp_path / "base.json", [2000.0, 2200.0, 2100.0])
    new = _cpu_only_trace(tmp_path / "new.json", [1000.0, 1100.0, 1050.0])
    for rules, code, line in (
            (["gpu.busy>+5%"], 2, "--fail-on 'gpu.busy>+5%': gpu.busy is unavailable on the new side"),
            (["delta(gpu.idle)>1"], 2, "--fail-on 'delta(gpu.idle)>1': gpu.idle is unavailable on the new side"),
            (["step_time<-20%", "gpu.busy>+5%"], 1, "gpu.busy is unavailable"),  # the trip wins: 2.1 -> 1.05 ms
            (["step_time>+5%", "delta(host_syncs)>0"], 0, None)):
        res = run_cli("diff", base, new, "-q", *[x for r in rules for x in ("--fail-on", r)])
        assert res.returncode == code, (rules, res.stdout, res.stderr)
        errors = [x for x in res.stderr.splitlines() if x.startswith("tracelens: error:")]
        if line is None:
            assert errors == []
        else:
            assert len(errors) == 1 and line in errors[0] and "Traceback" not in res.stderr
    # the new run blocks once a step in a sync the base never made: +10 % of 0 is no number
    syncing = json.loads(new.read_text())
    syncing["traceEvents"] += [{"ph": "X", "cat": "cuda_runtime", "name": "cudaDeviceSynchronize", "pid": 1, "tid": 1,
                                "ts": e["ts"] + 2.0, "dur": 5.0} for e in syncing["traceEvents"] if e["cat"] == "cpu_op"]
    new.write_text(json.dumps(syncing))
    res = run_cli("diff", base, new, "-q", "--fail-on", "host_syncs>+10%")
    assert res.returncode == 2 and res.stderr.strip() == (
        "tracelens: error: --fail-on 'host_syncs>+10%': host_syncs is 0 on the base side, so a change in % is "
        "undefined: write delta(host_syncs) or new.host_syncs with a value (the rule cannot be evaluated on these "
        "inputs)"), (res.stdout, res.stderr)
    assert run_cli("diff", base, new, "-q", "--fail-on", "delta(host_syncs)>0").returncode == 1


def test_rule_forms_absolute_and_change(moe):
    """`host_syncs>0` reads as "the new run has a host sync", and is that: a bare unsigned number is a value of
    the new run; a signed number, a percentage or delta(METRIC) is a change new - base; new.METRIC says absolute
    explicitly (issue 36: the README's gate said "ok" while the new run synced twice per step)."""
    _, _, r = moe
    new_syncs = raw_syncs_per_step(MOE_GROUPED, 2)
    base_syncs = raw_syncs_per_step(MOE_LOOP, 2)
    assert new_syncs > 0 and base_syncs > new_syncs  # the grouped run syncs less, but still syncs
    bare, explicit, delta, signed = check_rules(r, [parse_rule(x) for x in (
        "host_syncs>0", "new.host_syncs>0", "delta(host_syncs)>0", "host_syncs>+0")])
    for v in (bare, explicit):
        assert v["form"] == "absolute" and v["tripped"]
        assert v["compared"] == new_syncs and v["new"] == new_syncs and v["threshold"] == 0
    for v in (delta, signed):
        assert v["form"] == "change" and not v["tripped"]
        assert v["compared"] == new_syncs - base_syncs and (v["base"], v["new"]) == (base_syncs, new_syncs)
    rel = check_rules(r, [parse_rule("step_time>+5%")])[0]
    assert rel["form"] == "change" and rel["unit"] == "%" and rel["compared"] == pytest.approx(r.metric("step_time")["rel_pct"])
    assert parse_rule("delta(step_time) > 5%").relative and parse_rule("step_time>5%").form == "change"
    assert parse_rule("kernels<=-3").form == "change" and parse_rule("new.kernels<=3").form == "absolute"
    for bad in ("new.step_time>5%", "delta(step_time>5", "delta()>1", "new.nosuch>1", "delta(nosuch)>1"):
        with pytest.raises(TraceError):
            parse_rule(bad)


def test_rule_output_names_the_form_and_numbers(tmp_path):
    p = run_cli("diff", MOE_LOOP, MOE_GROUPED, "--fail-on", "host_syncs>0", "--fail-on", "delta(host_syncs)>0",
            "-o", tmp_path / "d")
    assert p.returncode == 1, p.stdout + p.stderr  # the new run has host syncs
    lines = {ln.split(":", 1)[0]: ln for ln in p.stdout.splitlines() if ln.startswith("rule ")}
    new, base = raw_syncs_per_step(MOE_GROUPED, 2), raw_syncs_per_step(MOE_LOOP, 2)
    assert lines["rule 'host_syncs>0'"] == (f"rule 'host_syncs>0': FAIL (absolute, the new run: host_syncs "
                                            f"{new:.2f} count per step > 0)")
    assert lines["rule 'delta(host_syncs)>0'"].startswith(
        f"rule 'delta(host_syncs)>0': ok (change new - base: host_syncs {base:.2f} -> {new:.2f} count per step = "
        f"{new - base:+.2f} count, not > 0")
    q = run_cli("diff", MOE_LOOP, MOE_GROUPED, "--fail-on", "host_syncs>0", "-q")
    assert q.returncode == 1 and q.stdout.strip() == lines["rule 'host_syncs>0'"]  # -q: the same verdict line
    j = json.loads((tmp_path / "d" / "diff.json").read_text())
    assert [x["form"] for x in j["rules"]] == ["absolute", "change"]
    md = (tmp_path / "d" / "diff.md").read_text()
    assert "absolute, the new run: host_syncs" in md and "change new - base: host_syncs" in md
    assert "absolute, the new run: host_syncs" in (tmp_path / "d" / "diff.html").read_text()


def test_too_few_samples_give_no_p_value(tmp_path):
    """Two steady steps a side (the NCCL fixture): Welch's test on 2 + 2 samples has at most 2 degrees of
    freedom and printed p = 0.000 for a 20 % slowdown (issue 36). Under 3 samples a side there is no
    p-value: the diff says so, and the rule decides on the change alone."""
    from reports.diff import fmt_p

    new = tmp_path / "slow"
    new.mkdir()
    for f in ("rank0.json.gz", "rank1.json.gz"):
        doc = json.loads(gzip.decompress((NCCL_2RANK / f).read_bytes()))
        for e in doc["traceEvents"]:
            if e.get("cat") == "kernel":
                e["dur"] = e["dur"] * 1.2
        (new / f).write_bytes(gzip.compress(json.dumps(doc).encode()))
    p = run_cli("diff", NCCL_2RANK, new, "--fail-on", "category.gemm>+10%", "-o", tmp_path / "d")
    assert p.returncode == 1, p.stdout + p.stderr  # +20 % > +10 %: decided on the change
    assert "p=0.000" not in p.stdout and "p = 0.000" not in p.stdout
    assert ("warning: too few samples: base has 2 per-step samples, new 2 (profiler steps / profiler steps); "
            "a significance test needs 3 a side") in p.stdout
    g = {m["metric"]: m for m in json.loads((tmp_path / "d" / "diff.json").read_text())["metrics"]}["category.gemm"]
    assert g["p_value"] is None and g["noise"] == "unknown" and g["samples_base"] == g["samples_new"] == 2
    assert g["spread"] is not None  # two samples still have a spread
    rule = next(ln for ln in p.stdout.splitlines() if ln.startswith("rule "))
    assert rule.endswith("; noise unknown: 2 samples a side, a p-value needs 3)")
    assert fmt_p(0.0) == fmt_p(0.0004) == "< 0.001" and fmt_p(0.0123) == "0.012" and fmt_p(float("nan")) == "–"


def test_p_value_never_printed_as_zero():
    """Six steps a side, a deterministic change (zero variance): p is 0 in the JSON, '< 0.001' on screen."""
    p = run_cli("diff", DIFF_CONTROL, DIFF_TEST)
    assert p.returncode == 0, p.stderr
    assert "p=0.000" not in p.stdout and "(p < 0.001)" in p.stdout
