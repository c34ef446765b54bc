"""Auxiliary-loss-free load balancing (trainer/model/balance.py, ``router_bias_update_rate``).

* the update rule against hand-computed values; the PyTorch router's bias against a plain-Python top-k;
* in process: a router skewed on purpose (every token prefers two experts) is evened out by the bias, step
  by step as a plain-Python recomputation of each step's choices and the sign rule say, with no host sync;
* two gloo processes with different local loads end with the same bias, the rule applied to the sum;
* the trainer end to end: the manifest's final biases equal the rule replayed from RUN/routing.json's
  per-step counts; impossible settings are one-line config errors.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moespec.config import ConfigError, load_config
from trainer.model import Transformer
from trainer.model.balance import RouterBias, bias_update, moe_layers
from trainer.model.moe import MoE, route
from trainer.routing_log import RoutingLog
from trainer.syncs import HostSyncCounter

REPO = Path(__file__).resolve().parents[2]


def _sign(x: float) -> float:
    return (x > 0) - (x < 0)


def test_update_rule_by_hand():
    load = torch.tensor([[4, 0, 2, 2], [1, 1, 1, 1]])
    got = bias_update(load, 0.5)
    # row 0: mean 2 -> expert 0 over (down), 1 under (up), 2 and 3 at the mean (unchanged); row 1 balanced
    assert got.tolist() == [[-0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]


@pytest.mark.parametrize("score_func,n_group,topk_group", [("softmax", 1, 1), ("sigmoid", 4, 2), ("softmax", 4, 2)])
def test_pytorch_router_bias_chooses_but_does_not_weigh(score_func, n_group, topk_group):
    torch.manual_seed(1)
    T, E, k = 29, 16, 3
    logits, bias = torch.randn(T, E), torch.randn(E) * 0.2
    idx, w, _ = route(logits, top_k=k, score_func=score_func, n_group=n_group, topk_group=topk_group,
                      norm_topk_prob=True, routed_scaling_factor=2.0, bias=bias)
    p = (logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()).tolist()
    b = bias.tolist()
    per = E // n_group
    for t in range(T):
        q = [p[t][e] + b[e] for e in range(E)]
        allowed = list(range(E))
        if n_group > 1:  # group score on the biased scores: best expert (softmax) or top-2 sum (sigmoid)
            def gscore(g, q=q):
                vals = sorted(q[g * per:(g + 1) * per], reverse=True)
                return vals[0] + vals[1] if score_func == "sigmoid" else vals[0]
            best = sorted(range(n_group), key=lambda g: -gscore(g))[:topk_group]
            allowed = [e for e in allowed if e // per in best]
        want = sorted(allowed, key=lambda e: -q[e])[:k]
        assert idx[t].tolist() == want
        denom = sum(p[t][e] for e in want)
        assert w[t].tolist() == pytest.approx([2.0 * p[t][e] / denom for e in want], rel=1e-5)


def _skewed_moe(rate: float):
    """One MoE layer of the tiny config whose router prefers experts 0 and 1 for every token: its inputs share
    a direction ``c`` (as hidden states do) and those two gate rows align with it, as a freshly initialised
    router's often do."""
    cfg = load_config("tiny", {"router_bias_update_rate": rate, "n_group": 1, "sync_free_level": 3,
                               "grouped_gemm_backend": "torch"})
    torch.manual_seed(0)
    moe = MoE(cfg)
    moe.init_weights(0.02)
    d = cfg["d_model"]
    g = torch.Generator().manual_seed(1)
    c = torch.randn(d, generator=g)
    with torch.no_grad():
        moe.gate.weight.normal_(0, 0.5 / d ** 0.5, generator=g)
        moe.gate.weight[:2] += 2.0 * c / c.norm() ** 2
    return cfg, moe, c, g


def test_the_bias_evens_out_a_skewed_router_as_the_rule_says():
    rate = 0.01
    cfg, moe, c, g = _skewed_moe(rate)
    E, k = cfg["n_routed_experts"], cfg["top_k"]
    log = RoutingLog(SimpleNamespace(layers=[SimpleNamespace(is_moe=True, ffn=moe, layer_id=1)]), range(0))
    bal = RouterBias([moe], rate)
    bias, imbalance = [0.0] * E, []
    with log.active():
        for step in range(40):
            x = torch.randn(2048, cfg["d_model"], generator=g) + c
            # this step's choices in plain Python: the top_k of softmax score + the bias the layer holds
            s = (x.double() @ moe.gate.weight.detach().double().T).softmax(-1).tolist()
            ref = [0] * E
            for row in s:
                for e in sorted(range(E), key=lambda e: -(row[e] + bias[e]))[:k]:
                    ref[e] += 1
            with torch.no_grad():
                moe(x[None])
            counts = log.acc[0].tolist()
            assert sum(abs(a - b) for a, b in zip(counts, ref)) <= 2, (step, counts, ref)  # fp32 near-ties
            with HostSyncCounter() as counter:
                bal.step(log.acc)
            assert counter.events == [], counter.events  # the update adds no host sync
            log.end_step(step)
            mean = sum(counts) / E
            bias = [b + rate * _sign(mean - n) for b, n in zip(bias, counts)]
            assert moe.expert_bias.tolist() == pytest.approx(bias, abs=1e-6)
            imbalance.append(max(counts) / mean)
    assert imbalance[0] > 3.0  # the skew is real (4.0: every token's both choices are experts 0 and 1)
    assert sum(imbalance[-10:]) / 10 < 1.6, imbalance  # evened out, up to the rule's +-rate oscillation
    assert bal.updates == 40 and max(bias[:2]) < 0 < min(bias[2:])  # the hot experts pushed down


def test_no_rate_no_bias_buffer_and_the_balancer_does_nothing():
    cfg = load_config("tiny")
    model = Transformer(cfg)
    assert len(moe_layers(model)) == 2 and all(not hasattr(m, "expert_bias") for m in moe_layers(model))
    assert not any("expert_bias" in name for name in model.state_dict())
    bal = RouterBias(moe_layers(model), 0.0)
    assert not bal.active
    bal.step(torch.ones(2, cfg["n_routed_experts"], dtype=torch.int64))  # a no-op
    with pytest.raises(ValueError, match="expert_bias"):
        RouterBias(moe_layers(model), 0.1)  # a model built without the rate
    biased = Transformer(load_config("tiny", {"router_bias_update_rate": 0.01}))
    assert sum(name.endswith("expert_bias") for name in biased.state_dict()) == 2  # saved with the model


def _two_ranks(rank: int, store: str, out: str):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)

    class Layer(torch.nn.Module):
        balance_bias = True

        def __init__(self):
            super().__init__()
            self.register_buffer("expert_bias", torch.zeros(4))

    layers = [Layer(), Layer()]
    bal = RouterBias(layers, 0.25, dist.group.WORLD)
    loads = {0: [[[5, 1, 1, 1], [0, 0, 0, 0]], [[2, 2, 2, 2], [3, 0, 0, 1]]],
             1: [[[0, 3, 1, 0], [0, 0, 0, 0]], [[2, 2, 2, 2], [0, 4, 0, 0]]]}[rank]
    for step_load in loads:
        bal.step(torch.tensor(step_load, dtype=torch.int64))
    torch.save([m.expert_bias for m in layers], f"{out}.{rank}")
    dist.destroy_process_group()


def test_two_gloo_ranks_apply_the_rule_to_the_summed_load(tmp_path):
    mp.spawn(_two_ranks, args=(str(tmp_path / "store"), str(tmp_path / "bias")), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"bias.{r}") for r in (0, 1))
    for a, b in zip(r0, r1):
        assert torch.equal(a, b)
    # step 1 sums: layer 0 [5,4,2,1] (mean 3) -> [-,-,+,+]; layer 1 nothing routed -> unchanged
    # step 2 sums: layer 0 [4,4,4,4] -> 0; layer 1 [3,4,0,1] (mean 2) -> [-,-,+,+]
    assert r0[0].tolist() == [-0.25, -0.25, 0.25, 0.25]
    assert r0[1].tolist() == [-0.25, -0.25, 0.25, 0.25]


def test_the_trainer_records_the_bias_the_routing_file_implies(tmp_path):
    run, rate, steps = tmp_path / "bal", 0.01, 4
    r = subprocess.run([sys.executable, "-m", "trainer", "--config", "tiny", "--set", f"steps={steps}",
                        "--set", f"router_bias_update_rate={rate}", "--set", "profile_step_start=0",
                        "--set", f"profile_step_end={steps}", "-o", str(run)],
                       cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads((run / "manifest.json").read_text())
    doc = json.loads((run / "routing.json").read_text())
    assert m["toggles"]["router_bias_update_rate"] == rate
    got = m["router_bias"]
    assert got["rate"] == rate and got["updates"] == steps
    (rank,) = doc["ranks"]
    assert len(got["layers"]) == len(rank["layers"]) == 2
    for recorded, ly in zip(got["layers"], rank["layers"]):
        bias = [0.0] * doc["n_routed_experts"]
        for s in sorted(ly["steps"], key=lambda s: s["step"]):  # every step was profiled: all counts kept
            mean = sum(s["counts"]) / len(s["counts"])
            bias = [b + rate * _sign(mean - c) for b, c in zip(bias, s["counts"])]
        assert recorded["bias"] == pytest.approx(bias, abs=1e-7)
        assert recorded["max"] == pytest.approx(max(bias)) and recorded["min"] == pytest.approx(min(bias))


def test_impossible_settings_are_one_line_errors():
    with pytest.raises(ConfigError, match="router_bias_update_rate"):
        load_config("tiny", {"router_bias_update_rate": -0.1})
    with pytest.raises(ConfigError, match="all 3 layers are dense"):
        load_config("tiny", {"router_bias_update_rate": 0.01, "first_k_dense": 3})
