"""The scale-out projection (`tracelens scaleout`), its network model, the planner (`tracelens plan`) and the
validation against measured points.

The network model is checked against hand-computed alpha-beta figures; the projection against the committed run dirs
(at the run's own GPU count it is the what-if's calibrated prediction, i.e. the measurement) and against invariants
no mechanism may break (a faster network never slows a step, an all-to-all that crosses nodes costs more, the
components add up to the step); bad input is one line, exit 2.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from tracelens.analysis import memory as M
from tracelens.projection import network as N
from tracelens.projection import planner as PL
from tracelens.projection import scaleout as SO
from tracelens.projection.whatif import NEUTRAL

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures"
CAP_OVL = FIX / "h100_4gpu" / "ep4_cap_ovl"
PP4 = FIX / "h100_4gpu" / "pp4_1f1b"
ONE_GPU = FIX / "h100_proxy_loop_mbs8"


# ------------------------------------------------------------------------------------------ the network model
def _net(**kw) -> N.Network:
    return N.network(intra_node_busbw_gb_s=100.0, **kw)  # 100 GB/s inside a node = 100 bytes per ns


def test_groups_fill_nodes_with_consecutive_ranks():
    net = _net(gpus_per_node=8)
    assert net.span(4) == (4, 1)
    assert net.span(16) == (8, 2)
    assert net.span(16, stride=4) == (2, 8)  # experts' DP group, ep 4 apart: 2 members per node
    assert net.span(8, stride=16) == (1, 8)


def test_ring_collectives_against_hand_computed_alpha_beta():
    net = _net(gpus_per_node=8, inter_node_gbps=400, inter_node_efficiency=0.9, inter_node_latency_us=5)
    B = 400 * 0.9 / 8  # NIC bytes per ns
    assert net.inter_bytes_per_ns == pytest.approx(B)
    # inside a node: S (n-1)/n at the bus bandwidth, no latency term (the measured bandwidth holds it)
    assert net.collective("all_gather", 1e9, 4) == pytest.approx(1e9 * 3 / 4 / 100)
    assert net.collective("all_reduce", 1e9, 4) == pytest.approx(2 * 1e9 * 3 / 4 / 100)
    # 16 ranks on 2 nodes: the whole buffer over the 8 ranks of a node, then S/8 over the 2 nodes on each NIC
    S = 8e9
    want = S * 7 / 8 / 100 + (1 * 5e3 + 1 / 2 * (S / 8) / B)
    assert net.collective("reduce_scatter", S, 16) == pytest.approx(want)
    # all-reduce across 2 nodes: reduce-scatter + all-gather inside, the ring beats the tree on bandwidth
    ring = 2 * (1 * 5e3 + 1 / 2 * (S / 8) / B)
    tree = 2 * 1 * 5e3 + 2 * (S / 8) / B
    assert ring < tree
    assert net.collective("all_reduce", S, 16) == pytest.approx(2 * S * 7 / 8 / 100 + ring)


def test_all_reduce_takes_the_tree_where_latency_dominates():
    net = _net(gpus_per_node=8)
    n, S = 1024, 8 * 1024.0  # 128 nodes, 8 KiB
    k, per = 128, S / 8
    ring = 2 * ((k - 1) * 5e3 + (k - 1) / k * per / net.inter_bytes_per_ns)
    tree = 2 * math.ceil(math.log2(k)) * 5e3 + 2 * per / net.inter_bytes_per_ns
    assert tree < ring
    inside = 2 * S * 7 / 8 / 100
    assert net.collective("all_reduce", S, n) == pytest.approx(inside + tree)


def test_all_to_all_pays_the_nic_for_its_off_node_share():
    net = _net(gpus_per_node=8)
    S = 16e6
    # one node: (n-1)/n of the buffer at the bus bandwidth
    assert net.all_to_all(S, 8) == pytest.approx(S * 7 / 8 / 100)
    # 16 ranks on 2 nodes: 7/16 of the buffer on NVLink, 8/16 on the NIC, at once, + one latency
    on = S * 8 / 16 * 7 / 8 / 100
    off = S * 8 / 16 / net.inter_bytes_per_ns
    assert off > on
    assert net.all_to_all(S, 16) == pytest.approx(off + 5e3)
    assert net.p2p(S, True) == pytest.approx(5e3 + S / net.inter_bytes_per_ns)
    assert net.p2p(S, False) == pytest.approx(S / 100)


@pytest.mark.parametrize("n", [2, 8, 16, 64, 1024])
@pytest.mark.parametrize("nbytes", [1e3, 1e6, 1e9])
def test_a_faster_or_closer_network_is_never_slower(n, nbytes):
    slow, fast = _net(inter_node_gbps=200), _net(inter_node_gbps=400)
    low = _net(inter_node_latency_us=1)
    for f in ("all_gather", "reduce_scatter", "all_reduce"):
        assert fast.collective(f, nbytes, n) <= slow.collective(f, nbytes, n)
        assert low.collective(f, nbytes, n) <= fast.collective(f, nbytes, n)
        assert fast.collective(f, 2 * nbytes, n) >= fast.collective(f, nbytes, n)
    assert fast.all_to_all(nbytes, n) <= slow.all_to_all(nbytes, n)
    # the same group spread over more nodes costs at least as much
    assert _net(gpus_per_node=4).all_to_all(nbytes, n) >= _net(gpus_per_node=8).all_to_all(nbytes, n)


def test_network_file_and_flags(tmp_path):
    f = tmp_path / "net.yaml"
    f.write_text("gpus_per_node: 4\ninter_node_gbps: 200\ninter_node_latency_us: 2.5\n")
    net = N.network(path=f, inter_node_gbps=800)
    assert (net.gpus_per_node, net.inter_node_gbps, net.inter_node_latency_us) == (4, 800.0, 2.5)
    assert net.sources == {"gpus_per_node": str(f), "inter_node_gbps": "--inter-node-gbps",
                           "inter_node_latency_us": str(f)}
    text = "\n".join(net.describe())
    assert "0.9 efficiency (assumed)" in text and f"4 ({f})" in text
    j = tmp_path / "net.json"
    j.write_text(json.dumps({"inter_node_efficiency": 0.75}))
    assert N.network(path=j).inter_node_efficiency == 0.75


@pytest.mark.parametrize("text, needle", [
    ("gpus_per_node: 0\n", "gpus_per_node: must be > 0"),
    ("gpus_per_node: 2.5\n", "gpus_per_node: expected a whole number"),
    ("inter_node_gbps: fast\n", "inter_node_gbps: expected a number"),
    ("inter_node_efficiency: 1.5\n", "inter_node_efficiency: must be at most 1"),
    ("nic_gbps: 400\n", "unknown field 'nic_gbps'"),
    ("- 1\n- 2\n", "expected a mapping"),
    ("a: [1\n", "not valid YAML"),
])
def test_a_bad_network_file_is_one_line_naming_the_file(tmp_path, text, needle):
    f = tmp_path / "net.yaml"
    f.write_text(text)
    with pytest.raises(N.NetworkError) as e:
        N.network(path=f)
    assert str(f) in str(e.value) and needle in str(e.value) and "\n" not in str(e.value)


def test_a_bad_network_flag_names_the_flag():
    with pytest.raises(N.NetworkError, match="--inter-node-latency-us: inter_node_latency_us: must be > 0"):
        N.network(inter_node_latency_us=-1.0)
    # the flag as the command line spells it (was '--intra-node-busbw-gb-s', a flag no command has)
    with pytest.raises(N.NetworkError, match="^--intra-node-busbw: intra_node_busbw_gb_s: must be > 0"):
        N.network(intra_node_busbw_gb_s=0.0)
    assert N.network(intra_node_busbw_gb_s=100.0).sources == {"intra_node_busbw_gb_s": "--intra-node-busbw"}


@pytest.mark.parametrize("verb", ["scaleout", "plan"])
def test_a_network_file_that_is_not_text_is_one_line_exit_2(tmp_path, verb):
    """A binary --network file was an internal error (UnicodeDecodeError, exit 3) naming no file."""
    net = tmp_path / "net.yaml"
    net.write_bytes(b"\xd8\x00\xff binary")
    args = (["scaleout", str(CAP_OVL), "--gpus", "8"] if verb == "scaleout" else
            ["plan", "gpu_proxy_train", "--gpus", "8", "--global-batch", "64", "--from", str(CAP_OVL), "--mbs", "16"])
    r = _cli(*args, "--network", str(net))
    assert r.exit_code == 2, r.output
    assert r.stderr == (f"tracelens: error: {net}: not a UTF-8 text file (byte 0): a YAML or JSON network "
                        "description was expected\n")
    assert "Traceback" not in r.stderr


# ------------------------------------------------------------------------------------------ the projection
@pytest.fixture(scope="module")
def cap():
    return SO.ScaleOut.from_run(CAP_OVL)


@pytest.fixture(scope="module")
def cap_fast_net(cap):
    """The same run and model, its inter-node links twice as fast."""
    from dataclasses import replace

    return SO.ScaleOut(cap.model, replace(cap.net, inter_node_gbps=2 * cap.net.inter_node_gbps), cap.routing,
                       cap.routing_note)


@pytest.fixture(scope="module")
def pp4():
    return SO.ScaleOut.from_run(PP4)


def _measured_tps(run: Path) -> float:
    return json.loads((run / "manifest.json").read_text())["metrics"]["tokens_per_s_per_gpu"]


def test_the_run_projected_to_its_own_gpus_is_its_measurement(cap, pp4):
    p = cap.project(4)
    assert p.tokens_per_s_per_gpu == pytest.approx(_measured_tps(CAP_OVL), rel=1e-3)
    assert p.validated and p.status == "projection" and p.nodes == 1
    assert sum(p.components.values()) == pytest.approx(p.step_s)
    # the pipelined run: its steady steps' window replayed with the calibrated hand-off, to its measured mean
    q = pp4.project(4)
    assert q.tokens_per_s_per_gpu == pytest.approx(_measured_tps(PP4), rel=0.01)
    assert 0 < q.bubble < 0.5 and q.layout["pp"] == 4


@pytest.fixture(scope="module")
def one():
    return SO.ScaleOut.from_run(ONE_GPU)


def test_one_gpu_run_projected_to_its_own_gpu(one):
    so = one
    assert so.project(1).tokens_per_s_per_gpu == pytest.approx(_measured_tps(ONE_GPU), rel=1e-3)
    assert "assumed" in so.net.describe()[1]  # nothing measured inside a node
    p = so.project(16)
    assert not p.validated and p.nodes == 2 and p.layout["dp"] == 16
    assert any("unvalidated" in n for n in p.notes)


def test_a_layout_on_the_runs_gpus_is_the_whatif_prediction(cap):
    """ep 1 on the run's 4 GPUs: the anchor is that what-if; the projection reproduces it (same tokens, same step)."""
    want = cap.model.predict({"ep": 1, "ep_dispatch": "nccl", "ep_overlap": False, "ep_capacity_factor": 1.25})
    p = cap.project(4, {"ep": 1})
    assert p.anchor["ep"] == 1
    assert p.tokens_per_s_per_gpu == pytest.approx(want.tokens_per_s_per_gpu, rel=1e-3)


@pytest.mark.parametrize("gpus, ep", [(16, 4), (16, 16), (64, 8), (1024, 16)])
def test_doubling_the_inter_node_bandwidth_never_slows_a_projection(cap, cap_fast_net, gpus, ep):
    slow, fast = cap.project(gpus, {"ep": ep}), cap_fast_net.project(gpus, {"ep": ep})
    assert fast.tokens_per_s_per_gpu >= slow.tokens_per_s_per_gpu * (1 - 1e-9)
    assert fast.a2a_s <= slow.a2a_s and fast.dp_comm_s <= slow.dp_comm_s


def test_an_all_to_all_across_nodes_costs_more_than_inside_one(cap):
    inside, across = cap.project(16, {"ep": 8}), cap.project(16, {"ep": 16})
    assert across.nodes == inside.nodes == 2
    assert across.components["all-to-all (exposed)"] > inside.components["all-to-all (exposed)"]
    # the off-node half of each buffer on a 45 GB/s NIC against the measured ~227 GB/s all-to-all inside a node
    assert across.a2a_s > 2 * inside.a2a_s


def test_weak_scaling_invariants(cap):
    rows = cap.scaling([4, 8, 16, 64, 1024])
    assert all(isinstance(r, SO.Projection) for r in rows)
    dp_comm = [r.dp_comm_s for r in rows]
    assert dp_comm == sorted(dp_comm)  # more ranks in the data-parallel groups: never less traffic time
    assert [r.peak_bytes for r in rows] == sorted((r.peak_bytes for r in rows), reverse=True)  # FSDP shards more
    for r in rows:
        assert r.layout["ep"] == 4 and r.layout["dp"] == r.gpus // 4
        assert sum(r.components.values()) == pytest.approx(r.step_s)
        assert r.tokens_per_s_per_gpu == pytest.approx(
            r.layout["microbatches"] * r.layout["micro_batch_size"] * 2048 / r.step_s)
    assert [r.validated for r in rows] == [True, False, False, False, False]


def test_expert_rows_and_all_to_all_bytes_follow_the_dispatch_path(cap):
    """Capacity: at most ceil(f T_c k / ep) rows per peer and chunk; nccl: the routed rows computed (this trainer's
    grouped GEMMs stop at the routed rows), the worst-case buffer ep T min(k, E/ep) sent at level 3."""
    T = 16 * 2048
    cfg, _, _ = cap.target(16, {"ep": 8})
    per_peer = math.ceil(1.25 * (T / 2) * 6 / 8)
    uniform = T * 6 / 8 / 2  # no routing.json: T k / ep from each peer and chunk
    assert cap.busiest_rows(cfg, T) == pytest.approx(8 * 2 * min(per_peer, uniform))
    worst, _, _ = cap.target(16, {"ep": 8, "ep_dispatch": "nccl", "ep_overlap": False})
    assert worst["sync_free_level"] == 3
    assert cap.busiest_rows(worst, T) == pytest.approx(T * 6)
    f_cap, _ = cap.a2a_layer_ns(cfg, T)
    f_worst, _ = cap.a2a_layer_ns(worst, T)
    # the same EP group inside one node: time in proportion to the bytes (the measured bandwidth's nearest size aside)
    rows_cap, rows_worst = 8 * per_peer * 2, 8 * T * min(6, 64 // 8)
    assert f_worst / f_cap == pytest.approx(rows_worst / rows_cap, rel=0.35)
    assert f_worst > 3 * f_cap


def test_bubble_per_schedule_against_the_theory(pp4):
    from tracelens.analysis.bubble import bubble_ratio

    rows = [r for r in pp4.bubbles(8, pps=[2, 4], microbatches=8) if isinstance(r, SO.Projection)]
    scheds = {(r.layout["pp"], r.layout["schedule"]) for r in rows}
    assert {(2, "1f1b"), (4, "1f1b"), (2, "zb1p")} <= scheds
    for r in rows:
        lay = r.layout
        theory = bubble_ratio(lay["schedule"], lay["pp"], lay["microbatches"], lay["vpp"])
        assert r.components["pipeline bubble"] >= 0 and 0 <= r.bubble < 1
        if lay["schedule"] == "1f1b":  # uneven stages and hand-offs only add to the textbook bubble of the window
            window = r.components["pipeline bubble"] + r.components["compute"] + r.components["expert stage"]
            assert r.components["pipeline bubble"] / window >= theory * 0.5
    one = {r.layout["pp"]: r for r in rows if r.layout["schedule"] == "1f1b"}
    zb = {r.layout["pp"]: r for r in rows if r.layout["schedule"] == "zb1p"}
    assert zb[2].components["pipeline bubble"] < one[2].components["pipeline bubble"]


def test_bad_layouts_are_one_line(cap):
    with pytest.raises(SO.ScaleOutError, match=r"--gpus 6: .*world size 6"):
        cap.project(6)
    with pytest.raises(SO.ScaleOutError, match="n_routed_experts=64 is not divisible by ep=3"):
        cap.project(12, {"ep": 3})
    with pytest.raises(SO.ScaleOutError, match="unknown trainer key 'epp'"):
        cap.project(8, {"epp": 2})


# ------------------------------------------------------------------------------------------ the planner
def test_the_planner_ranks_what_fits_by_projected_throughput(cap):
    mc = M.load_model_config("gpu_proxy_train", ["ep=4", "ep_dispatch=capacity"])
    p = PL.plan(mc, 16, 256, M.device_memory("H100"), cap, mbs=(16,))
    assert p.candidates >= len(p.rows) > 3
    tps = [r["tokens_per_s_per_gpu"] for r in p.rows]
    assert tps == sorted(tps, reverse=True)
    for r in p.rows:
        assert r["projected_from"] == str(CAP_OVL) and r["status"] == "projection, unvalidated"
        assert r["fits"] and r["peak_gib"] < 80 and 0 <= r["bubble"] < 1 and 0 <= r["a2a_share"] < 1
        assert r["mbs"] * r["microbatches"] * (r["dp"] * r["ep"]) == 256  # the global batch
    best = p.rows[0]
    own = cap.project(16, {"ep": best["ep"], "pp": best["pp"], "vpp": best["vpp"], "microbatches": best["microbatches"],
                           "micro_batch_size": 16, "pipeline_schedule": best["schedule"], "recompute_layer_ids": []})
    if best["recompute"] == "none":
        assert own.tokens_per_s_per_gpu == pytest.approx(best["tokens_per_s_per_gpu"])
    text = p.to_text()
    assert "projected from" in text and str(CAP_OVL) in text


def test_the_planner_without_a_profile_keeps_the_sweeps_order():
    mc = M.load_model_config("gpu_proxy_train")
    p = PL.plan(mc, 8, 64, M.device_memory("H100"), None, mbs=(8, 16))
    sweep = M.sweep(mc.config, 8, M.device_memory("H100"), 64, base=M.resolve_layout(mc.config, world=8, pp=1, ep=1),
                    space=M.SweepSpace(tp=(1,), cp=(1,), mbs=(8, 16)))
    assert [r["bubble"] for r in p.rows] == list(sweep["bubble"])
    assert "no profile given" in p.to_text()


def test_when_no_layout_fits_the_plan_says_why():
    """A global batch of 3 sequences on 8 GPUs at micro-batch 8 or 16: no dp x mbs divides it; 1 GiB of device
    memory: what divides the batch is over it. The counts cover every layout the sweep enumerated: the same
    number whatever the batch or the memory (a kept layout counts too)."""
    import re

    mc = M.load_model_config("gpu_proxy_train")
    space = dict(mbs=(8, 16))
    odd = PL.plan(mc, 8, 3, M.device_memory("H100"), None, **space)
    small = PL.plan(mc, 8, 64, 1 << 30, None, **space)
    fits = PL.plan(mc, 8, 64, M.device_memory("H100"), None, **space)
    assert odd.rows == [] and small.rows == [] and fits.rows
    m = re.search(r"none of the (\d+) layouts of 8 GPUs fits: (\d+) do not split the global batch of 3 sequences",
                  odd.to_text())
    assert m and m.group(1) == m.group(2), odd.to_text()
    total = int(m.group(1))
    m = re.search(r"none of the (\d+) layouts of 8 GPUs fits: (?:(\d+) do not split [^;]*; )?(?:(\d+) break [^;]*; )?"
                  r"(\d+) are over 0\.9 GiB", small.to_text())
    assert m and int(m.group(1)) == total and int(m.group(4)) > 0, small.to_text()
    assert sum(int(g or 0) for g in m.groups()[1:]) == total
    swept = M.sweep(mc.config, 8, M.device_memory("H100"), 64, base=M.resolve_layout(mc.config, world=8, pp=1, ep=1),
                    space=M.SweepSpace(tp=(1,), cp=(1,), mbs=(8, 16)))
    assert len(swept) + sum(swept.attrs["rejected"].values()) == total
    assert "none of the" not in fits.to_text()


# ------------------------------------------------------------------------------------------ validation
def test_validation_against_measured_points(tmp_path, one):
    """A 1-GPU baseline against points at 1 and 8 GPUs (measured.json's format, a point's 'gpus'): the error is the
    projection's against the number written there."""
    from moespec.config import DEFAULTS, load_config

    base = load_config("gpu_proxy")
    own_set = {k: v for k, v in one.config.items() if k in DEFAULTS and k not in NEUTRAL and base[k] != v}
    own = one.project(1).tokens_per_s_per_gpu
    at8 = one.project(8).tokens_per_s_per_gpu
    doc = {"config": "gpu_proxy", "gpus": 8,
           "baselines": [{"name": "one", "run": str(ONE_GPU), "set": own_set}],
           "points": [{"name": "own", "gpus": 1, "set": own_set, "tokens_per_s_per_gpu": own, "status": "ok"},
                      {"name": "dp8", "set": own_set, "tokens_per_s_per_gpu": at8 * 1.05, "status": "ok"},
                      {"name": "bad", "gpus": 6, "set": {**own_set, "ep": 4}, "tokens_per_s_per_gpu": 1.0,
                       "status": "ok"}]}
    f = tmp_path / "measured.json"
    f.write_text(json.dumps(doc))
    res = SO.validate(f)
    rows = {r["point"]: r for r in res["rows"]}
    assert rows["own"]["own"] and abs(rows["own"]["error"]) < 1e-6
    assert rows["dp8"]["scale_out"] and rows["dp8"]["gpus"] == 8  # the file's default count
    assert rows["dp8"]["error"] == pytest.approx(1 / 1.05 - 1)
    assert "world size 6" in rows["bad"]["refused"]
    s = res["summary"]["one"]
    assert s["n"] == 1 and s["max_abs_error"] == pytest.approx(1 - 1 / 1.05) and s["meets"]
    assert "MEETS" in SO.validation_text(res)


# ------------------------------------------------------------------------------------------ the command line
def _cli(*args):
    """The command in this process (click's runner: exit code, stdout and stderr apart)."""
    from click.testing import CliRunner

    from tracelens.cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


def test_cli_scaleout_prints_the_tables_and_writes_json(tmp_path):
    out = tmp_path / "s.json"
    r = _cli("scaleout", str(CAP_OVL), "--gpus", "4,16,1024", "--ep", "4,16", "--ep-gpus", "16", "--pp", "2",
             "--inter-node-gbps", "200", "--json", str(out))
    assert r.exit_code == 0, r.output
    for title in ("DP scaling", "EP scaling", "Pipeline bubble per schedule at 1024 GPUs", "network model:",
                  "200 Gb/s per GPU (--inter-node-gbps)", "projection, unvalidated", "DP eff"):
        assert title in r.stdout
    doc = json.loads(out.read_text())
    assert [x["gpus"] for x in doc["scaling"]] == [4, 16, 1024]
    assert doc["scaling"][0]["status"] == "projection" and doc["network"]["inter_node_gbps"] == 200


def test_cli_plan(tmp_path):
    r = _cli("plan", "gpu_proxy", "--gpus", "16", "--global-batch", "256", "--from", ONE_GPU, "--mbs", "8",
             "--top", "3", "--json", tmp_path / "p.json")
    assert r.exit_code == 0, r.output
    assert f"ranked by tokens/s/GPU projected from {ONE_GPU}" in r.stdout
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["projected_from"] == str(ONE_GPU) and doc["layouts"][0]["fits"]


@pytest.fixture()
def no_traces(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    shutil.copy(CAP_OVL / "manifest.json", d / "manifest.json")
    return d


@pytest.mark.parametrize("case", ["no_traces", "gpus", "gpus_list", "net_field", "no_device", "validate"])
def test_cli_bad_input_is_one_line_exit_2(tmp_path, no_traces, case):
    net = tmp_path / "net.yaml"
    net.write_text("inter_node_gbps: -3\n")
    args, needle = {
        "no_traces": (["scaleout", str(no_traces), "--gpus", "8"], "no trace files"),
        "gpus": (["scaleout", str(ONE_GPU), "--gpus", "8,6", "--set", "ep=4"], "--gpus 6"),
        "gpus_list": (["scaleout", str(CAP_OVL), "--gpus", "8,x"], "--gpus '8,x'"),
        "net_field": (["scaleout", str(CAP_OVL), "--gpus", "8", "--network", str(net)], f"{net}: inter_node_gbps"),
        "no_device": (["plan", "gpu_proxy_train", "--gpus", "8", "--global-batch", "64"], "--device"),
        "validate": (["scaleout", "--validate", str(tmp_path / "missing.json")], "missing.json: no such file"),
    }[case]
    r = _cli(*args)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.exit_code == 2, r.output
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr


def test_one_and_two_gpus_to_four_against_the_recorded_grid():
    """Issue 35: gpu_proxy_train profiled at 1 GPU and at 2 (dp 2; ep 2 capacity), projected to the held-out 4-GPU
    grid recorded on the same machine and day (tests/fixtures/h100_scaling/measured.json: the points of
    h100_4gpu_layouts/measured.json at 4 GPUs), every memory verdict right (ep4 nccl at micro-batch 24 ran out of
    memory and is projected to). Regression bounds: the measured errors rounded up. Since the EP dispatch path's own
    kernels are added to a run at ep 1 (`ep_path`), the all-to-alls from a run without one take the link's rate and run
    beside the shared expert, and the experts' FSDP copies follow the layout (docs/whatif.md, "Validation"): the points
    that change only the parallel layout at micro-batch 16, max 4.6 / 3.7 / 8.2 %, median 2.1 / 2.7 / 2.8 % from
    1 GPU / dp 2 / ep 2 (before 12.7 / 8.5 / 8.2 % and 8.1 / 3.5 / 2.1 %); all 17 per baseline, median 2.4 / 2.8 /
    3.7 %, max 9.2 / 8.5 / 15.3 % (before 7.7 / 3.2 / 3.7 % and 20.7 / 10.9 / 15.3 %). Since FSDP2's gathers are
    placed per unit in the anchor's replayed step (`fsdp_overlap`) instead of hidden under the whole window: layout
    only max 5.6 / 4.2 / 7.7 %, median 3.0 / 2.7 / 2.3 %; all 17 max 8.7 / 7.6 / 14.3 %, median 3.3 / 3.2 / 3.0 %
    with the hooks' host time a run at dp 1 lacks (`fsdp_overlap.HOOK_HOST_NS`; 4.2 % median from 1 GPU without it)
    (the 14.3 %: ep 2 capacity with the chunked overlap at micro-batch 8, which measured 8 % slower than without
    it): every point from 1 GPU and from dp 2 within issue 35's 10 %. Stop 32 (the gradient clipping sharded by dp,
    the contention rule, FSDP2's casts at dp 1 as parameter work, the chunked loss's units by their count, the
    experts' reduce-scatter after their copy-in): layout only max 2.7 / 3.2 / 5.2 %, median 1.9 / 1.7 / 2.5 %; all
    17 max 6.8 / 5.7 / 6.7 %, median 2.1 / 2.1 / 4.3 %: every point from every baseline within 10 %."""
    res = SO.validate(FIX / "h100_scaling" / "measured.json")
    for name, s in res["summary"].items():
        lo = s["layout_only"]
        assert lo["n"] == 6, name
        assert lo["max_abs_error"] <= 0.055 and lo["median_abs_error"] <= 0.026, (name, lo)
        assert s["n"] == 17 and s["max_abs_error"] <= 0.07 and s["median_abs_error"] <= 0.044, (name, s)
    for name in ("gpu1", "dp2", "ep2_cap"):  # issue 35's target: every scale-out point within 10 %
        assert res["summary"][name]["max_abs_error"] <= 0.10, name
    rows = [r for r in res["rows"] if "refused" not in r]
    assert len(rows) == 3 * 18
    assert all(r["verdict_right"] for r in rows)
    assert {r["point"] for r in rows if not r["predicted_fits"]} == {"ep4_nccl_mbs24"}


@pytest.mark.parametrize("baseline", ["gpu1_prof", "dp2_prof", "ep2_cap_prof"])
def test_the_planners_top_4gpu_layout_is_within_5_percent_of_the_best_measured(baseline):
    """Issue 35 for the planner: `tracelens plan gpu_proxy_train --gpus 4 --global-batch 96 --mbs 8,24 --from RUN`
    from each 1- and 2-GPU profile puts first a layout whose measured throughput is within 5 % of the best measured
    (tests/fixtures/h100_4gpu_accum/measured.json: dp 4 at micro-batch 24, 121,739-123,985 tokens/s/GPU, median
    123,180). Before the chunked loss's units were per-micro-batch work in the scale-out's pieces, the planner put
    dp 4 x micro-batch 8 x 3 accumulation first (projected 138,840-146,271; measured 102,015-105,737: 0.83-0.86x of
    the best) and pp 2 x 6 micro-batches second (129,621; measured 88,431)."""
    from tracelens.projection.measured import load_measured

    _, _, _, points = load_measured(FIX / "h100_4gpu_accum" / "measured.json")
    meas: dict = {}
    for pt in points:
        s = pt.sets
        pp, ep = int(s.get("pp", 1)), int(s.get("ep", 1))
        key = (4 // (pp * ep), ep, pp, int(s["micro_batch_size"]), int(s.get("microbatches", 1)))
        meas.setdefault(key, []).append(pt.tps)
    med = {k: sorted(v)[len(v) // 2] for k, v in meas.items()}
    best = max(med.values())
    so = SO.ScaleOut.from_run(FIX / "h100_scaling" / baseline)
    p = PL.plan(M.load_model_config("gpu_proxy_train", []), 4, 96, M.device_memory("H100"), so, mbs=(8, 24))
    top = p.rows[0]
    key = (top["dp"], top["ep"], top["pp"], top["mbs"], top["microbatches"])
    assert top["recompute"] == "none" and key in med, top
    assert med[key] >= 0.95 * best, (key, med[key], best)
    # the measured layouts, in the planner's order, keep the measured order of the two dp 4 micro-batch-8 points
    order = [(r["dp"], r["ep"], r["pp"], r["mbs"], r["microbatches"]) for r in p.rows if r["recompute"] == "none"]
    assert order.index((4, 1, 1, 8, 3)) < order.index((2, 1, 2, 8, 6))


def test_gradient_accumulation_at_4_gpus_against_the_planners_measured_layouts():
    """The planner's 4-GPU layouts at a global batch of 96, measured (tests/fixtures/h100_4gpu_accum/measured.json),
    projected from the 1- and 2-GPU profiles and from the profiled dp 4 micro-batch 8 run. The chunked loss's units and
    FSDP's all-gather copies repeat per micro-batch (`pp_layout.piece_costs_from_profile`,
    `pp_layout.fsdp_per_microbatch_ns`): dp 4 x micro-batch 8 x 3 micro-batches from 1 GPU / dp 2 / ep 2 +7.0-11.0 /
    +9.1-13.1 / +8.1-12.0 % (before +38-43 %: the loss head counted once a step), about the error of the same layout
    at one micro-batch (+8.3-9.5 / +6.4-7.5 / +7.9-9.0 %); from the dp 4 run itself +3.8-7.6 %. With FSDP2's
    gathers placed per unit (`fsdp_overlap`, with the hooks' host time a run at dp 1 lacks): every point max 7.2 /
    10.0 / 11.6 %, median 3.4 / 3.7 / 6.8 % from 1 GPU / dp 2 / ep 2 (the maxima: the slower of two measured calls
    at micro-batch 3); the three micro-batch-3 points from the dp 4 run +3.2-7.0 %. Stop 32 (test above): max 6.1 /
    5.3 / 7.8 %, median 3.1 / 1.9 / 4.9 %. Regression bounds: the measured errors rounded up."""
    res = SO.validate(FIX / "h100_4gpu_accum" / "measured.json")
    for name in ("gpu1", "dp2", "ep2_cap"):
        s = res["summary"][name]
        assert s["n"] == 9 and s["max_abs_error"] <= 0.08 and s["median_abs_error"] <= 0.05, (name, s)
    assert res["summary"]["gpu1"]["max_abs_error"] <= 0.065
    m3 = [r for r in res["rows"] if r["baseline"] == "dp4_mbs8" and r["point"].startswith("dp4_mbs8_m3")]
    assert len(m3) == 3 and all(abs(r["error"]) <= 0.075 for r in m3), m3
    assert all(r["verdict_right"] for r in res["rows"] if "refused" not in r)


def test_a_projection_from_ep_1_adds_the_ep_path_and_says_what_it_cannot_know():
    """Issue 35's gap from 1 GPU (docs/whatif.md, "Validation"): a run at ep 1 has none of the EP dispatch path's own
    kernels; the projection adds them at the run's own rates (`ep_path`) and says so, and says that another world
    size routes otherwise. From a run at ep 2 (capacity) only a path whose kernels differ (nccl's worst-case buffer)
    adds the difference."""
    one = SO.ScaleOut.from_run(FIX / "h100_scaling" / "gpu1_prof")
    p = one.project(4, {"ep": 2, "ep_dispatch": "capacity", "micro_batch_size": 16})
    assert any(n.startswith("EP dispatch path (capacity): its own kernels, 15 per MoE layer") for n in p.notes)
    assert any(n.startswith("expert rows: the busiest rank's from this run's routing.json") for n in p.notes)
    assert not any(n.startswith("EP dispatch path") for n in one.project(4, {"ep": 1}).notes)
    two = SO.ScaleOut.from_run(FIX / "h100_scaling" / "ep2_cap_prof")
    q = two.project(4, {"ep": 4, "ep_dispatch": "capacity", "micro_batch_size": 16})
    assert not any(n.startswith("EP dispatch path") for n in q.notes)
    r = two.project(4, {"ep": 4, "ep_dispatch": "nccl", "micro_batch_size": 16})
    assert any(n.startswith("EP dispatch path (nccl_l3)") for n in r.notes)

def test_held_out_4gpu_points_registered_before_they_ran():
    """Issue 35, held out (tests/fixtures/h100_4gpu_heldout/measured.json): six 4-GPU layouts no grid or fixture
    had run (dp 4 at micro-batch 4 and 12, 8 x 2 and 16 x 2 micro-batches, ep 2 x dp 2 and ep 4 capacity at
    micro-batch 12), projected from the 1- and 2-GPU profiles and registered before they ran
    (benchmarks/results/issue35_heldout_predictions.json), measured twice on 4 x H100 (stop 29), with the same
    trainer's micro-batch-16 rows beside them. Measured errors of the registered model (422c0fd): max 14.0 / 7.5 /
    9.0 %, median 4.6 / 4.3 / 3.3 % from 1 GPU / dp 2 / ep 2 capacity (the window rule before `fsdp_overlap`: 18.9 /
    8.6 / 15.2 %), micro-batch 4 from the 1-GPU run +13.0 / +14.0 %. With the hooks' host time a run at dp 1 lacks
    (`fsdp_overlap.HOOK_HOST_NS`, from the committed FSDP runs, added after these were measured): from 1 GPU max
    7.7 %, median 2.9 % (micro-batch 4: +0.6 / -0.3 %); every point within 10 % from every baseline. Stop 32 (the
    grid's test above): max 4.6 / 5.6 / 8.4 %, median 2.3 / 2.4 / 1.8 %. Regression bounds: the measured errors
    rounded up."""
    res = SO.validate(FIX / "h100_4gpu_heldout" / "measured.json")
    rows = [r for r in res["rows"] if "refused" not in r]
    assert len(rows) == 3 * 15 and all(r["verdict_right"] for r in rows)
    for name, bound in (("dp2", 0.06), ("ep2_cap", 0.085)):
        s = res["summary"][name]
        assert s["n"] == 15 and s["max_abs_error"] <= bound and s["median_abs_error"] <= 0.025, (name, s)
    s = res["summary"]["gpu1"]
    assert s["max_abs_error"] <= 0.05 and s["median_abs_error"] <= 0.024, s
    assert all(abs(r["error"]) <= 0.10 for r in rows)


@pytest.mark.parametrize("args, named", [
    (["--memory-gib", "1"], "--memory-gib"),
    (["--network", "net.yaml", "--intra-node-busbw", "5"], "--network, --intra-node-busbw"),
    (["--kernel-table", "table.json", "--gpus-per-node", "4"], "--gpus-per-node, --kernel-table"),
])
def test_plan_without_a_profile_refuses_the_options_only_a_profile_uses(args, named):
    """Without --from, plan ignored them: '--device H100 --memory-gib 1' still listed 96 layouts that 'fit 74.5 GiB'."""
    r = _cli("plan", "gpu_proxy_train", "--gpus", "8", "--global-batch", "64", "--device", "H100", *args)
    assert r.exit_code == 2, r.output
    assert r.stderr == (f"tracelens: error: plan: {named} shape(s) the projection from a profile: give --from RUN "
                        "(without it, --device or --device-memory sets what fits)\n")
