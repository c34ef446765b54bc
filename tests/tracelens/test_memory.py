"""Memory projection: hand-computed tiny cases per component, parameter counts against the trainer, the
seed's qualitative findings on the 1T/2T proxies at 768 GPUs, the sweep, and the CLI's exit codes."""

import json

import pandas as pd
import pytest
from click.testing import CliRunner

from moespec.config import DEFAULTS, load_config
from moespec.params import count_params
from tracelens.analysis import memory as M
from tracelens.cli import main
from tracelens.errors import TraceError

GIB = 2**30

# A model small enough to do by hand: d=8, 2 layers (dense, MoE), 2 heads of 4, MHA, 4 experts top-2,
# 1 shared expert, vocab 32, 4 tokens per microbatch.
TINY = {**DEFAULTS, "vocab_size": 32, "d_model": 8, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2, "head_dim": 4,
        "d_ff": 16, "moe_d_ff": 4, "n_routed_experts": 4, "n_shared_experts": 1, "top_k": 2, "n_group": 1,
        "topk_group": 1, "first_k_dense": 1, "seq_len": 4, "micro_batch_size": 1, "ep": 2, "dtype": "bf16",
        "loss_fusion": False, "recompute_layer_ids": []}


def _row(p, component):
    rows = p.table[p.table["component"] == component]
    assert len(rows) == 1, component
    return float(rows["bytes"].iloc[0])


def test_tiny_params_by_hand():
    # attention 4 x 8x8 = 256; norms 2x8 = 16; dense FFN 3x8x16 = 384;
    # MoE: router 8x4 = 32, shared 3x8x4 = 96, experts 4 x 96 = 384; embedding + head 2 x 32x8; final norm 8
    assert M.total_params(TINY) == (256 + 16 + 384) + (256 + 16 + 32 + 96 + 384) + 2 * 256 + 8 == 1960
    assert M.total_params(TINY) == count_params(TINY)["total"]


def test_tiny_state_and_activations_by_hand():
    lay = M.resolve_layout(TINY, world=2)          # ep 2, FSDP: dense over 2 ranks, experts over edp 1
    assert (lay.dp, lay.edp, lay.zero) == (2, 1, 3)
    p = M.project(TINY, lay)
    dense_shard = (1960 - 384) / 2                  # 788 params
    expert_local = 384 / 2                          # 192 params, not sharded further (edp = 1)
    assert _row(p, "params: dense (sharded)") == 4 * dense_shard
    assert _row(p, "params: experts (sharded)") == 4 * expert_local
    assert _row(p, "grads: dense") == 4 * dense_shard
    assert _row(p, "optimizer: Adam exp_avg + exp_avg_sq") == 8 * (dense_shard + expert_local)
    assert _row(p, "optimizer step temporary") == 4 * (dense_shard + expert_local)
    t, d, a = 4, 8, 2
    # two RMSNorms per layer, each keeps x.float() and y (fp32): 2 layers x 2 x 8 bytes x t x d
    assert _row(p, "activations: layer norms") == 2 * 2 * 8 * t * d
    # attention (MHA): normed input, q/k/v/out/wo-input (5 x t x H x hd), fp32 log-sum-exp; per layer
    attn = a * t * d + 5 * a * t * 2 * 4 + 4 * t * 2
    assert _row(p, "activations: attention") == 2 * attn
    assert _row(p, "activations: dense FFN") == a * t * d + 4 * a * t * 16
    tk = t * 2
    moe = (4 * t * d            # router's fp32 copy of the input
           + a * t * d          # ffn_norm output kept by the shared expert
           + 4 * t * 4          # router scores [t, E] fp32
           + 8 * tk + 4 * tk + 4 * t + a * tk   # gather index, top-k weights, their sum, bf16 copy
           + 2 * 8 * tk         # permutation index and its inverse
           + tk * (a * (d + 4 * 4) + 8)         # expert rows: input, w13 out, silu, product; receive index
           + a * tk * d         # top-k output copies
           + 4 * a * t * 4)     # shared expert SwiGLU
    assert _row(p, "activations: MoE (router, experts, top-k copies)") == moe
    # non-fused loss keeps the fp32 log-softmax [t, V] plus the final norm and the head input
    assert _row(p, "activations: final norm + loss") == 8 * t * d + a * t * d + 4 * t * 32
    # the optimizer step holds state + fp32 grads + the foreach temporary
    state = 4 * dense_shard + 4 * expert_local + 8 * (dense_shard + expert_local)
    step = state + 4 * (dense_shard + expert_local) + 4 * (dense_shard + expert_local)
    assert p.stages["optimizer_step_bytes"].iloc[0] == pytest.approx(step)
    # the backward end is the root's (embedding + head + final norm) reduce-scatter: FSDP2 reshards the root's
    # bf16 params first, then holds the fp32 input (4 B) and either the unsharded bf16 gradient (2 B) or the
    # fp32 output shard (4/2 B over 2 ranks); that shard is the root's part of the grads already counted
    root = 32 * 8 + 32 * 8 + 8
    grads = 4 * (dense_shard + expert_local)
    assert p.stages["backward_end_bytes"].iloc[0] == pytest.approx(state + grads + 4 * root + 2 * root - 2 * root)
    moments = p.stages.iloc[0][["forward_end_bytes", "backward_bytes", "backward_end_bytes", "optimizer_step_bytes"]]
    assert p.peak_bytes == pytest.approx(moments.max())
    assert p.table.loc[p.table["in_peak"], "bytes"].sum() == pytest.approx(p.peak_bytes)


def test_level3_worst_case_buffer_by_hand():
    lay = M.resolve_layout({**TINY, "sync_free_level": 3}, world=2)
    p = M.project({**TINY, "sync_free_level": 3}, lay)
    t, tk, ep = 4, 8, 2
    worst = ep * t * min(2, 4 // ep)               # ep * T * min(k, E/ep) = 16 rows vs 8 balanced
    per_row = 2 * (8 + 4 * 4) + 8
    assert _row(p, "activations: MoE level-3 worst-case buffer") == (worst - tk) * per_row
    # while the experts run backward: their outputs' gradient in one padded buffer (the regroup frees the received
    # copy), a * worst * d
    assert _row(p, "transient: MoE dispatch/combine buffers") == 2 * worst * 8


def test_recompute_full_keeps_layer_inputs():
    lay = M.resolve_layout(TINY, world=2, recompute="full")
    p = M.project(TINY, lay)
    assert _row(p, "activations: recomputed layers' inputs") == 2 * (2 * 4 * 8)  # 2 layers x a*t*d
    assert p.table.loc[p.table["component"] == "activations: attention", "bytes"].iloc[0] == 0
    assert _row(p, "recompute savings (not allocated)") > 0


def test_pipeline_in_flight():
    lay = M.Layout(world=16, pp=4, microbatches=8)
    assert [M.in_flight(lay, s) for s in range(4)] == [4, 3, 2, 1]
    gp = M.Layout(world=16, pp=4, microbatches=8, schedule="gpipe")
    assert M.in_flight(gp, 0) == 8
    # interleaved, v=2, p=4: warm-up 2(p-1) + (v-1)p = 10 chunks, +1, each half a stage
    il = M.Layout(world=16, pp=4, vpp=2, microbatches=8, schedule="vpp")
    assert M.in_flight(il, 0) == 11 / 2
    assert M.stage_layers(10, 4) == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert M.stage_layers(8, 2, 2) == [[0, 1, 4, 5], [2, 3, 6, 7]]


@pytest.mark.parametrize("name", ["tiny", "gpu_proxy", "deepseek_v2_lite", "deepseek_v2", "proxy_1t", "proxy_2t"])
def test_param_counts_match_trainer(name):
    cfg = load_config(name)
    assert M.total_params(cfg) == count_params(cfg)["total"]
    # every stage's parameters add up to the model's, for an uneven split too
    lay = M.Layout(world=8, pp=min(8, cfg["n_layers"]), microbatches=8)
    stages = [M.stage_params(cfg, lay, s) for s in range(lay.pp)]
    assert sum(s["dense"] + s["experts"] for s in stages) == count_params(cfg)["total"]
    assert sum(s["experts"] for s in stages) == count_params(cfg)["routed_experts"]


def test_param_count_matches_torch_module():
    torch = pytest.importorskip("torch")  # noqa: F841
    from trainer.model import Transformer

    cfg = load_config("tiny")
    n = sum(p.numel() for p in Transformer(cfg).parameters())
    assert M.total_params(cfg) == n


def _big(name, **kw):
    cfg = load_config(name)
    base = dict(world=768, pp=16, ep=8, mbs=1, microbatches=32, sync_free_level=1, loss_fusion=True)
    base.update(kw)
    return cfg, M.project(cfg, M.resolve_layout(cfg, **base))


@pytest.mark.parametrize("name", ["proxy_1t", "proxy_2t"])
def test_seed_findings_fsdp_over_768_gpus(name):
    """The seed's three findings where the model state stays sharded over the world (FSDP, no pipeline,
    one microbatch per step): activations dominate, CP2 about halves them, EP 8 -> 16 barely moves the
    peak (expert state is sharded over ep x edp = 768 either way)."""
    cfg, p = _big(name, pp=1, microbatches=1)
    _, p16 = _big(name, pp=1, microbatches=1, ep=16)
    _, pcp = _big(name, pp=1, microbatches=1, cp=2)
    assert p.component_bytes("activations") > 0.7 * p.peak_bytes
    assert 0.4 <= pcp.component_bytes("activations") / p.component_bytes("activations") <= 0.7
    assert 0.94 <= p16.peak_bytes / p.peak_bytes < 1.0       # -3 % (1T), -5 % (2T)
    assert p.peak_bytes - p16.peak_bytes < (p.peak_bytes - pcp.peak_bytes) / 6  # next to CP2's cut
    for g in ("parameters", "optimizer", "activations"):
        assert p16.component_bytes(g) == pytest.approx(p.component_bytes(g))
    # all that moves: the largest FSDP unit's gradient reduce-scatter, one MoE layer's local experts
    # (bf16 unsharded gradients + their fp32 copy, 6 B/param), halved by ep 16
    layer_experts = cfg["n_routed_experts"] * 3 * cfg["d_model"] * cfg["moe_d_ff"]
    assert p.peak_bytes - p16.peak_bytes == pytest.approx(6 * layer_experts * (1 / 8 - 1 / 16))


@pytest.mark.parametrize("name", ["proxy_1t", "proxy_2t"])
def test_seed_findings_on_768_gpus(name):
    cfg, p = _big(name)
    groups = p.table[p.table["in_peak"]].groupby("group")["bytes"].sum()
    assert groups.idxmax() == "activations"           # activations dominate
    acts = p.component_bytes("activations") - p.component_bytes(component="recompute savings (not allocated)")
    _, p_cp = _big(name, cp=2)
    acts_cp = p_cp.component_bytes("activations")
    attn = p.component_bytes(component="activations: attention")
    attn_cp = p_cp.component_bytes(component="activations: attention")
    assert 0.4 <= attn_cp / attn <= 0.6                 # CP2 halves attention activations
    assert acts_cp <= 0.7 * acts                        # and takes >= 30% off all activations
    _, p16 = _big(name, ep=16)
    # EP 8 -> 16 leaves the sharded model state alone (experts are sharded over ep x edp = world/pp either
    # way) ...
    state, state16 = ([q.component_bytes(g) for g in ("parameters", "optimizer")] for q in (p, p16))
    assert state16 == pytest.approx(state)
    # ... but the trainer's FSDP2 stages inside a pipeline keep their experts unsharded (bf16) with fp32
    # gradient accumulators between microbatches, and those are this rank's experts: halved by ep 16
    layers = M.stage_layers(cfg["n_layers"], 16)[p.stage]
    experts = sum(li >= cfg["first_k_dense"] for li in layers) * cfg["n_routed_experts"] * 3 * cfg["d_model"] \
        * cfg["moe_d_ff"]
    q16 = M.project(cfg, p16.layout, stage=p.stage)
    for comp, nbytes in (("FSDP unsharded params (pipeline: kept between microbatches)", 2),
                         ("FSDP unsharded fp32 gradient accumulators", 4)):
        drop = p.component_bytes(component=comp) - q16.component_bytes(component=comp)
        assert drop == pytest.approx(nbytes * experts * (1 / 8 - 1 / 16))


def test_level3_buffer_grows_with_ep_on_1t():
    cfg = load_config("proxy_1t")
    b = {}
    for ep in (8, 16):
        p = M.project(cfg, M.resolve_layout(cfg, world=768, pp=16, ep=ep, microbatches=32, sync_free_level=3))
        b[ep] = p.component_bytes(component="transient: MoE dispatch/combine buffers")
    assert b[16] == pytest.approx(2 * b[8])             # ep * T * min(k, E/ep) rows, min(8, 24) = min(8, 48)


def test_sweep_only_fitting_sorted():
    cfg = load_config("deepseek_v2_lite")
    dev = 80 * GIB
    space = M.SweepSpace(tp=(1, 2), cp=(1, 2), vpp=(1, 2), mbs=(1,))
    df = M.sweep(cfg, world=16, device_bytes=dev, global_batch=64, space=space, headroom=0.05)
    assert len(df) > 0
    assert (df["peak_bytes"] <= dev * 0.95).all()
    keys = list(zip(df["bubble"], df["comm_bytes"]))
    assert keys == sorted(keys)
    assert df["pp"].min() == 1 and df["bubble"].iloc[0] == 0.0
    # every returned row re-projects to its peak and GA = 64 / (mbs * dp)
    for r in df.head(5).itertuples(index=False):
        lay = M.resolve_layout(cfg, world=16, pp=r.pp, vpp=r.vpp, tp=r.tp, cp=r.cp, ep=r.ep, mbs=r.mbs,
                               microbatches=r.microbatches, schedule=r.schedule, recompute=r.recompute)
        assert M.project(cfg, lay).peak_bytes == pytest.approx(r.peak_bytes)
        assert r.microbatches == 64 // (r.mbs * r.dp)
    # a 10 GiB device fits fewer layouts, all of them under the limit
    small = M.sweep(cfg, world=16, device_bytes=10 * GIB, global_batch=64, space=space)
    assert len(small) < len(df) and (small["peak_bytes"] <= 10 * GIB * 0.95).all()


def test_bad_layouts_one_line():
    cfg = load_config("proxy_1t")
    with pytest.raises(TraceError, match="ep=7 does not divide"):
        M.resolve_layout(cfg, world=768, pp=16, ep=7)
    with pytest.raises(TraceError, match="not divisible by pp"):
        M.resolve_layout(cfg, world=768, pp=5)
    with pytest.raises(TraceError, match="n_heads=64 is not divisible by tp=3"):
        M.resolve_layout(cfg, world=768, tp=3)
    with pytest.raises(TraceError, match="unknown layout key"):
        M.resolve_layout(cfg, world=8, bogus=1)
    with pytest.raises(TraceError, match="recompute"):
        M.resolve_layout(cfg, world=8, recompute="sometimes")
    assert M.parse_bytes("80GiB") == 80 * GIB and M.parse_bytes("141GB") == 141 * 10**9
    with pytest.raises(TraceError):
        M.parse_bytes("lots")


def test_cli(tmp_path):
    r = CliRunner()
    out = r.invoke(main, ["memory", "gpu_proxy", "--json", str(tmp_path / "m.json"), "--device", "H100"])
    assert out.exit_code == 0, out.output
    js = json.loads((tmp_path / "m.json").read_text())
    assert js["peak_bytes"] == max(c for c in [sum(x["bytes"] for x in js["components"] if x["in_peak"])])
    assert js["fits"] is True and js["layout"]["world"] == 1
    for args, msg in ((["memory", "gpu_proxy", "--set", "nope=1"], "nope: unknown config key"),
                      (["memory", "proxy_1t", "--world", "768", "--pp", "16", "--ep", "7"], "ep=7 does not divide"),
                      (["memory", "no_such_config"], "file not found"),
                      (["memory", "gpu_proxy", "--sweep"], "--sweep needs")):
        res = r.invoke(main, args)
        assert res.exit_code == 2, (args, res.output)
        lines = [ln for ln in res.output.splitlines() if ln.strip()]
        assert len(lines) == 1 and msg in lines[0] and lines[0].startswith("tracelens: error:")


def test_cli_manifest_and_sweep(tmp_path):
    cfg = load_config("gpu_proxy")
    man = {"config": cfg, "world_size": 1, "metrics": {"peak_memory_bytes": [40 * GIB],
                                                         "peak_memory_kind": "cuda_max_memory_allocated"}}
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "manifest.json").write_text(json.dumps(man))
    r = CliRunner()
    res = r.invoke(main, ["memory", str(tmp_path / "run"), "--json", str(tmp_path / "m.json")])
    assert res.exit_code == 0, res.output
    js = json.loads((tmp_path / "m.json").read_text())
    assert js["measured_peak_bytes"] == 40 * GIB
    assert js["projected_over_measured"] == pytest.approx(js["peak_bytes"] / (40 * GIB), rel=1e-3)
    html = (tmp_path / "run" / "memory.html")
    res = r.invoke(main, ["memory", str(tmp_path / "run"), "-o", str(tmp_path / "run")])
    assert res.exit_code == 0 and html.exists(), res.output
    page = html.read_text()
    assert 'id="plot-memory"' in page and "optimizer: Adam exp_avg + exp_avg_sq" in page and "measured peak" in page
    assert "<title>tracelens memory: run</title>" in page  # named by the run dir, not "manifest.json"
    res = r.invoke(main, ["memory", "deepseek_v2_lite", "--world", "16", "--sweep", "--device-memory", "80GiB",
                          "--global-batch", "64", "--json", str(tmp_path / "s.json"), "--top", "5"])
    assert res.exit_code == 0, res.output
    s = json.loads((tmp_path / "s.json").read_text())
    assert 0 < len(s["fits"]) <= 5 and all(f["peak_bytes"] <= 80 * GIB * 0.95 for f in s["fits"])


# ---------------------------------------------------------------- validation on real multi-GPU run dirs
FIX = __import__("pathlib").Path(__file__).resolve().parents[1] / "fixtures"
H200_RUNS = ["h200_ep2_run/L0_loop", "h200_ep2_run/L3_torch", "h200_pp2_run/1f1b", "h200_pp2_run/vpp2"]


def _run(name):
    mc = M.load_model_config(FIX / name)
    lay = M.resolve_layout(mc.config, world=mc.world, **mc.layout_kwargs())
    return json.loads((FIX / name / "manifest.json").read_text()), mc, lay


@pytest.mark.parametrize("name", H200_RUNS)
def test_projection_within_10pct_of_every_rank_on_h200(name):
    man, mc, lay = _run(name)
    measured = man["metrics"]["peak_memory_bytes"]           # torch.cuda.max_memory_allocated per rank
    assert man["metrics"]["peak_memory_kind"] == "cuda_max_memory_allocated" and len(measured) == 2
    df = M.compare_ranks(mc.config, lay, measured)
    assert list(df["rank"]) == [0, 1]
    for r in df.itertuples(index=False):
        assert r.measured_bytes == measured[r.rank]
        assert 0.9 <= r.projected_bytes / measured[r.rank] <= 1.1, (name, r)
    if man["pipeline"]:                                       # each rank projected for the stages it holds
        assert list(df["pp_rank"]) == man["pipeline"]["stage_to_rank"][:2]


def test_single_gpu_h100_gpu_proxy_within_10pct():
    cfg = load_config("gpu_proxy")                            # seq 2048 x mbs 2, bf16, FSDP2, one H100
    assert (cfg["seq_len"], cfg["micro_batch_size"], cfg["dp_mode"], cfg["dtype"]) == (2048, 2, "fsdp", "bf16")
    p = M.project(cfg, M.resolve_layout(cfg, world=1))
    assert 0.9 <= p.peak_bytes / (42.07 * GIB) <= 1.1        # measured (docs/memory.md): 42.07 GiB
    assert p.phase == "optimizer step"
    assert p.peak_bytes == pytest.approx(20 * M.total_params(cfg))   # fp32 param + grad + Adam m, v + sqrt temp


def test_ep2_peak_is_the_optimizer_step_at_every_level():
    # measured: L0 and L3 peak at exactly the same byte count, so neither MoE path sets the peak
    for name in H200_RUNS[:2]:
        man, mc, lay = _run(name)
        p = M.project(mc.config, lay)
        assert p.phase == "optimizer step"
        dense = man["params"]["total"] - man["params"]["routed_experts"]
        local = dense / 2 + man["params"]["routed_experts"] / 2  # dense over 2 ranks, experts split by ep 2
        assert p.peak_bytes == pytest.approx(20 * local)


@pytest.mark.parametrize("name", H200_RUNS[2:])
def test_schedule_order_matches_recorded_pipeline(name):
    import gzip

    from moespec.schedules import action_order

    man, mc, lay = _run(name)
    for rank in range(2):
        with gzip.open(FIX / name / "pipeline" / f"rank{rank}.jsonl.gz", "rt") as f:
            rows = [json.loads(line) for line in f]
        last = max(r["step"] for r in rows)
        got = [(r["kind"], r["stage"], r["microbatch"])
               for r in sorted((r for r in rows if r["step"] == last), key=lambda r: r["start_ns"])]
        assert got == action_order(lay.schedule, lay.pp, lay.vpp, lay.microbatches, rank)


def test_pipeline_rank_components_by_hand():
    man, mc, lay = _run("h200_pp2_run/1f1b")                # Ettt|tL, 1F1B, 8 microbatches, DDP + autocast
    assert lay.stage_layers == ((0, 1, 2), (3,)) and lay.zero == 0
    t, d, V, F, E = 2048, 2048, 102400, 1408, 64
    experts = E * 3 * d * F                                   # one MoE layer's routed experts
    p0 = M.project(mc.config, lay, stage=0)
    # rank 0 (stage 0: layers 0-2, two MoE): 1F1B keeps p - s = 2 microbatches; each holds bf16 copies of
    # both MoE layers' experts (GroupedExperts casts w13/w2 every forward)
    assert _row(p0, "activations: expert weight bf16 copies (autocast)") == 2 * 2 * 2 * experts
    # one gradient receive buffer per microbatch (stage 0 receives no activations), fp32 [1, 2048, 2048]
    assert _row(p0, "pipeline receive buffers") == 8 * 4 * t * d
    # backward of an MoE layer: w13's bf16 gradient + fp32 cast + w2's gradient, net of the freed copies
    assert _row(p0, "transient: layer backward workspace") == 4 * E * 2 * F * d
    p1 = M.project(mc.config, lay, stage=1)
    # rank 1 (layer 3 + head): the fused loss chunk (2048 tokens) holds the fp32 log-softmax, its gradient and
    # the NLL gradient (12 B x tokens x vocab) + autocast's bf16 head cast made again by the recomputation
    assert _row(p1, "transient: loss (logits and their gradient)") == 12 * t * V + 2 * V * d
    assert p1.phase == "forward end" and _row(p1, "pipeline receive buffers") == 8 * 4 * t * d


def test_bad_pipeline_manifest_one_line(tmp_path):
    man = json.loads((FIX / "h200_pp2_run/1f1b/manifest.json").read_text())
    man["pipeline"]["stage_layers"] = [[0, 1], [3]]
    (tmp_path / "manifest.json").write_text(json.dumps(man))
    res = CliRunner().invoke(main, ["memory", str(tmp_path)])
    assert res.exit_code == 2
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "stage_layers" in lines[0] and "0..3" in lines[0]


def test_cli_pipeline_run_per_rank(tmp_path):
    res = CliRunner().invoke(main, ["memory", str(FIX / "h200_pp2_run/vpp2"), "--json", str(tmp_path / "m.json")])
    assert res.exit_code == 0, res.output
    assert "rank 1 (pipeline rank 1)" in res.output
    js = json.loads((tmp_path / "m.json").read_text())
    assert js["layout"]["stage_layers"] == [[0], [1], [2], [3]] and js["layout"]["stage_to_rank"] == [0, 1, 0, 1]
    assert [r["measured_bytes"] for r in js["ranks"]] == [21203748352, 31515833344]


def test_a_bare_name_that_is_both_a_config_and_a_local_path(tmp_path, monkeypatch):
    """`memory tiny` in a directory holding `tiny/` (or `tiny.yaml`) used to read the local path (and
    fail: no manifest.json). A bare name means the trainer config when one has that name, and says in
    one warning line that a local path of the same name was passed over; `./tiny` is the path."""
    import json

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()
    r = CliRunner()
    res = r.invoke(main, ["memory", "tiny", "--json", "m.json"])
    assert res.exit_code == 0, res.output
    assert res.stderr.splitlines() == ["tracelens: warning: 'tiny' is both a trainer config (tiny.yaml under "
                                       "trainer/configs) and a directory here; using the config (write ./tiny "
                                       "for the directory)"]
    assert json.loads((tmp_path / "m.json").read_text())["config"] == "tiny"
    res = r.invoke(main, ["memory", "./tiny"])
    assert res.exit_code == 2 and res.stderr.strip() == "tracelens: error: tiny: directory has no manifest.json (expected a run dir)"
    # a local YAML of the config's file name: the bare name is still the config; ./tiny.yaml the file
    (tmp_path / "tiny.yaml").write_text("extends: gpu_proxy\nn_layers: 3\n")
    res = r.invoke(main, ["memory", "tiny.yaml", "--json", "m.json"])
    assert res.exit_code == 0 and "a file here; using the config (write ./tiny.yaml for the file)" in res.stderr
    res = r.invoke(main, ["memory", "./tiny.yaml", "--json", "m2.json"])
    assert res.exit_code == 0 and res.stderr == "", res.output
    assert json.loads((tmp_path / "m.json").read_text())["layout"]["seq"] == 64  # tiny's seq_len
    assert json.loads((tmp_path / "m2.json").read_text())["layout"]["seq"] == load_config("gpu_proxy")["seq_len"] != 64
    # a bare name no config has: the local path, no warning
    (tmp_path / "mine.yaml").write_text("extends: tiny\nseq_len: 32\n")
    res = r.invoke(main, ["memory", "mine.yaml", "--json", "m3.json"])
    assert res.exit_code == 0 and res.stderr == "", res.output
    assert json.loads((tmp_path / "m3.json").read_text())["layout"]["seq"] == 32


def test_sweep_shares_each_schedule_shapes_moments():
    """`memory proxy_1t --sweep` spent half its time re-deduplicating the same simulated backward moments for
    each of thousands of layouts (issue 36: 30-56 s where the README says ~20 s). The distinct moments are now
    cached on the schedule's shape; they are those of `backward_moments`, in order, for every schedule."""
    def reference(lay, rank):
        seen, out = set(), []
        for st, comp in M.backward_moments(lay, rank):
            if (st, tuple(comp.items())) not in seen:
                seen.add((st, tuple(comp.items())))
                out.append((st, comp))
        return out

    cfg = load_config("proxy_1t")
    for sched, vpp in (("1f1b", 1), ("gpipe", 1), ("vpp", 2), ("zb1p", 1)):
        lay = M.resolve_layout(cfg, world=768, pp=16, vpp=vpp, ep=8, microbatches=32, schedule=sched)
        for rank in (0, 7, 15):
            assert M._distinct_moments(lay, rank) == reference(lay, rank)
    M._distinct_simulated.cache_clear()
    space = M.SweepSpace(tp=(1, 2), cp=(1,), vpp=(1, 2), mbs=(1, 2))
    M.sweep(cfg, world=64, device_bytes=141 * GIB, global_batch=1536, space=space)
    info = M._distinct_simulated.cache_info()
    assert info.hits > 5 * info.misses  # the layouts of one schedule shape share one computation


def test_sweep_computes_each_layer_kind_once_per_config_and_gives_the_same_layouts(monkeypatch):
    """`memory --sweep` asked `layer_params` and `layer_activations` hundreds of thousands of times for a model
    whose layers are of two kinds, dense and MoE (issue 36: 27 s of CPU where the README says ~20 s). They are
    now computed once per (config, kind) and, for the activations, per the layout fields they read; the
    sweep's layouts and peaks are those computed without sharing anything between layouts."""
    cfg = load_config("proxy_1t")
    space = M.SweepSpace(tp=(1, 2), cp=(1, 2), vpp=(1, 2), mbs=(1, 2))
    calls = {"params": 0, "acts": 0}
    params, acts = M.layer_params, M.layer_activations

    def count_params(c, li):
        calls["params"] += 1
        return params(c, li)

    def count_acts(c, lay, li):
        calls["acts"] += 1
        return acts(c, lay, li)

    monkeypatch.setattr(M, "layer_params", count_params)
    monkeypatch.setattr(M, "layer_activations", count_acts)
    M._memo_clear()
    shared = M.sweep(cfg, world=64, device_bytes=1 << 50, global_batch=1536, space=space)
    assert len(shared) > 100
    assert calls["params"] == 2  # one dense layer, one MoE layer: the config's two kinds
    # the activations read the layout's micro-batch, sequence split, dtype and EP fields only: at most one
    # computation per kind and distinct (mbs, tp, cp, ep) of the space
    assert calls["acts"] <= 2 * 2 * 2 * 2 * len(M._divisors(cfg["n_routed_experts"]))
    # a fresh cache for every stage of every layout: nothing shared between layouts, the same answer
    monkeypatch.setattr(M, "_memo", M._Memo)
    alone = M.sweep(cfg, world=64, device_bytes=1 << 50, global_batch=1536, space=space)
    pd.testing.assert_frame_equal(shared, alone)
    monkeypatch.undo()
    # the cached parts are the functions' own, layer by layer, on dense and MoE layers and several layouts
    memo = M._Memo(cfg)
    for kw in ({"pp": 4, "ep": 8}, {"ep": 16, "tp": 2, "dtype": "fp32"}, {"ep": 8, "zero": 0, "mbs": 2},
               {"ep": 8, "ep_dispatch": "capacity", "sync_free_level": 2, "cp": 2}):
        lay = M.resolve_layout(cfg, world=64, **kw)
        for li in (0, cfg["first_k_dense"], cfg["n_layers"] - 1):
            assert memo.params(li) == M.layer_params(cfg, li)
            assert memo.activations(lay, li) == M.layer_activations(cfg, lay, li)
            assert memo.workspace(lay, li) == M._layer_backward_workspace(cfg, lay, li)
        assert memo.stages(lay) == M.virtual_stages(cfg, lay)


def test_memory_cache_follows_a_config_changed_in_place():
    cfg = dict(load_config("proxy_1t"))
    lay = M.resolve_layout(cfg, world=64, ep=8)
    before = M.project(cfg, lay).peak_bytes
    cfg["moe_d_ff"] *= 2  # the same dict object, a different model: nothing cached for it may be reused
    assert M.project(cfg, lay).peak_bytes == M.project(dict(cfg), lay).peak_bytes > before


@pytest.mark.parametrize("args, message", [
    # --world 0 was read as "no --world" (world 1) and printed a projection for one GPU
    (["--world", "0"], "gpu_proxy: memory: world: must be a positive integer, got 0"),
    (["--world", "0", "--sweep", "--device", "H200", "--global-batch", "64"],
     "gpu_proxy: memory: world: must be a positive integer, got 0"),
    # a global batch below 1 was divided into microbatches first: "microbatches: ... got -2" for --global-batch -4
    (["--global-batch", "-4"], "memory: global batch must be >= 1, got -4"),
    (["--global-batch", "0"], "memory: global batch must be >= 1, got 0"),
    # a device of 0 bytes was taken: "does NOT fit 0.0 GiB", exit 0
    (["--device-memory", "0"], "memory: device memory '0' is not a size above 0 bytes"),
    (["--device-memory", "0GiB"], "memory: device memory '0GiB' is not a size above 0 bytes"),
])
def test_cli_bad_sizes_one_line(args, message):
    res = CliRunner().invoke(main, ["memory", "gpu_proxy", *args])
    assert res.exit_code == 2, res.output
    assert res.stderr == f"tracelens: error: {message}\n" and "Traceback" not in res.output


def test_plan_device_memory_zero_one_line():
    res = CliRunner().invoke(main, ["plan", "gpu_proxy_train", "--gpus", "64", "--global-batch", "1024",
                                    "--device-memory", "0"])
    assert res.exit_code == 2, res.output
    assert res.stderr == "tracelens: error: memory: device memory '0' is not a size above 0 bytes\n"


def test_cli_vpp_without_a_pipeline_one_line():
    """--vpp 3 at pp 1 was projected as a 'pp1 vpp3 ... vpp' layout (exit 0); the trainer refuses that config."""
    res = CliRunner().invoke(main, ["memory", "gpu_proxy", "--vpp", "3"])
    assert res.exit_code == 2, res.output
    assert res.stderr == ("tracelens: error: gpu_proxy: memory: vpp: needs pipeline parallelism (pp > 1), got pp=1 "
                          "and vpp=3\n")


def test_cli_sweep_refuses_the_layout_options_it_enumerates():
    """`--sweep --pp 2 --mbs 4` listed pp1 / mbs2 layouts: the options were silently not used."""
    res = CliRunner().invoke(main, ["memory", "gpu_proxy", "--sweep", "--world", "8", "--device", "H100",
                                    "--global-batch", "64", "--pp", "2", "--mbs", "4"])
    assert res.exit_code == 2, res.output
    assert res.stderr == ("tracelens: error: memory: --sweep enumerates the layouts itself: --pp, --mbs would not be "
                          "used (drop --sweep to project one layout)\n")
