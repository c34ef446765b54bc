"""Trace health checks and comm on partial / mutated rank sets, on copies of the real fixtures.

Expected numbers come from the raw JSON (tests/conftest.raw_events), never from the code under test.
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

import tracelens
from tracelens.analysis import comm as CM
from tracelens.analysis.health import exit_status, health_checks, run_context

from ..conftest import FIXTURES, MOE_LOOP, NCCL_2RANK, raw_events, write_json_gz
from ._cli import run_cli

EP2_L0 = FIXTURES / "h200_ep2_run" / "L0_loop"
EP2_L3 = FIXTURES / "h200_ep2_run" / "L3_torch"
PP2_1F1B = FIXTURES / "h200_pp2_run" / "1f1b"


def _read(path: Path) -> dict:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def _write(doc: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_gz(doc, path)
    return path


def _checks(path, **kw):
    a = tracelens.analyze(tracelens.load(path, cache=False))
    return a, health_checks(a, run_context(a.trace), **kw)


def _rows(df, check):
    return df[df["check"] == check]


def _rank_files(src: Path) -> list[Path]:
    d = src / "traces" if (src / "traces").is_dir() else src
    return sorted(d.glob("rank*.json.gz"))


def _copy_ranks(src: Path, dst: Path, mutate=None) -> Path:
    """The rank files of `src` into dst/, rank `r`'s JSON passed through mutate(r, doc) when given."""
    for f in _rank_files(src):
        r = int(f.name[4:f.name.index(".")])
        if mutate is None:
            dst.mkdir(parents=True, exist_ok=True)
            shutil.copy(f, dst / f.name)
        else:
            doc = _read(f)
            _write(mutate(r, doc) or doc, dst / f.name)
    return dst


# ------------------------------------------------------------------------------------ partial rank sets


@pytest.mark.parametrize("src,keep", [(NCCL_2RANK, 0), (NCCL_2RANK, 1), (EP2_L3, 1)])
def test_one_of_two_ranks_is_flagged_and_comm_says_partial(src, keep):
    path = _rank_files(src)[keep]
    world = _read(path)["distributedInfo"]["world_size"]
    assert world == 2
    a, df = _checks(path)
    miss = _rows(df, "missing_ranks")
    assert len(miss) >= 1 and (miss["severity"] == "warning").all()
    top = miss.iloc[0]
    assert top["ranks"] == [1 - keep] and top["numbers"]["world_size"] == 2 and top["numbers"]["loaded"] == [keep]
    assert "sync wait" in top["invalidates"]
    # comm: per-rank figures kept, no cross-rank claim
    inst = CM.collective_instances(a)
    n_kernels = sum(1 for e in raw_events(path) if e.get("cat") == "kernel" and "nccl" in e["name"].lower())
    assert len(inst) == n_kernels and not inst["cross_rank"].any()
    assert inst[["sync_us", "comm_us", "skew_us", "busbw_gbps"]].isna().all().all()
    assert (inst["last_rank"] == -1).all() and CM.stragglers(inst).empty
    summ = CM.comm_summary(inst)
    assert summ["sync_us"].isna().all() and summ["sync_pct"].isna().all() and (summ["kernel_us"] > 0).all()
    note = CM.partial_note(a, inst)
    assert note.startswith(f"partial rank set: 1 of 2 ranks loaded (ranks {keep})")
    # the summary.json key and the exit status for CI
    h = a.summary()["health"]
    assert h["worst"] == "warning" and h["counts"]["warning"] >= 1
    assert exit_status(df, "error") == 0 and exit_status(df, "warning") == 1


def test_comm_cli_on_a_partial_set_says_so(tmp_path):
    out = tmp_path / "comm.json"
    p = run_cli("comm", NCCL_2RANK / "rank1.json.gz", "--no-cache", "--json", out)
    assert p.returncode == 0, p.stderr
    assert "partial rank set: 1 of 2 ranks loaded" in p.stdout
    assert "arrives last" not in p.stdout  # no straggler claim
    doc = json.loads(out.read_text())
    assert doc["partial"].startswith("partial rank set") and all(r["sync_us"] is None for r in doc["records"])
    assert doc["stragglers"] == [] and all(g["complete"] is False for g in doc["groups"])
    # the whole set is not partial
    p = run_cli("comm", NCCL_2RANK, "--no-cache")
    assert p.returncode == 0 and "partial" not in p.stdout and "arrives last" in p.stdout


@pytest.mark.parametrize("src", [NCCL_2RANK, EP2_L0, PP2_1F1B])
def test_whole_sets_have_no_missing_ranks(src):
    a, df = _checks(src)
    assert _rows(df, "missing_ranks").empty and _rows(df, "clock_skew").empty
    inst = CM.collective_instances(a)
    assert inst["cross_rank"].all() and CM.partial_note(a, inst) == ""


# ------------------------------------------------------------------------------------ matching by identity


def _kernels_by_collective(path: Path) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list] = {}
    for e in raw_events(path):
        if e.get("cat") == "kernel" and "nccl" in e["name"].lower():
            c = (e.get("args") or {}).get("Collective name")
            c = {"send": "p2p", "recv": "p2p"}.get(c, c)  # rank 0's send is rank 1's recv
            out.setdefault(c, []).append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    return {c: sorted(v) for c, v in out.items()}


@pytest.mark.parametrize("collective,drop", [("allreduce", 1), ("all_to_allv", 3), ("allreduce", 0)])
def test_a_rank_with_one_collective_removed_is_matched_correctly(tmp_path, collective, drop):
    # truth, from the unmutated raw JSON: both ranks have the same collectives; the i-th of each name on
    # rank 0 is the i-th on rank 1 (tests/tracelens/test_comm.py checks those pairings against the README)
    k0 = _kernels_by_collective(NCCL_2RANK / "rank0.json.gz")
    k1 = _kernels_by_collective(NCCL_2RANK / "rank1.json.gz")
    assert all(len(k0[c]) == len(k1[c]) for c in k0)
    removed = k1[collective][drop]

    def mutate(r, doc):
        if r == 1:
            doc["traceEvents"] = [e for e in doc["traceEvents"] if not (
                e.get("cat") == "kernel" and (e.get("args") or {}).get("Collective name") == collective
                and abs(float(e["ts"]) - removed[0]) < 1e-6)]
    d = _copy_ranks(NCCL_2RANK, tmp_path / "drop", mutate)
    a = tracelens.analyze(tracelens.load(d, cache=False))
    inst = CM.collective_instances(a)
    t0 = min(float(e["ts"]) for r in (0, 1) for e in raw_events(d / f"rank{r}.json.gz") if "ts" in e)
    expected = {}  # rank-1 kernel start -> the rank-0 kernel (start, end) it must be paired with
    for c in k0:
        for i, (s1, e1) in enumerate(k1[c]):
            if not (c == collective and i == drop):
                expected[s1 - t0] = (k0[c][i], (s1, e1))
    got = 0
    for _, g in inst.groupby(["group", "peers", "seq"]):
        if set(g["rank"]) != {0, 1}:
            # the rank-0 kernel whose partner was removed stands alone, without cross-rank figures
            assert len(g) == 1 and int(g["rank"].iloc[0]) == 0 and not g["cross_rank"].iloc[0]
            assert g["start_us"].iloc[0] == pytest.approx(k0[collective][drop][0] - t0, abs=1e-3)
            continue
        r0, r1 = g[g["rank"] == 0].iloc[0], g[g["rank"] == 1].iloc[0]
        key = min(expected, key=lambda k: abs(k - r1["start_us"]))
        assert key == pytest.approx(r1["start_us"], abs=1e-3)
        (s0, e0), (s1, e1) = expected[key]
        assert r0["start_us"] == pytest.approx(s0 - t0, abs=1e-3)
        last = max(s0, s1)
        assert r0["skew_us"] == pytest.approx(abs(s0 - s1), abs=1e-3)
        assert r0["sync_us"] == pytest.approx(min(last - s0, e0 - s0), abs=1e-3)
        assert r1["comm_us"] == pytest.approx(max(e1 - max(last, s1), 0), abs=1e-3)
        got += 1
    assert got == len(expected)
    # the health check names the launch whose kernel is gone
    dropped = _rows(health_checks(a, run_context(a.trace), inst=inst), "dropped_gpu_events")
    assert dropped["ranks"].tolist() == [[1]] and dropped.iloc[0]["numbers"]["missing"] == 1
    # matching by global position (per family) would have paired differently after the gap
    if drop < len(k1[collective]) - 1:
        fam = inst[inst["collective"] == collective]
        assert len(fam[fam["rank"] == 0]) == len(fam[fam["rank"] == 1]) + 1


def test_sizes_come_from_cpu_events_when_kernels_lack_them():
    """HTA's A100 trace: NCCL kernels without collective args; sizes from the nccl:* annotations."""
    path = FIXTURES / "external" / "hta" / "trace_diff" / "control.json.gz"
    a = tracelens.analyze(tracelens.load(path, cache=False))
    inst = CM.collective_instances(a)
    ev = raw_events(path)
    ann = sorted((float(e["ts"]), e) for e in ev if e.get("cat") == "user_annotation" and e["name"].startswith("nccl:"))
    elt = {"float": 4, "int": 4, "long int": 8, "c10::BFloat16": 2, "c10::Half": 2, "double": 8}
    total_known = 0
    for _, e in ann:
        dims, types = e["args"].get("Input Dims"), e["args"].get("Input type")
        if e["name"] != "nccl:all_gather" and dims and types and types[0] in elt:
            n = 1
            for x in dims[0]:
                n *= x
            total_known += n * elt[types[0]]
    assert (inst["size_source"] == "annotation").all() and (inst["bytes"] > 0).all()
    assert int(inst["bytes"].sum()) == total_known
    assert set(inst["family"]) == {"all_reduce", "all_to_all"}  # from the annotation, not 'SendRecv' kernels
    assert not inst["cross_rank"].any()  # rank 3 of 8
    summ = CM.comm_summary(inst)
    assert (summ["unknown_size"] == 0).all() and int(summ["bytes"].sum()) == total_known


def test_unknown_sizes_are_never_summed():
    """PP p2p kernels of batched send/recv carry no size: -1 per record, 0 summed, counted as unknown."""
    a = tracelens.analyze(tracelens.load(PP2_1F1B, cache=False))
    inst = CM.collective_instances(a)
    p2p = inst[inst["family"] == "p2p"]
    assert len(p2p) and (p2p["bytes"] == -1).all() and p2p["busbw_gbps"].isna().all()
    summ = CM.comm_summary(inst).set_index(["rank", "collective"])
    for r in (0, 1):
        row = summ.loc[(r, "SendRecv")]
        assert row["bytes"] == 0 and row["unknown_size"] == row["count"]


# ------------------------------------------------------------------------------------ shapes, start-up, clocks


@pytest.mark.parametrize("src", [MOE_LOOP, EP2_L3 / "traces" / "rank0.json.gz"])
def test_trace_without_shapes_is_flagged(tmp_path, src):
    _, df = _checks(src)
    assert _rows(df, "record_shapes").empty
    doc = _read(src)
    n = 0
    for e in doc["traceEvents"]:
        if isinstance(e.get("args"), dict) and e["args"].pop("Input Dims", None) is not None:
            n += 1
    assert n > 0
    _, df = _checks(_write(doc, tmp_path / "rank0.json.gz"))
    row = _rows(df, "record_shapes")
    assert len(row) == 1 and row.iloc[0]["severity"] == "warning" and "roofline" in row.iloc[0]["invalidates"]


@pytest.mark.parametrize("src", [NCCL_2RANK])
def test_profiler_startup_wait_is_flagged(src):
    files = _rank_files(src)
    raw = {int(f.name[4]): raw_events(f) for f in files}
    window_start = {r: min(float(e["ts"]) for e in ev if "ts" in e and e.get("ph") in ("X", "i")) for r, ev in raw.items()}
    # independent: a rank's first NCCL kernel that began before the other rank's first event
    first = {r: min((float(e["ts"]), float(e["dur"])) for e in ev if e.get("cat") == "kernel" and "nccl" in e["name"].lower())
             for r, ev in raw.items()}
    waited = {r: min(first[1 - r][0] - s, d) for r, (s, d) in first.items() if s < window_start[1 - r]}
    assert waited  # both fixtures have one: the first collective, on both ranks the same instance
    _, df = _checks(src)
    rows = _rows(df, "startup_wait")
    assert set(r for rr in rows["ranks"] for r in rr) == set(waited)
    assert (rows["severity"] == "warning").all()
    for row in rows.itertuples():
        n = row.numbers
        assert n["sync_us"] == pytest.approx(waited[row.ranks[0]], abs=1e-3)
        assert n["sync_us"] > n["steady_median_sync_us"]  # measured, not the rule: the mechanism flags it
    # a run whose ranks started profiling before their first collective has none
    _, df = _checks(EP2_L0)
    assert _rows(df, "startup_wait").empty


def test_pipeline_fill_wait_is_not_flagged():
    """pp2 1F1B: rank 1's first receive began before rank 0's trace did, but it waits for stage 0's first forward
    (the schedule's fill), a wait measured on both sides: not a profiler start-up wait (issue 34)."""
    raw = {int(f.name[4]): raw_events(f) for f in _rank_files(PP2_1F1B)}
    start0 = min(float(e["ts"]) for e in raw[0] if "ts" in e and e.get("ph") in ("X", "i"))
    first1 = min(float(e["ts"]) for e in raw[1] if e.get("cat") == "kernel" and "nccl" in e["name"].lower())
    assert first1 < start0  # what the start-up rule used to flag
    _, df = _checks(PP2_1F1B)
    assert _rows(df, "startup_wait").empty


def _shift(delta_us: float):
    def mutate(r, doc):
        if r == 1:
            for e in doc["traceEvents"]:
                if isinstance(e.get("ts"), (int, float)) and e.get("ph") != "M":
                    e["ts"] = e["ts"] + delta_us
    return mutate


@pytest.mark.parametrize("src", [NCCL_2RANK, EP2_L0])
def test_skewed_clock_is_flagged(tmp_path, src):
    delta = 50_000.0  # rank 1's clock 50 ms ahead
    d = _copy_ranks(src, tmp_path / "skew", _shift(delta))
    # independent: per synchronizing collective (equal-size ones), the i-th kernel on each rank is one instance
    k0, k1 = (_kernels_by_collective(d / f"rank{r}.json.gz") for r in (0, 1))
    sync = [c for c in k0 if c and not c.endswith("v") and CM._norm_collective(c) in CM.SYNCHRONIZING]
    gaps = [s1 - e0 for c in sync for (s0, e0), (s1, e1) in zip(k0[c], k1[c]) if s1 - e0 > 0]
    assert gaps
    a, df = _checks(d)
    rows = _rows(df, "clock_skew")
    err = rows[rows["severity"] == "error"]
    assert len(err) == 1 and err.iloc[0]["ranks"] == [0, 1]
    assert err.iloc[0]["numbers"]["max_gap_us"] == pytest.approx(max(gaps), abs=1e-3)
    assert err.iloc[0]["numbers"]["instances"] == len(gaps)
    assert exit_status(df) == 1
    # the unshifted traces: no clock problem
    _, df = _checks(src)
    assert _rows(df, "clock_skew").empty


def test_swapped_distributed_info_ranks_are_an_error(tmp_path):
    def mutate(r, doc):
        doc["distributedInfo"]["rank"] = 1 - r  # each file claims the other rank
    d = _copy_ranks(NCCL_2RANK, tmp_path / "swap", mutate)
    a, df = _checks(d)
    rows = _rows(df, "rank_identity")
    assert (rows["severity"] == "error").all() and len(rows) == 2
    # rank 0's own p2p records ('nccl:send 0->1') now sit in the file analyzed as rank 1
    sends = {e["name"] for e in raw_events(d / "rank0.json.gz") if e.get("name", "").startswith("nccl:send")}
    assert sends == {"nccl:send 0->1"}
    r = rows[rows["ranks"].apply(lambda x: x == [1])].iloc[0]
    assert r["numbers"]["p2p_self"] == [0] and r["numbers"]["assigned"] == 1


def test_unlinked_kernels_counted_like_the_raw_json():
    path = FIXTURES / "external" / "tracelens" / "mi300_resnet_act_checkpoint.json.gz"
    ev = raw_events(path)
    rt = {e["args"]["correlation"] for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("ph") == "X"
          and "correlation" in (e.get("args") or {})}
    ext = {e["args"].get("External id") for e in ev if e.get("cat") == "cpu_op" and e.get("args")}
    gpu = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e.get("ph") == "X"]
    unl = [e for e in gpu if e["args"].get("correlation") not in rt and e["args"].get("External id") not in ext]
    assert unl
    _, df = _checks(path)
    row = _rows(df, "unlinked_kernels").iloc[0]
    assert row["severity"] == "warning" and row["numbers"]["events"] == len(unl)
    assert row["numbers"]["us"] == pytest.approx(sum(float(e["dur"]) for e in unl), abs=1e-3)


# ------------------------------------------------------------------------------------ run manifest


def _copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_incomplete_run_and_missing_manifest(tmp_path):
    run = _copy_run(EP2_L3, tmp_path / "run")
    _, df = _checks(run)
    assert _rows(df, "incomplete_run").empty
    m = json.loads((run / "manifest.json").read_text())
    m["status"] = "running"
    (run / "manifest.json").write_text(json.dumps(m))
    _, df = _checks(run)
    assert _rows(df, "incomplete_run")["severity"].tolist() == ["error"]
    (run / "manifest.json").unlink()
    _, df = _checks(run)
    assert _rows(df, "incomplete_run")["severity"].tolist() == ["warning"]


def test_profiler_overhead_from_the_manifest(tmp_path):
    run = _copy_run(EP2_L3, tmp_path / "run")
    m = json.loads((run / "manifest.json").read_text())
    times = [1.0, 0.2, 0.2, 0.050, 0.052, 0.060, 0.051]  # steps 3, 4, 6 unprofiled; 5 export
    m["metrics"]["step_times_s"] = times
    m["metrics"]["timed_steps"] = [3, 4, 6]
    m["profile"].update(step_start=5, step_end=6)
    m["config"]["timing_warmup_steps"] = 3
    m["config"]["steps"] = len(times)
    (run / "manifest.json").write_text(json.dumps(m))
    _, df = _checks(run)
    row = _rows(df, "profiler_overhead").iloc[0]
    assert row["severity"] == "warning"
    assert row["numbers"]["overhead_pct"] == pytest.approx(100 * (0.060 / 0.051 - 1), abs=1e-3)
    # a profiled step inside the unprofiled steps' range: a note, not a warning
    m["metrics"]["step_times_s"][5] = 0.051
    (run / "manifest.json").write_text(json.dumps(m))
    _, df = _checks(run)
    assert _rows(df, "profiler_overhead")["severity"].tolist() == ["info"]


# ------------------------------------------------------------------------------------ CLI


class _Run:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def _check_cli(*args):
    """`tracelens check ARGS` in this process (click's runner: exit status, stdout and stderr apart)."""
    from click.testing import CliRunner

    from tracelens.cli import main

    r = CliRunner().invoke(main, ["check", "--no-cache", *map(str, args)])
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return _Run(r.exit_code, r.stdout, r.stderr)


def test_check_cli_exit_codes(tmp_path):
    p = _check_cli(NCCL_2RANK)  # a start-up wait (warning), nothing wrong
    assert p.returncode == 0, p.stderr
    assert "startup_wait (rank 1)" in p.stdout and "do not trust:" in p.stdout
    assert _check_cli(NCCL_2RANK, "--fail-on", "warning").returncode == 1
    skewed = _copy_ranks(NCCL_2RANK, tmp_path / "skew", _shift(50_000.0))
    out = tmp_path / "health.json"
    p = _check_cli(skewed, "--json", out)
    assert p.returncode == 1 and "error   clock_skew (ranks 0, 1)" in p.stdout
    doc = json.loads(out.read_text())
    assert doc["worst"] == "error" and doc["exit_status"] == 1 and doc["counts"]["error"] == 1
    assert {c["check"] for c in doc["checks"]} >= {"clock_skew"}
    assert _check_cli(skewed, "--fail-on", "never").returncode == 0
    p = _check_cli(tmp_path / "nothing-here")
    assert p.returncode == 2 and p.stdout == "" and len(p.stderr.strip().splitlines()) == 1
    assert p.stderr.startswith("tracelens: error: ")
    bad = tmp_path / "rank0.json"
    bad.write_text('{"traceEvents": [')
    p = _check_cli(bad)
    assert p.returncode == 2 and str(bad) in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_report_has_health_section(tmp_path):
    from reports.html import render

    a = tracelens.analyze(tracelens.load(NCCL_2RANK / "rank0.json.gz", cache=False))
    page = render(a)
    i, j = page.index('id="health"'), page.index('id="overview"')
    assert i < j and "missing_ranks" in page[i:j] and "1 of 2 ranks loaded" in page[i:j]
    assert "partial rank set: 1 of 2 ranks loaded" in page  # the comm section says so too
