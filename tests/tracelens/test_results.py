"""The verbs' result types (`tracelens comm/host/roofline/check/memory/bubble/ppvis/whatif`): each one's
`to_dict()` is plain JSON, `to_text()` is what the CLI prints, and their figures agree with the raw trace
JSON (read here with the standard library) or with numbers worked out by hand."""

from __future__ import annotations

import json
import math
from decimal import Decimal
from pathlib import Path

import pytest
from click.testing import CliRunner

import tracelens
from tracelens.analysis import memory as M
from tracelens.analysis.bubble import bubble_report
from tracelens.analysis.comm import comm_report
from tracelens.analysis.health import health_report
from tracelens.analysis.host import host_report
from tracelens.analysis.pipeline import load_pipeline
from tracelens.cli import main
from tracelens.projection.whatif import Model

from ..conftest import FIXTURES, MOE_GROUPED, MOE_LOOP, NCCL_2RANK, raw_events

EP_L0 = FIXTURES / "h200_ep2_run" / "L0_loop"
PP_1F1B = FIXTURES / "h200_pp2_run" / "1f1b"


def cli_stdout(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(main, [str(a) for a in args])
    return r.exit_code, r.stdout


def strict_json(d: dict) -> dict:
    """`d` through JSON and back with no fallback for odd types and no NaN: it must be plain JSON."""
    return json.loads(json.dumps(d, allow_nan=False))


def xs(path: Path) -> list[dict]:
    return [e for e in raw_events(path) if e.get("ph") == "X"]


# ------------------------------------------------------------------------------------------------ comm


@pytest.fixture(scope="module")
def nccl():
    return tracelens.analyze(tracelens.load(NCCL_2RANK, cache=False))


def test_comm_report_counts_and_comm_time_match_raw(nccl):
    rep = comm_report(nccl)
    d = strict_json(rep.to_dict())
    assert d == rep.to_dict() and d["schema_version"] == 2 and d["partial"] is None
    for rank in (0, 1):
        kernels = [e for e in xs(NCCL_2RANK / f"rank{rank}.json.gz")
                   if e.get("cat") == "kernel" and e["name"].lower().startswith("nccl")]
        assert sum(r["rank"] == rank for r in d["records"]) == len(kernels)
        assert sum(r["count"] + r["startup_excluded"] for r in d["summary"] if r["rank"] == rank) == len(kernels)
    # all-reduce comm time on rank 0: end(0) - last arrival, summed over the instances not at start-up
    ar = [[(Decimal(e["ts"]), Decimal(e["ts"]) + Decimal(e["dur"])) for e in xs(NCCL_2RANK / f"rank{r}.json.gz")
           if e.get("cat") == "kernel" and "AllReduce" in e["name"]] for r in (0, 1)]
    i0 = rep.instances[(rep.instances["collective"] == "allreduce") & (rep.instances["rank"] == 0)]
    startup = i0.sort_values("instance")["startup"].tolist()
    assert len(startup) == len(ar[0])
    comm0 = sum(e0 - max(s0, s1) for (s0, e0), (s1, _), st in zip(*ar, startup) if not st)
    row = rep.summary[(rep.summary["rank"] == 0) & (rep.summary["collective"] == "allreduce")].iloc[0]
    assert row["comm_us"] == pytest.approx(float(comm0), abs=1e-3)
    text = rep.to_text()
    line = next(x for x in text.splitlines() if x.split()[:2] == ["0", "allreduce"])
    assert line.split()[4] == f"{row['comm_us'] / 1e3:.3f}"
    tail = text.splitlines()[-2:]  # the exposed-communication line, then the exposed all-to-all line
    assert tail[0].startswith("exposed communication (transfer not overlapped by compute; waits apart")
    assert tail[1].startswith("exposed all-to-all (transfer no compute hides")


def test_comm_report_is_the_cli_output(nccl, tmp_path):
    rep = comm_report(nccl)
    code, out = cli_stdout("comm", NCCL_2RANK, "--no-cache", "--json", tmp_path / "c.json")
    assert code == 0 and out == rep.to_text() + f"\nwrote {tmp_path / 'c.json'}\n"
    assert json.loads((tmp_path / "c.json").read_text()) == rep.to_dict()


def test_comm_report_without_its_exposed_figures_is_the_rest_of_it(nccl):
    """The report's communication section asks for the view less its exposed figures (not on the page)."""
    full, lean = comm_report(nccl).to_dict(), comm_report(nccl, exposed=False).to_dict()
    assert full["exposed_comm"] and lean["exposed_comm"] == [] and lean["exposed_a2a"] == []
    assert {k: v for k, v in lean.items() if not k.startswith("exposed")} == \
        {k: v for k, v in full.items() if not k.startswith("exposed")}


def test_comm_report_without_collectives():
    rep = comm_report(tracelens.analyze(tracelens.load(MOE_LOOP, cache=False)))
    assert rep.empty and rep.to_text() == "no communication kernels (NCCL/RCCL) in these traces"
    d = strict_json(rep.to_dict())
    assert d["records"] == d["summary"] == d["groups"] == d["exposed_comm"] == [] and d["partial"] is None


# ------------------------------------------------------------------------------------------------ host


@pytest.fixture(scope="module")
def loop():
    return tracelens.analyze(tracelens.load(MOE_LOOP, cache=False))


def test_host_report_matches_raw(loop):
    rep = host_report(loop)
    d = strict_json(rep.to_dict())
    raw = xs(MOE_LOOP)
    ops = [(Decimal(e["ts"]), Decimal(e["ts"]) + Decimal(e["dur"])) for e in raw if e.get("cat") == "cpu_op"]
    syncs = [e for e in raw if e.get("cat") == "cuda_runtime" and e["name"] == "cudaStreamSynchronize"
             and any(a <= Decimal(e["ts"]) < b for a, b in ops)]
    assert len(d["syncs"]) == len(syncs) and "stack" not in d["syncs"][0]
    assert sum(s["count"] for s in d["sync_summary"]) == len(syncs)
    text = rep.to_text().splitlines()
    assert text[0] == "host syncs (blocking device-to-host), by the op that issued them:"
    assert sum(int(x.split(" x ")[0]) for x in text[1:] if " x " in x and x.startswith("  ")) == len(syncs)
    kernels = sum(e.get("cat") == "kernel" for e in raw)
    assert f"rank 0: {kernels} kernels, launch latency" in rep.to_text()
    assert d["findings"] == loop.findings() and "findings:" in text


def test_host_report_is_the_cli_output_and_small_us_reaches_findings(loop, tmp_path):
    code, out = cli_stdout("host", MOE_LOOP, "--no-cache", "--small-us", "3")
    assert code == 0 and out == host_report(loop, 3.0).to_text() + "\n"
    assert "under 3 us" in out
    code, out = cli_stdout("host", MOE_LOOP, "--no-cache")
    assert code == 0 and out == host_report(loop).to_text() + "\n"


def test_host_info_findings_show_their_share():
    rep = host_report(tracelens.analyze(tracelens.load(MOE_LOOP, cache=False)))
    rep.findings = [{"severity": "info", "title": "t", "recoverable_us": None, "share_of_span": 0.25}]
    assert rep.to_text().splitlines()[-1] == "  [info] t (25.0% of the step; no recovery estimate)"


# -------------------------------------------------------------------------------------------- roofline


def test_roofline_result_text_and_json(tmp_path):
    a = tracelens.analyze(tracelens.load(MOE_GROUPED, cache=False))
    r = a.roofline()
    d = strict_json(r.to_dict())
    assert d["summary"] == r.summary() and len(d["roofline"]) == len(r.table) and len(d["unmodeled"]) == len(r.unmodeled)
    text = r.to_text(top=3).splitlines()
    assert len(text) == 1 + min(3, len(r.table)) + 1
    top = r.table.sort_values("gpu_us", ascending=False).iloc[0]
    assert text[1].startswith(top["op"][:36]) and text[1].split()[1] == f"{top['gpu_us'] / 1e3:.3f}"
    # the op groups' GPU time is the time of kernels the raw trace records under those ops' names
    op_names = {e["name"] for e in xs(MOE_GROUPED) if e.get("cat") == "cpu_op"}
    assert set(r.table["op"]) <= op_names
    assert text[-1] == (f"modeled: {100 * d['summary']['modeled_share']:.0f}% of non-communication GPU time; "
                        f"{len(r.unmodeled)} op group(s) unmodeled")
    code, out = cli_stdout("roofline", MOE_GROUPED, "--no-cache", "--top", "3")
    assert code == 0 and out == "\n".join(text) + "\n"


# ---------------------------------------------------------------------------------------------- health


def test_health_report_counts_and_exit_status(nccl, tmp_path):
    rep = health_report(nccl, "warning")
    d = strict_json(rep.to_dict())
    c = d["counts"]
    assert sum(c.values()) == len(rep.checks) == len(d["checks"])
    assert d["exit_status"] == (1 if c["error"] + c["warning"] else 0) and d["fail_on"] == "warning"
    assert health_report(nccl, "never").exit_status == 0
    assert rep.to_text().splitlines()[-1] == (f"2 rank(s): {c['error']} error(s), {c['warning']} warning(s), "
                                              f"{c['info']} note(s); exit {d['exit_status']} (--fail-on warning)")
    assert rep.summary() == nccl.summary()["health"]
    code, out = cli_stdout("check", NCCL_2RANK, "--no-cache", "--fail-on", "warning")
    assert code == rep.exit_status and out == rep.to_text() + "\n"


# ---------------------------------------------------------------------------------------------- memory


@pytest.fixture(scope="module")
def proxy():
    mc = M.load_model_config("gpu_proxy")
    return mc, *M.layout_for(mc, world=8, pp=2, ep=4, schedule="zbv", mbs=2)


def test_memory_fit_verdict_against_the_device(proxy):
    mc, cfg, lay = proxy
    peak = M.project(cfg, lay).peak_bytes
    roomy = M.memory_report(mc, cfg, lay, device_bytes=int(peak / 0.95) + 1, headroom=0.05)
    tight = M.memory_report(mc, cfg, lay, device_bytes=int(peak / 0.95) - 1, headroom=0.05)
    assert roomy.fits is True and tight.fits is False
    assert roomy.to_text().splitlines()[-1].startswith("fits ")
    assert tight.to_text().splitlines()[-1].startswith("does NOT fit ")
    d = strict_json(tight.to_dict())
    assert d["fits"] is False and d["device_bytes"] == tight.device_bytes and d["peak_bytes"] == round(peak)
    none = M.memory_report(mc, cfg, lay)
    assert none.fits is None and "fits" not in none.to_dict() and "fit" not in none.to_text().splitlines()[-1]


def test_memory_report_is_the_cli_output(proxy, tmp_path):
    mc, cfg, lay = proxy
    rep = M.memory_report(mc, cfg, lay, device_bytes=M.capacity(device="H200"))
    code, out = cli_stdout("memory", "gpu_proxy", "--world", "8", "--pp", "2", "--ep", "4", "--schedule", "zbv",
                           "--mbs", "2", "--device", "H200", "--json", tmp_path / "m.json")
    assert code == 0 and out == rep.to_text() + f"\nwrote {tmp_path / 'm.json'}\n"
    assert json.loads((tmp_path / "m.json").read_text()) == rep.to_dict()


def test_memory_measured_peak_from_the_manifest():
    mc = M.load_model_config(str(EP_L0))
    cfg, lay = M.layout_for(mc, source=str(EP_L0))
    rep = M.memory_report(mc, cfg, lay)
    manifest = json.loads((EP_L0 / "manifest.json").read_text())
    measured = max(manifest["metrics"]["peak_memory_bytes"])
    d = strict_json(rep.to_dict())
    assert d["measured_peak_bytes"] == measured and d["measured_kind"] == manifest["metrics"]["peak_memory_kind"]
    assert d["projected_over_measured"] == round(rep.projection.peak_bytes / measured, 4)
    assert f"projected / measured = {rep.projection.peak_bytes / measured:.3f}" in rep.to_text()


def test_memory_sweep_rows_fit(proxy):
    mc, cfg, lay = proxy
    dev = M.capacity("80GiB")
    rep = M.sweep_report(mc, cfg, lay, dev, global_batch=64, headroom=0.1, top=4)
    d = strict_json(rep.to_dict())
    assert 0 < len(d["fits"]) <= 4 and len(d["projections"]) == min(4, len(rep.fitting))
    assert all(r["peak_bytes"] <= dev * 0.9 for r in d["fits"])
    text = rep.to_text().splitlines()
    assert text[0].startswith(f"{len(rep.fitting)} layout(s) of 8 GPUs fit 80.0 GiB (headroom 10%)")
    assert [x[:58].rstrip() for x in text[2:2 + len(d["fits"])]] == [r["label"] for r in d["fits"]]


# ---------------------------------------------------------------------------------------------- bubble


def test_bubble_report_matches_the_formulas():
    rep = bubble_report(4, vpp=2, ga=16)
    text = rep.to_text().splitlines()
    # GPipe and 1F1B: (p-1)/(m+p-1); interleaved: (p-1)/(v*m+p-1)
    assert f"1f1b   pp 4, 16 microbatches: bubble {100 * 3 / 19:.1f}%" in text
    assert f"vpp    pp 4, 16 microbatches, vpp 2: bubble {100 * 3 / 35:.1f}%" in text
    d = strict_json(rep.to_dict())
    assert {s["schedule"]: s["bubble_ratio"] for s in d["schedules"]}["1f1b"] == pytest.approx(3 / 19)
    few = bubble_report(4, ga=4)  # zbv needs >= 2*pp microbatches
    assert {s["schedule"]: s["bubble_ratio"] for s in strict_json(few.to_dict())["schedules"]}["zbv"] is None
    assert few.to_text().splitlines()[-1].startswith("n/a: zbv (zero-bubble V schedule)")
    derived = bubble_report(2, global_tokens=8192, seq=512, mbs=1, world=8)
    assert derived.microbatches == 8192 // (512 * 4)
    assert derived.to_text().splitlines()[0] == "DP = 8 / (pp 2 x tp 1 x cp 1) = 4; GA = 8192 / (512 x 1 x 4) = 4"
    assert cli_stdout("bubble", "--pp", "4", "--vpp", "2", "--ga", "16") == (0, rep.to_text() + "\n")


# ----------------------------------------------------------------------------------------------- ppvis


def test_pipeline_text_and_json(tmp_path):
    res = load_pipeline(str(PP_1F1B), cache=False)
    d = strict_json(json.loads(json.dumps(res.to_dict(), default=str)))
    text = res.to_text().splitlines()
    ranks = sorted(int(p.name.split(".")[0].removeprefix("rank")) for p in (PP_1F1B / "pipeline").glob("rank*.jsonl*"))
    assert ranks == [0, 1]
    rows = text[2:2 + len(ranks)]
    assert [int(x.split()[0]) for x in rows] == ranks and len(d["bubble"]["per_rank"]) == len(ranks)
    assert text[0].startswith(f"pipeline: {d['meta']['schedule']}")
    html = tmp_path / "p.html"
    code, out = cli_stdout("ppvis", PP_1F1B, "--no-cache", "-o", html)
    assert code == 0 and out == res.to_text() + f"\nwrote {html}\n"


# ---------------------------------------------------------------------------------------------- whatif


def test_whatif_prediction_text_and_json():
    p = Model.from_run(str(EP_L0)).predict({})
    d = strict_json(p.to_dict())
    assert d["changes"] == {} and d["step_s"] == pytest.approx(d["base_step_s"]) and d["gain"] == pytest.approx(0.0)
    text = p.to_text(str(EP_L0)).splitlines()
    assert text[0] == f"what-if (no change) on {EP_L0}"
    assert text[1] == f"  step time      {1e3 * p.base_step_s:9.1f} ms -> {1e3 * p.step_s:9.1f} ms"
    assert not math.isnan(p.uncertainty)
    code, out = cli_stdout("whatif", EP_L0)
    assert code == 0 and out == "\n".join(text) + "\n"
