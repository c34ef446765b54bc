"""End to end on real run dirs the trainer wrote on 2 x H200 (tests/fixtures/README.md says how).

* `h200_ep2_run/{L0_loop,L3_torch}`: expert parallelism over NCCL (EP=2), sync-free level 0 with the
  per-expert loop vs level 3 with `torch._grouped_mm`; one profiled step per rank.
* `h200_pp2_run/{1f1b,vpp2,zb1p}`: pipeline parallelism (PP=2, 8 microbatches), 1F1B, interleaved with
  two virtual stages per rank and zero-bubble ZB-H1; per-action jsonl (gzipped) and traces.

Expected values are computed here from the raw JSON / jsonl with the standard library.
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from decimal import Decimal

import pytest

import tracelens
from tracelens.analysis.comm import collective_instances
from tracelens.analysis.diff import diff
from tracelens.analysis.pipeline import load_pipeline

from ..conftest import FIXTURES, raw_events

EP2 = FIXTURES / "h200_ep2_run"
PP2 = FIXTURES / "h200_pp2_run"


def _a2a_raw(run, rank):
    """(record_param_comms all_to_allv count, NCCL SendRecv kernels) of one rank's trace."""
    ev = raw_events(EP2 / run / "traces" / f"rank{rank}.json.gz")
    calls = [e for e in ev if e.get("name") == "record_param_comms"
             and (e.get("args") or {}).get("Collective name") == "all_to_allv"]
    kernels = [e for e in ev if e.get("cat") == "kernel" and e["name"].startswith("ncclDevKernel_SendRecv")]
    return calls, kernels


def _stream_syncs_in_ops(run, rank):
    ev = [e for e in raw_events(EP2 / run / "traces" / f"rank{rank}.json.gz") if e.get("ph") == "X"]
    ops = [(Decimal(e["ts"]), Decimal(e["ts"]) + Decimal(e["dur"])) for e in ev if e.get("cat") == "cpu_op"]
    return [s for s in ev if s.get("cat") == "cuda_runtime" and s["name"] == "cudaStreamSynchronize"
            and any(a <= Decimal(s["ts"]) < b for a, b in ops)]


@pytest.mark.parametrize("run", ["L0_loop", "L3_torch"])
def test_ep2_all_to_all_over_nccl_matched_on_both_ranks(run):
    raw = {r: _a2a_raw(run, r) for r in (0, 1)}
    for calls, kernels in raw.values():
        assert len(calls) == len(kernels) > 0  # one NCCL SendRecv kernel per all_to_allv
    inst = collective_instances(tracelens.analyze(tracelens.load(EP2 / run, cache=False)))
    a2a = inst[inst["collective"] == "all_to_allv"]
    for r in (0, 1):
        mine = a2a[a2a["rank"] == r]
        assert len(mine) == len(raw[r][0])
        assert (mine["comm_us"] > 0).all() and (mine["sync_us"] >= 0).all()
        # sync + comm of an instance spans this rank's kernel: from its start to its end
        k = sorted(raw[r][1], key=lambda e: Decimal(e["ts"]))
        got = mine.sort_values("instance")
        for (_, row), e in zip(got.iterrows(), k):
            assert row["sync_us"] + row["comm_us"] == pytest.approx(float(Decimal(e["dur"])), abs=0.01)


def test_ep2_level0_loop_to_level3_grouped_diff():
    base = tracelens.analyze(tracelens.load(EP2 / "L0_loop", cache=False))
    new = tracelens.analyze(tracelens.load(EP2 / "L3_torch", cache=False))
    r = diff(base, new)
    m = r.metrics.set_index("metric")
    # level 0 syncs on the host in the MoE path (token counts for permute and all-to-all splits);
    # level 3 never does. The raw traces: cudaStreamSynchronize inside an op.
    assert len(_stream_syncs_in_ops("L0_loop", 0)) > 0 and len(_stream_syncs_in_ops("L3_torch", 0)) == 0
    assert m.loc["host_syncs", "new"] < m.loc["host_syncs", "base"]
    assert m.loc["step_time", "new"] < m.loc["step_time", "base"]
    added = r.kernels[r.kernels["status"] == "added"]
    assert (added["category"] == "grouped GEMM").any()
    man = {k: json.loads((EP2 / k / "manifest.json").read_text()) for k in ("L0_loop", "L3_torch")}
    for k, mf in man.items():
        assert mf["world_size"] == 2 and mf["parallel"]["ep"] == 2 and mf["mesh"]["backend"] == "nccl"
        assert "H200" in mf["device"]["name"]
    assert man["L3_torch"]["metrics"]["tokens_per_s_per_gpu"] > man["L0_loop"]["metrics"]["tokens_per_s_per_gpu"]


def _raw_actions(run):
    rows = []
    for r in (0, 1):
        with gzip.open(PP2 / run / "pipeline" / f"rank{r}.jsonl.gz", "rt") as f:
            rows += [json.loads(line) for line in f if line.strip()]
    return rows


def _manifest_skips(run) -> set:
    """Steps the run's manifest marks as warm-up (config.timing_warmup_steps) or trace export (profile.step_end),
    read with the standard library: ppvis leaves them out of its window, as the rest of the analyzer does."""
    man = json.loads((PP2 / run / "manifest.json").read_text())
    out = set(range(int(man["config"].get("timing_warmup_steps") or 0)))
    prof = man.get("profile") or {}
    if isinstance(prof.get("step_start"), int) and isinstance(prof.get("step_end"), int) and prof["step_end"] > prof["step_start"]:
        out.add(prof["step_end"])
    return out


def _raw_bubble(rows, skip_first=True, skip=()):
    """Per rank: idle / window summed over steps; window = first start to last end over all ranks. skip: steps
    also left out (the manifest's warm-up and trace-export steps) unless that leaves none."""
    steps = sorted({a["step"] for a in rows})
    if skip_first and len(steps) > 1:
        steps = steps[1:]
    if [x for x in steps if x not in set(skip)]:
        steps = [x for x in steps if x not in set(skip)]
    idle, window = {}, {}
    for s in steps:
        acts = [a for a in rows if a["step"] == s]
        lo, hi = min(a["start_ns"] for a in acts), max(a["end_ns"] for a in acts)
        for r in sorted({a["rank"] for a in acts}):
            iv = sorted((a["start_ns"], a["end_ns"]) for a in acts if a["rank"] == r)
            busy, cur_s, cur_e = 0, None, None
            for a, b in iv:  # union of intervals
                if cur_e is None or a > cur_e:
                    busy += 0 if cur_e is None else cur_e - cur_s
                    cur_s, cur_e = a, b
                else:
                    cur_e = max(cur_e, b)
            busy += cur_e - cur_s
            idle[r] = idle.get(r, 0) + (hi - lo - busy)
            window[r] = window.get(r, 0) + (hi - lo)
    return {r: idle[r] / window[r] for r in idle}, steps


@pytest.mark.parametrize("run,schedule,vpp", [("1f1b", "1f1b", 1), ("vpp2", "vpp", 2)])
def test_pp2_bubbles_match_raw_jsonl(run, schedule, vpp):
    rows = _raw_actions(run)
    pa = load_pipeline(PP2 / run)
    expect, steps = _raw_bubble(rows, skip=_manifest_skips(run))
    assert pa.steps == steps and pa.source == "jsonl"
    got = pa.per_rank.set_index("rank")["bubble_ratio"]
    for r, v in expect.items():
        assert got[r] == pytest.approx(v, abs=1e-9)
    assert pa.meta.pp == 2 and pa.meta.vpp == vpp and pa.meta.microbatches == 8 and pa.meta.schedule == schedule
    # every stage ran 8 forwards and 8 backwards per step
    per_step = len(rows) // len({a["step"] for a in rows})
    assert per_step == 2 * 8 * 2 * vpp
    # theory from the closed form: (p - 1) / (v m + p - 1)
    assert pa.theory_ratio == pytest.approx(1 / (vpp * 8 + 1))


def test_pp2_zero_bubble_matches_raw_jsonl():
    """ZB-H1 (ScheduleInterleavedZeroBubble, one stage per rank): F, B (inputs) and W (weights) per
    micro-batch; the bubble against the raw jsonl and against ZB-H1's (p - 1) / (3m + p - 1)."""
    rows = _raw_actions("zb1p")
    pa = load_pipeline(PP2 / "zb1p")
    expect, steps = _raw_bubble(rows, skip=_manifest_skips("zb1p"))
    assert pa.steps == steps and pa.source == "jsonl"
    got = pa.per_rank.set_index("rank")["bubble_ratio"]
    for r, v in expect.items():
        assert got[r] == pytest.approx(v, abs=1e-9)
    assert (pa.meta.pp, pa.meta.vpp, pa.meta.microbatches, pa.meta.schedule) == (2, 1, 8, "zb1p")
    for s in steps:  # 8 F, 8 B and 8 W per stage per step
        kinds = Counter((a["stage"], a["kind"]) for a in rows if a["step"] == s)
        assert kinds == {(st, k): 8 for st in (0, 1) for k in ("F", "B", "W")}
    assert pa.theory_ratio == pytest.approx(1 / (3 * 8 + 1))
    # the W passes fill what 1F1B leaves idle: less bubble than the 1F1B run of the same model
    assert pa.overall_ratio < load_pipeline(PP2 / "1f1b").overall_ratio


def test_pp2_interleaved_flags_the_head_stage():
    """The last virtual stage holds a layer plus the 102400-word output head and loss: the slowest."""
    pa = load_pipeline(PP2 / "vpp2")
    rows = [a for a in _raw_actions("vpp2") if a["step"] in pa.steps]
    per_stage = {}
    for a in rows:
        per_stage[a["stage"]] = per_stage.get(a["stage"], 0) + a["end_ns"] - a["start_ns"]
    slowest = max(per_stage, key=per_stage.get)
    assert slowest == 3
    assert pa.balance.slowest_stage == 3 and pa.balance.flagged
    assert "stage 3" in pa.balance.statement
