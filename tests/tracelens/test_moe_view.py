"""The MoE view (tracelens.analysis.moe_view, `tracelens moe`, summary.json `moe`).

Expected values are computed here from the raw trace JSON and the routing file read with the standard
library (json.load and our own counting), never with the code under test:

* the committed 4-GPU level-3 run without a routing file: grouped-GEMM rows computed vs routed (75 % padding)
  from the `aten::_grouped_mm` input dims and tokens x top_k, and the all-to-all bytes per rank pair from the
  `record_param_comms` events;
* the same runs recorded with the routing counts: rows received per rank, padding per rank, routed bytes per
  pair; at level 0 the traces' split sizes are the routing counts summed per destination rank;
* bad routing files (truncated, another run's, a malformed count list): one line naming the file, exit 2;
* traces from elsewhere (tests/fixtures/external): what the trace allows, with one line for what is missing.
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

import tracelens
from tracelens.analysis.moe_view import placement_preview, routing_tables, straggler_tie
from tracelens.cli import main
from tracelens.errors import TraceError
from tracelens.io.routing import RoutingError, check_run, decode

from ..conftest import FIXTURES

L3 = FIXTURES / "h100_4gpu" / "ep4_L3_torch"
R_L3 = FIXTURES / "h100_4gpu_routing" / "ep4_L3_torch"
R_L0 = FIXTURES / "h100_4gpu_routing" / "ep4_L0_loop"
EXTERNAL = FIXTURES / "external"


# ------------------------------------------------------------------------------------------ raw-JSON helpers


def _events(run: Path, rank: int) -> list[dict]:
    with gzip.open(run / "traces" / f"rank{rank}.json.gz", "rt") as f:
        return json.load(f)["traceEvents"]


def _step_window(ev: list[dict], step: int) -> tuple[float, float]:
    w = [(e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("name") == f"ProfilerStep#{step}"]
    return min(a for a, _ in w), max(b for _, b in w)


def _grouped_rows_raw(ev: list[dict], lo: float, hi: float) -> list[int]:
    """M of every aten::_grouped_mm call in [lo, hi]: rows of [M, K] x [E, K, N], contracted dim of [K, M] x [M, N]."""
    out = []
    for e in ev:
        if e.get("name") == "aten::_grouped_mm" and e.get("cat") == "cpu_op" and lo <= e["ts"] <= hi:
            a, b = e["args"]["Input Dims"][:2]
            out.append(a[0] if len(b) == 3 else a[1])
    return out


def _token_a2a_raw(ev: list[dict], lo: float, hi: float) -> list[dict]:
    return [e["args"] for e in ev if e.get("name") == "record_param_comms" and lo <= e["ts"] <= hi
            and e["args"].get("Collective name") == "all_to_allv" and e["args"].get("dtype") == "BFloat16"]


def _manifest(run: Path) -> dict:
    return json.loads((run / "manifest.json").read_text())


def _pairs(rep) -> dict[tuple[int, int], tuple[float, float]]:
    return {(int(r.src), int(r.dst)): (float(r.sent_bytes), float(r.routed_bytes)) for r in rep.pairs.itertuples()}


# ---------------------------------------------------------------------------------------------- unit: tables


def _doc(**over):
    d = {"format": "moe-routing-counts", "schema_version": 1, "run": {"run_id": "abc", "created_utc": "t0"},
         "n_routed_experts": 4, "top_k": 2, "d_model": 8, "dtype": "bf16", "ep": 2, "tokens_per_microbatch": 4,
         "steps": 3, "profiled_steps": [1, 2],
         "ranks": [{"rank": r, "ep_rank": r, "ep_group": [0, 1], "pp_rank": 0,
                    "layers": [{"layer": 1, "total": [6, 6, 6, 6], "total_forwards": 3,
                                "steps": [{"step": 1, "forwards": 1, "counts": [4, 2, 1, 1] if r == 0 else [1, 1, 2, 4]},
                                          {"step": 2, "forwards": 1, "counts": [2, 2, 2, 2]}]}]} for r in (0, 1)]}
    d.update(over)
    return d


def test_routing_tables_tokens_per_expert_owner_and_steps():
    counts = decode(_doc())
    experts, fwd, basis = routing_tables(counts, [2])
    assert basis == "profiled step(s) 2"
    assert experts[experts["rank"] == 0]["tokens"].tolist() == [2, 2, 2, 2]
    assert experts[experts["rank"] == 0]["owner"].tolist() == [0, 0, 1, 1]  # 2 experts per EP rank
    experts, fwd, basis = routing_tables(counts, [1, 2, 7])  # step 7 was not kept: the mean of 1 and 2
    assert basis == "profiled step(s) 1, 2"
    assert experts[experts["rank"] == 1]["tokens"].tolist() == [1.5, 1.5, 2, 3]
    assert fwd["forwards"].tolist() == [1.0, 1.0]
    experts, _, basis = routing_tables(counts, [9])  # no window step kept: the run's totals per step
    assert basis == "all 3 steps of the run (mean)"
    assert experts["tokens"].tolist() == [2.0] * 8


def _placed_doc(totals, placement=None, group=(0, 1)):
    """A routing doc whose ranks' totals are ``totals`` [rank][layer 1's experts], optionally with a placement."""
    E = len(totals[0])
    d = _doc(n_routed_experts=E, steps=1, profiled_steps=[],
             ranks=[{"rank": r, "ep_rank": r, "ep_group": list(group), "pp_rank": 0,
                     "layers": [{"layer": 1, "total": t, "total_forwards": 1, "steps": []}]} for r, t in enumerate(totals)])
    if placement is not None:
        d["placement"] = {"mode": "balanced", "layers": [{"layer": 1, "ranks": placement}]}
    return d


def test_a_recorded_placement_decides_the_owners():
    """ep_placement=balanced runs: routing.json counts logical experts and says where each one lived."""
    counts = decode(_placed_doc([[9, 1, 1, 9], [9, 1, 1, 9]], placement=[[0, 1], [2, 3]]))
    assert counts.placement == {1: (0, 0, 1, 1)}
    counts = decode(_placed_doc([[9, 1, 1, 9], [9, 1, 1, 9]], placement=[[1, 3], [0, 2]]))
    assert [counts.owner(0, e, layer=1) for e in range(4)] == [1, 0, 1, 0]
    experts, _, _ = routing_tables(counts, None)
    assert experts[experts["rank"] == 0]["owner"].tolist() == [1, 0, 1, 0]
    assert [counts.owner(0, e) for e in range(4)] == [0, 0, 1, 1]  # no layer: the contiguous rule
    for bad in ([[0, 1], [1, 3]], [[0, 1, 2], [3]], [[0], [1], [2], [3]]):
        with pytest.raises(RoutingError, match=r"placement.layers\[0\].ranks: not the 4 experts split evenly"):
            decode(_placed_doc([[1, 1, 1, 1]] * 2, placement=bad))


def test_placement_preview_predicts_the_balanced_rank_imbalance():
    """Loads 30, 20, 5, 5 (both ranks' totals summed) over two EP ranks: contiguous {0, 1} / {2, 3} carry 50
    and 10, max / mean 50 / 30; balanced {0, 2} / {1, 3} (or {0, 3} / {1, 2}) carry 35 and 25: 35 / 30."""
    counts = decode(_placed_doc([[15, 10, 2, 3], [15, 10, 3, 2]]))
    pv = placement_preview(counts)
    assert pv[["layer", "ep", "placement_now"]].values.tolist() == [[1, 2, "contiguous"]]
    assert pv["imbalance_now"].iloc[0] == pytest.approx(50 / 30, abs=1e-4)
    assert pv["imbalance_balanced"].iloc[0] == pytest.approx(35 / 30, abs=1e-4)
    assert pv["ranks"].iloc[0] == [[0, 2], [1, 3]] or pv["ranks"].iloc[0] == [[0, 3], [1, 2]]
    # at the run's own balanced placement, "now" is that placement's
    counts = decode(_placed_doc([[15, 10, 2, 3], [15, 10, 3, 2]], placement=[[0, 3], [1, 2]]))
    pv = placement_preview(counts)
    assert pv["placement_now"].iloc[0] == "balanced" and pv["imbalance_now"].iloc[0] == pytest.approx(35 / 30, abs=1e-4)
    # another EP size: 4 ranks of one expert each; and nothing to place at 3 (4 experts) or 1
    pv = placement_preview(counts, 4)
    assert pv["imbalance_now"].iloc[0] == pv["imbalance_balanced"].iloc[0] == pytest.approx(30 / 15, abs=1e-4)
    assert placement_preview(counts, 3).empty and placement_preview(counts, 1).empty


def test_the_verb_predicts_the_placement_from_the_runs_routing_file(r_l3, tmp_path):
    """The committed 4-GPU run: the predicted imbalance of its contiguous placement, from routing.json read
    with json.load and summed here, and the verb's --placement-ep."""
    doc = json.loads((R_L3 / "routing.json").read_text())
    loads = [sum(r["layers"][0]["total"][e] for r in doc["ranks"]) for e in range(64)]
    per = [sum(loads[p * 16:(p + 1) * 16]) for p in range(4)]
    rep = r_l3.moe()
    assert rep.placement["imbalance_now"].iloc[0] == pytest.approx(max(per) / (sum(per) / 4), abs=1e-4)
    assert 1.0 <= rep.placement["imbalance_balanced"].iloc[0] < rep.placement["imbalance_now"].iloc[0]
    r = CliRunner().invoke(main, ["moe", str(R_L3), "--no-cache", "--placement-ep", "8", "--json", str(tmp_path / "m.json")])
    assert r.exit_code == 0, r.output
    assert "expert placement at ep=8" in r.output
    assert f"--set ep_placement=balanced --set ep_placement_loads={R_L3 / 'routing.json'}" in r.output
    placed = json.loads((tmp_path / "m.json").read_text())["placement"]
    assert len(placed) == 1 and len(placed[0]["ranks"]) == 8 and placed[0]["ep"] == 8
    r = CliRunner().invoke(main, ["moe", str(R_L3), "--no-cache", "--placement-ep", "3"])
    assert r.exit_code == 2
    assert r.output.strip() == (f"tracelens: error: {R_L3 / 'routing.json'}: --placement-ep 3: its 64 experts do not "
                                "split evenly over that many ranks")


def test_decode_names_the_bad_field_and_another_run_is_refused():
    with pytest.raises(RoutingError, match=r"ranks\[1\]\.layers\[0\]\.steps\[0\]\.counts: 3 counts, expected n_routed_experts = 4"):
        d = _doc()
        d["ranks"][1]["layers"][0]["steps"][0]["counts"] = [1, 2, 3]
        decode(d)
    with pytest.raises(RoutingError, match=r"ranks\[0\]\.layers\[0\]\.total\[2\]: '-1' is not an integer >= 0"):
        d = _doc()
        d["ranks"][0]["layers"][0]["total"][2] = -1
        decode(d)
    with pytest.raises(RoutingError, match="not a routing-counts file"):
        decode(_doc(format="something"))
    counts = decode(_doc())
    check_run(counts, {"run_id": "abc"})
    check_run(counts, {"created_utc": "t0"})  # a manifest from before run_id: compared by its start time
    with pytest.raises(RoutingError, match=r"^from another run \(run_id abc, the manifest's is xyz\)"):
        check_run(counts, {"run_id": "xyz", "created_utc": "t0"})


def test_straggler_tie_says_whether_routing_explains_the_late_rank():
    layers = pd.DataFrame({"layer": [1, 1, 1], "rank": [0, 1, 2], "received_rows": [100.0, 130.0, 100.0],
                           "expert_gemm_us": [10.0, 14.0, 9.0]})
    tie = straggler_tie(layers, 1)
    assert tie["tied"] and tie["most_received_rank"] == 1 and tie["received_excess"] == pytest.approx(130 / 110 - 1, abs=1e-4)
    assert tie["text"].startswith("rank 1 is the late rank (late_rank finding): it receives the most routed rows (130 per step")
    tie = straggler_tie(layers, 0)
    assert not tie["tied"] and "routing does not explain it" in tie["text"] and "rank 1 the longest" in tie["text"]
    assert straggler_tie(layers.assign(received_rows=float("nan")), 1)["most_expert_gemm_rank"] == 1
    assert straggler_tie(layers, 7) is None


# ------------------------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def l3():
    return tracelens.analyze(tracelens.load(L3))


def test_level3_padding_share_of_rows_and_bytes_from_the_raw_trace(l3):
    m = _manifest(L3)
    cfg = m["config"]
    routed = cfg["micro_batch_size"] * cfg["seq_len"] * cfg["top_k"]
    rows, sent = [], 0
    for r in range(4):
        ev = _events(L3, r)
        lo, hi = _step_window(ev, 4)
        rows += _grouped_rows_raw(ev, lo, hi)
        sent += sum(a["In msg nelems"] * 2 for a in _token_a2a_raw(ev, lo, hi))
    share_rows = 1 - routed / (sum(rows) / len(rows))
    assert share_rows == pytest.approx(0.75, abs=0.02)
    rep = l3.moe()
    assert rep.source == "trace + manifest" and rep.steps == 1
    assert rep.totals["padding_share_rows"] == pytest.approx(share_rows, abs=1e-4)
    assert rep.totals["rows_computed"] == sum(rows)
    assert rep.totals["a2a_sent_bytes"] == sent
    # every token all-to-all carries tokens x top_k routed rows on average over the ranks (bf16, d_model)
    n_calls = sum(len(_token_a2a_raw(ev, *_step_window(ev, 4))) for ev in (_events(L3, r) for r in range(4)))
    routed_b = n_calls * routed * cfg["d_model"] * 2
    assert rep.totals["a2a_padding_share_bytes"] == pytest.approx(1 - routed_b / sent, abs=1e-4)
    assert rep.totals["a2a_padding_share_bytes"] == pytest.approx(0.75, abs=0.02)
    # the missing routing counts: said in one line naming the file
    assert "\n" not in rep.missing and rep.missing.startswith(f"no routing file ({L3}/routing.json)")
    assert l3.summary()["moe"]["padding_share_rows"] == rep.totals["padding_share_rows"]


def test_level3_bytes_per_rank_pair_from_the_raw_trace(l3):
    want: dict[tuple[int, int], float] = {}
    for r in range(4):
        ev = _events(L3, r)
        for a in _token_a2a_raw(ev, *_step_window(ev, 4)):
            peers = json.loads(a["Process Group Ranks"])
            split = json.loads(a["In split size"])
            rows = split if split else [a["Input Dims"][0][0] // len(peers)] * len(peers)
            for p, n in zip(peers, rows):
                want[(r, p)] = want.get((r, p), 0) + n * a["Input Dims"][0][1] * 2
    got = _pairs(l3.moe())
    assert set(got) == set(want) and len(want) == 16
    for k, v in want.items():
        assert got[k][0] == pytest.approx(v, rel=1e-9), k
    assert l3.moe().totals["pair_skew_sent"] == 1.0  # the worst-case buffer: every pair the same


@pytest.fixture(scope="module")
def r_l3():
    return tracelens.analyze(tracelens.load(R_L3))


def test_with_routing_counts_rows_received_and_padding_per_rank(r_l3):
    doc = json.loads((R_L3 / "routing.json").read_text())
    assert doc["run"]["run_id"] == _manifest(R_L3)["run_id"]
    E, group = doc["n_routed_experts"], doc["ranks"][0]["ep_group"]
    per = E // len(group)
    received = {r: 0 for r in group}
    for rec in doc["ranks"]:
        counts = rec["layers"][0]["steps"][0]["counts"]
        for e, c in enumerate(counts):
            received[group[e // per]] += c
    rep = r_l3.moe()
    assert rep.source == "routing file + trace" and rep.missing is None and rep.routing_basis == "profiled step(s) 4"
    t = rep.layers.set_index("rank")
    for r in group:
        ev = _events(R_L3, r)
        rows = _grouped_rows_raw(ev, *_step_window(ev, 4))
        assert t.at[r, "received_rows"] == received[r]
        assert t.at[r, "rows_per_call"] == sum(rows) / len(rows) == 24576
        assert t.at[r, "padding_share"] == pytest.approx(1 - received[r] / 24576, abs=1e-9)
    assert sum(received.values()) == 4 * 1024 * 6
    assert rep.totals["padding_share_rows"] == pytest.approx(0.75, abs=0.02)
    # tokens per expert, summed over the ranks, and the load imbalance of the layer
    loads = [sum(rec["layers"][0]["steps"][0]["counts"][e] for rec in doc["ranks"]) for e in range(E)]
    tpe = rep.tokens_per_expert()
    assert tpe.loc[1].tolist() == loads
    ls = rep.layer_summary.iloc[0]
    assert ls["expert_imbalance"] == pytest.approx(max(loads) / (sum(loads) / E), abs=1e-4)
    assert ls["hottest_expert"] == loads.index(max(loads))
    assert ls["rank_imbalance"] == pytest.approx(max(received.values()) / (sum(received.values()) / 4), abs=1e-4)


def test_with_routing_counts_routed_bytes_per_pair_and_the_late_rank(r_l3):
    doc = json.loads((R_L3 / "routing.json").read_text())
    group, per = doc["ranks"][0]["ep_group"], doc["n_routed_experts"] // 4
    routed = {(s["rank"], d): sum(s["layers"][0]["steps"][0]["counts"][i * per:(i + 1) * per])
              for s in doc["ranks"] for i, d in enumerate(group)}
    rep = r_l3.moe()
    got = _pairs(rep)
    for (s, d), (sent, routed_b) in got.items():
        ev = _events(R_L3, s)
        calls = len(_token_a2a_raw(ev, *_step_window(ev, 4)))  # dispatch + combine, forward + backward: 4
        assert calls == 4
        assert routed_b == pytest.approx(calls * (routed[(s, d)] + routed[(d, s)]) / 2 * 2048 * 2, rel=1e-9)
        assert sent == calls * 6144 * 2048 * 2  # the worst-case buffer's share for each peer
    # the straggler, tied to the routing: the late rank of the late_rank finding, its rows against the others'
    late = next(f for f in r_l3.findings() if f["type"] == "late_rank")
    tie = late["evidence"]["moe_routing"]
    rows = {r: sum(routed[(s, r)] for s in group) for r in group}
    assert tie["late_rank"] == late["evidence"]["late_rank"] == rep.straggler["late_rank"]
    assert tie["received_rows"] == rows[tie["late_rank"]] and tie["most_received_rank"] == max(rows, key=rows.get)
    assert tie["text"].split(": ", 1)[1] in late["title"]


def test_level0_split_sizes_are_the_routing_counts_and_routed_equals_sent():
    doc = json.loads((R_L0 / "routing.json").read_text())
    per = doc["n_routed_experts"] // 4
    for rec in doc["ranks"]:
        counts = rec["layers"][0]["steps"][0]["counts"]
        want = [sum(counts[i * per:(i + 1) * per]) for i in range(4)]
        ev = _events(R_L0, rec["rank"])
        splits = [json.loads(a["In split size"]) for a in _token_a2a_raw(ev, *_step_window(ev, 4))]
        assert want in splits, (rec["rank"], want, splits)  # the dispatch (and the combine's backward)
    rep = tracelens.analyze(tracelens.load(R_L0)).moe()
    assert rep.pairs["split_source"].eq("split sizes").all()
    for k, (sent, routed) in _pairs(rep).items():
        assert routed == pytest.approx(sent, rel=1e-12), k  # level 0 sends exactly the routed rows
    assert rep.totals["a2a_padding_share_bytes"] == 0.0


# -------------------------------------------------------------------------------------------------- bad input


def _copy(tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(R_L3, run)
    return run


def _cli_one_line(*args) -> tuple[int, str]:
    r = CliRunner().invoke(main, [str(a) for a in args])
    return r.exit_code, r.stderr


@pytest.mark.parametrize("verb", ["moe", "analyze"])
def test_a_truncated_routing_file_is_one_line_exit_2(tmp_path, verb):
    run = _copy(tmp_path)
    data = (run / "routing.json").read_bytes()
    (run / "routing.json").write_bytes(data[: len(data) // 2])
    args = [verb, run, "--no-cache"] + (["-o", tmp_path / "out"] if verb == "analyze" else [])
    code, err = _cli_one_line(*args)
    assert code == 2
    assert err.startswith(f"tracelens: error: {run / 'routing.json'}: not a complete JSON document (truncated?)")
    assert len(err.strip().splitlines()) == 1, err


def test_a_routing_file_from_another_run_is_one_line_exit_2(tmp_path):
    run = _copy(tmp_path)
    doc = json.loads((run / "routing.json").read_text())
    doc["run"]["run_id"] = "0" * 32
    (run / "routing.json").write_text(json.dumps(doc))
    code, err = _cli_one_line("moe", run, "--no-cache")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"tracelens: error: {run / 'routing.json'}: from another run (run_id {'0' * 32}, "
                          f"the manifest's is {_manifest(run)['run_id']})")
    with pytest.raises(TraceError, match="from another run"):
        tracelens.load(run, cache=False).run.routing()


def test_a_malformed_count_list_names_its_field(tmp_path):
    run = _copy(tmp_path)
    doc = json.loads((run / "routing.json").read_text())
    doc["ranks"][2]["layers"][0]["steps"][0]["counts"].pop()
    (run / "routing.json").write_text(json.dumps(doc))
    code, err = _cli_one_line("moe", run, "--no-cache")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert err.strip() == (f"tracelens: error: {run / 'routing.json'}: ranks[2].layers[0].steps[0].counts: "
                           "63 counts, expected n_routed_experts = 64")


# -------------------------------------------------------------------------------------------- CLI and summary


def test_the_verb_prints_the_view_and_writes_its_json(r_l3, tmp_path):
    rep = r_l3.moe()
    r = CliRunner().invoke(main, ["moe", str(R_L3), "--no-cache", "--json", str(tmp_path / "m.json")])
    assert r.exit_code == 0 and r.stdout == rep.to_text() + f"\nwrote {tmp_path / 'm.json'}\n"
    d = json.loads((tmp_path / "m.json").read_text())
    assert d == json.loads(json.dumps(d, allow_nan=False))
    assert len(d["experts"]) == 4 * 64 and len(d["pairs"]) == 16 and d["schema_version"] == 1
    assert d["tokens_per_expert"]["1"] == rep.tokens_per_expert().loc[1].tolist()
    s = r_l3.summary()["moe"]
    assert s["ranks"] == d["ranks"] and s["straggler"] == d["straggler"]


def test_no_moe_work_no_moe_block():
    a = tracelens.analyze(tracelens.load(FIXTURES / "cpu_tiny" / "rank0.json.gz"))
    assert a.summary()["moe"] is None
    assert a.moe().to_text() == "no MoE work in these traces (no expert GEMMs, no token all-to-all)"


# ----------------------------------------------------------------------------------------- foreign traces


def test_a_foreign_moe_trace_keeps_what_it_has_and_says_what_is_missing_in_one_line():
    path = EXTERNAL / "tracelens" / "b200_eager.json.gz"  # vLLM GPT-OSS on a B200: FusedMoE_<i> modules
    with gzip.open(path, "rt") as f:
        ev = json.load(f)["traceEvents"]
    n_moe_calls = sum(1 for e in ev if e.get("name") == "vllm::moe_forward" and e.get("cat") == "cpu_op")
    r = CliRunner().invoke(main, ["moe", str(path), "--no-cache"])
    assert r.exit_code == 0
    notes = [x for x in r.stdout.splitlines() if x.startswith("note: ")]
    assert len(notes) == 1
    assert notes[0].startswith("note: no routing file and no run manifest: tokens per expert")
    assert "shown from the trace: MoE-op kernel time per layer and rank" in notes[0]
    rep = tracelens.analyze(tracelens.load(path)).moe()
    assert rep.source == "trace" and rep.totals.get("padding_share_rows") is None
    assert len(rep.layers) == rep.layers["layer"].nunique() and (rep.layers["layer"] >= 0).all()
    assert n_moe_calls % len(rep.layers) == 0 and (rep.layers["expert_gemm_us"] > 0).all()


def test_a_foreign_trace_with_all_to_all_but_no_peer_list():
    path = EXTERNAL / "hta" / "trace_diff" / "control.json.gz"  # one rank of an 8-rank job, older torch
    rep = tracelens.analyze(tracelens.load(path)).moe()
    assert rep.pairs["dst"].tolist() == [-1] and rep.pairs["split_source"].tolist() == ["no peer list"]
    assert "all-to-all bytes per rank (no peer list)" in rep.missing and "\n" not in rep.missing
    assert rep.pair_matrix().empty  # nothing to draw per pair


def test_capacity_overlap_run_counts_chunks_and_drops():
    """tests/fixtures/h100_4gpu/ep4_cap_ovl (issue 33's trainer, capacity 1.25, 2 overlap chunks, no routing file):
    each grouped GEMM and token all-to-all carries one chunk's buffer of 4 * ceil(1.25 * 16,384 * 6 / 4) rows;
    the routed rows per call are a chunk's tokens x top_k less the manifest's dropped share, so bytes and rows
    have the same padding share, routed never above sent, and no GEMM time is put on the padding."""
    import json as _json
    from pathlib import Path as _P

    run = _P(__file__).resolve().parents[1] / "fixtures" / "h100_4gpu" / "ep4_cap_ovl"
    man = _json.loads((run / "manifest.json").read_text())
    want = 1 - 16_384 * 6 * (1 - man["ep_dispatch"]["dropped_share"]) / 122_880
    rep = tracelens.analyze(tracelens.load(run, progress=False)).moe()
    t = rep.to_dict()
    t = t.get("summary", t)
    assert t["gemm_computes_padding"] is False and t["chunks_per_microbatch"] == 2
    assert t["padding_share_rows"] == pytest.approx(want, abs=1e-3)
    assert t["a2a_padding_share_bytes"] == pytest.approx(want, abs=1e-3)
    assert t["a2a_routed_bytes"] < t["a2a_sent_bytes"]
    assert (rep.layers["padded_gemm_us"] == 0).all()
    assert "the GEMMs stop at the routed rows" in rep.to_text()
