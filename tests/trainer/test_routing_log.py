"""The routing counts the trainer writes (trainer/routing_log.py, RUN/routing.json).

* in process: the log's per-step and total counts equal the tokens per expert counted independently from
  each MoE forward's own router logits (plain Python top-k with the group limit), over micro-batches, with
  a recomputed layer counted once; and it adds no host sync to a step (level 3: none at all);
* 2 gloo ranks at EP 2 (``python -m trainer`` forked per rank, tests/trainer/_workers.py): routing.json holds
  both ranks, tied to the manifest's run_id, and each rank's dispatch split sizes in its own trace
  (`c10d::alltoall_base_`'s concrete inputs, read as raw JSON) are its counts summed per destination rank.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from moespec.config import load_config
from tests.trainer._workers import launch_module
from trainer.model import Transformer
from trainer.routing_log import RoutingLog, record_routing
from trainer.syncs import HostSyncCounter
from trainer.train import forward_backward


def _reference_counts(x: torch.Tensor, gate_w: torch.Tensor, cfg: dict) -> list[int]:
    """Tokens per expert of one MoE forward, from its input and gate weight: softmax scores, the best
    ``topk_group`` groups by their best expert, then the ``top_k`` best experts of those groups; per token
    in plain Python."""
    E, k, G, tg = cfg["n_routed_experts"], cfg["top_k"], cfg["n_group"], cfg["topk_group"]
    scores = (x.reshape(-1, x.shape[-1]).double() @ gate_w.double().T).softmax(-1).tolist()
    per = E // G
    out = [0] * E
    for s in scores:
        groups = sorted(range(G), key=lambda g: -max(s[g * per:(g + 1) * per]))[:tg]
        allowed = [e for g in groups for e in range(g * per, (g + 1) * per)]
        for e in sorted(allowed, key=lambda e: -s[e])[:k]:
            out[e] += 1
    return out


def _model(cfg):
    torch.manual_seed(0)
    m = Transformer(cfg)
    m.init_weights(0)
    return m


def test_counts_equal_an_independent_count_per_step_and_in_total():
    cfg = load_config("tiny", {"microbatches": 2, "recompute_layer_ids": [2]})
    model = _model(cfg)
    moes = {b.layer_id: b.ffn for b in model.layers if b.is_moe}
    assert sorted(moes) == [1, 2]
    ref: dict[int, list[int]] = {}

    def hook(layer):
        def pre(mod, args):
            if torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1:
                return  # the recompute in backward: the same tokens again
            c = _reference_counts(args[0].detach(), mod.gate.weight.detach(), cfg)
            ref[layer] = [a + b for a, b in zip(ref.get(layer, [0] * len(c)), c)]
        return pre

    handles = [m.register_forward_pre_hook(hook(lid)) for lid, m in moes.items()]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)  # weights change between steps: each step routes anew
    log = RoutingLog(model, range(1, 3))
    per_step, total = {}, {1: [0] * 8, 2: [0] * 8}
    with log.active():
        for step in range(4):
            ref.clear()
            tokens = torch.randint(0, cfg["vocab_size"], (2 * cfg["micro_batch_size"], cfg["seq_len"]),
                                   generator=torch.Generator().manual_seed(step))
            forward_backward(model, tokens, tokens, cfg, autocast=False)
            opt.step()
            opt.zero_grad()
            log.end_step(step)
            per_step[step] = {k: list(v) for k, v in ref.items()}
            for lid, t in total.items():
                total[lid] = [a + b for a, b in zip(t, ref[lid])]
    for h in handles:
        h.remove()
    rec = log.to_host(rank=0, ep_rank=0, ep_group=[0], pp_rank=0)
    assert [ly["layer"] for ly in rec["layers"]] == [1, 2]
    T, k = cfg["micro_batch_size"] * cfg["seq_len"], cfg["top_k"]
    for ly in rec["layers"]:
        lid = ly["layer"]
        assert ly["total"] == total[lid] and ly["total_forwards"] == 4 * 2
        assert [s["step"] for s in ly["steps"]] == [1, 2]
        for s in ly["steps"]:
            assert s["counts"] == per_step[s["step"]][lid]
            assert s["forwards"] == 2 and sum(s["counts"]) == 2 * T * k  # every token to top_k experts
    # nothing recorded once the log is no longer active
    record_routing(moes[1], torch.ones(8, dtype=torch.int64))
    assert log.to_host(0, 0, [0], 0)["layers"][0]["total"] == total[1]


@pytest.mark.parametrize("level,backend", [(3, "torch"), (0, "loop")])
def test_the_log_adds_no_host_sync_to_a_step(level, backend):
    cfg = load_config("tiny", {"sync_free_level": level, "grouped_gemm_backend": backend, "microbatches": 2})
    tokens = torch.randint(0, cfg["vocab_size"], (2 * cfg["micro_batch_size"], cfg["seq_len"]),
                           generator=torch.Generator().manual_seed(0))
    syncs = []
    for with_log in (False, True):
        model = _model(cfg)
        log = RoutingLog(model, range(1))
        with HostSyncCounter() as counter:
            if with_log:
                with log.active():
                    for step in range(2):  # a profiled step and another
                        forward_backward(model, tokens, tokens, cfg, autocast=False)
                        log.end_step(step)
            else:
                for step in range(2):
                    forward_backward(model, tokens, tokens, cfg, autocast=False)
        syncs.append(list(counter.events))
        if with_log:
            assert sum(log.to_host(0, 0, [0], 0)["layers"][0]["total"]) > 0  # it did record (after the counter)
    assert syncs[1] == syncs[0]
    if level == 3:
        assert syncs[1] == []


def _raw_input_splits(trace: Path, step: int) -> list[list[int]]:
    """The input split sizes of the token all-to-alls inside ProfilerStep#step, from the raw trace: the
    `c10d::alltoall_base_` ops of float rows (gloo writes no record_param_comms; the op's concrete inputs are
    output, input, group, output splits, input splits, ...)."""
    with gzip.open(trace, "rt") as f:
        ev = json.load(f)["traceEvents"]
    win = [(e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("name") == f"ProfilerStep#{step}"]
    assert win
    lo, hi = min(w[0] for w in win), max(w[1] for w in win)
    out = []
    for e in ev:
        a = e.get("args", {})
        if e.get("name") == "c10d::alltoall_base_" and a["Input type"][1] == "float" and lo <= e["ts"] <= hi:
            out.append(json.loads(a["Concrete Inputs"][4]))
    return out


@pytest.mark.slow
def test_two_gloo_ranks_write_a_routing_file_their_traces_agree_with(tmp_path):
    run = tmp_path / "ep2"
    # the trainer's 2 ranks forked from one process (tests/trainer/_workers.py): what is checked is what the ranks
    # write, not torchrun (trainer.launch's torchrun runs in test_readme's and test_bench_knobs's commands)
    r = launch_module("trainer", ["--config", "tiny", "--set", "ep=2", "--set", "steps=5", "--set", "profile_step_start=2",
                                  "--set", "profile_step_end=4", "--sync-free-level", "0", "-o", str(run)], nproc=2)
    assert r.returncode == 0, r.stderr[-4000:]
    m = json.loads((run / "manifest.json").read_text())
    doc = json.loads((run / "routing.json").read_text())
    assert m["routing"] == "routing.json" and len(m["run_id"]) == 32
    assert doc["run"] == {"run_id": m["run_id"], "name": "ep2", "created_utc": m["created_utc"]}
    assert doc["profiled_steps"] == [2, 3] and doc["steps"] == 5 and doc["ep"] == 2
    assert [x["rank"] for x in doc["ranks"]] == [0, 1]
    E, El = doc["n_routed_experts"], doc["n_routed_experts"] // 2
    for rec in doc["ranks"]:
        assert rec["ep_group"] == [0, 1] and rec["ep_rank"] == rec["rank"]
        assert [ly["layer"] for ly in rec["layers"]] == [1, 2]
        for step in (2, 3):
            splits = _raw_input_splits(run / "traces" / f"rank{rec['rank']}.json.gz", step)
            for ly in rec["layers"]:
                c = next(s for s in ly["steps"] if s["step"] == step)
                assert len(c["counts"]) == E and c["forwards"] == 1
                assert sum(c["counts"]) == doc["tokens_per_microbatch"] * doc["top_k"]
                want = [sum(c["counts"][p * El:(p + 1) * El]) for p in range(2)]
                assert want in splits, (rec["rank"], step, ly["layer"], want, splits)
        for ly in rec["layers"]:
            assert ly["total_forwards"] == 5
            assert sum(ly["total"]) == 5 * doc["tokens_per_microbatch"] * doc["top_k"]
