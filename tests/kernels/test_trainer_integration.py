"""The trainer on the real Triton kernels (CPU, Triton's interpreter): grouped_gemm_backend=triton and
auto, and use_triton_kernels (fused router, sync-free permute/unpermute, fused cross-entropy).

Every expectation comes from the trainer's own PyTorch paths (the per-expert loop backend, the
PyTorch router and permutation, ``F.cross_entropy``) or from the cache file written in the test.
Shapes are tiny: the interpreter runs each Triton program in Python.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import kernels
from kernels import backends as B
from moespec.config import load_config
from trainer.model import Transformer, experts
from trainer.model.moe import MoE
from trainer.syncs import HostSyncCounter

from .conftest import assert_close

# 1 dense + 1 MoE layer, 16 tokens per step: 32 (token, slot) rows over 8 experts
SMALL = {"n_layers": 2, "first_k_dense": 1, "micro_batch_size": 1, "seq_len": 16, "steps": 2, "log_every": 0,
         "profile_step_end": 0, "timing_warmup_steps": 0}


@pytest.fixture(autouse=True)
def _fresh(needs_triton):
    B.clear_cache()
    experts.reset_records()
    experts.reset_notes()
    yield
    B.clear_cache()


def _train(tmp_path, name, **over):
    from trainer.train import train

    cfg = load_config("tiny", {**SMALL, **over})
    return train(cfg, tmp_path / name)


@pytest.fixture(scope="module")
def loop_run(tmp_path_factory):
    """The reference run: per-expert loop GEMMs, PyTorch router/permutation/loss, sync-free level 0."""
    from trainer.train import train

    return train(load_config("tiny", SMALL), tmp_path_factory.mktemp("loop") / "run")


def _same_training(got: dict, want: dict) -> None:
    """The first steps of ``got`` have the losses and gradient norms of the reference run."""
    g, w = got["metrics"], want["metrics"]
    n = len(g["loss"])
    assert n >= 1 and len(w["loss"]) >= n
    for key in ("loss", "aux_loss", "grad_norm"):
        assert g[key] == pytest.approx(w[key][:n], rel=2e-5, abs=2e-6), key


def test_triton_backend_and_kernels_train_like_the_loop_backend(tmp_path, loop_run, monkeypatch):
    calls = {"grouped_mm": 0, "fused_router": 0, "permute": 0, "unpermute": 0, "linear_cross_entropy": 0}
    for name in calls:
        orig = getattr(kernels, name)

        def spy(*a, _orig=orig, _name=name, **k):
            calls[_name] += 1
            return _orig(*a, **k)

        monkeypatch.setattr(kernels, name, spy)
    m = _train(tmp_path, "triton", grouped_gemm_backend="triton", use_triton_kernels=True, loss_fusion=True,
               loss_chunk_size=8, sync_free_level=2)
    _same_training(m, loop_run)
    # one MoE layer x 2 steps: 2 grouped GEMMs, one router, permute, unpermute per step; loss once per step
    assert calls == {"grouped_mm": 4, "fused_router": 2, "permute": 2, "unpermute": 2, "linear_cross_entropy": 2}
    ops = m["kernels"]["ops"]
    assert ops == {"grouped_gemm": "kernels.grouped_mm (Triton, CPU interpreter)", "router": "kernels.fused_router",
                   "permute": "kernels.permute / kernels.unpermute", "loss": "kernels.linear_cross_entropy"}
    assert m["notes"] == []
    assert loop_run["kernels"]["ops"] == {} and loop_run["kernels"]["auto_choices"] == []


def test_auto_uses_the_cached_winner_per_pass_and_records_it(tmp_path, loop_run, monkeypatch):
    # rows = 16 tokens x top-2 = 32; up-projection K=d_model=64, N=2*moe_d_ff=64; down K=32, N=64; E=8
    want = {(64, 64): {"fwd": "triton", "dx": "loop", "dw": "triton"},
            (32, 64): {"fwd": "loop", "dx": "triton", "dw": "loop"}}
    entries = {}
    for (K, N), per_pass in want.items():
        for p, winner in per_pass.items():
            other = "loop" if winner == "triton" else "triton"
            entries[f"cpu|float32|T32|K{K}|N{N}|E8|{p}"] = {
                "backend": winner, "ms": 1.0, "times_ms": {winner: 1.0, other: 2.0}, "tuned_at": "test"}
    B.cache_path().parent.mkdir(parents=True, exist_ok=True)
    B.cache_path().write_text(json.dumps({"version": 1, "entries": entries}))
    monkeypatch.setattr(B, "tune", lambda *a, **k: pytest.fail("auto re-tuned a cached shape"))
    used = []
    orig = B.run_pass

    def spy(name, pass_, a, b, offs, host_offs=None):
        used.append((pass_, a.shape[1], name, host_offs is not None))
        return orig(name, pass_, a, b, offs, host_offs)

    monkeypatch.setattr(B, "run_pass", spy)
    from kernels import grouped_gemm as G

    dw_direct, orig_dw = [], G.grouped_mm_dw_triton

    def spy_dw(x, dy, offs, out=None):
        dw_direct.append(x.shape[1])
        return orig_dw(x, dy, offs, out=out)

    monkeypatch.setattr(G, "grouped_mm_dw_triton", spy_dw)
    m = _train(tmp_path, "auto", grouped_gemm_backend="auto", sync_free_level=1, steps=1)
    _same_training(m, loop_run)
    choices = {(c["K"], c["N"]): c for c in m["kernels"]["auto_choices"]}
    assert set(choices) == set(want)
    for kn, per_pass in want.items():
        c = choices[kn]
        assert {p: c[p] for p in ("fwd", "dx", "dw")} == per_pass
        assert c["source"] == "cache" and c["rows_bucket"] == 32 and c["dtype"] == "float32"
        assert c["candidates"] == ["triton", "loop"] and c["sync_free"] is False
    # the passes really ran on those backends, and at level 1 every pass got the host counts, so the
    # loop passes never read the offsets back
    assert {name for p, k, name, _ in used if p == "fwd" and k == 64} == {"triton"}
    assert {name for p, k, name, _ in used if p == "fwd" and k == 32} == {"loop"}
    assert {name for p, _, name, _ in used if p == "dx"} == {"loop", "triton"}
    assert all(host for *_, host in used)
    # 2 GEMMs x 3 passes; a triton dW is written straight into the weight's layout by
    # grouped_mm_dw_triton rather than through run_pass: the up-projection's dW
    assert len(used) == 2 * 3 - 1 and dw_direct == [64]


def test_auto_tunes_missing_shapes_before_the_first_step(tmp_path, loop_run):
    assert not B.cache_path().exists()
    m = _train(tmp_path, "auto_tune", grouped_gemm_backend="auto", sync_free_level=0, steps=1)
    _same_training(m, loop_run)
    entries = json.loads(B.cache_path().read_text())["entries"]
    keys = {f"cpu|float32|T32|K{K}|N{N}|E8|{p}" for K, N in ((64, 64), (32, 64)) for p in B.PASSES}
    assert set(entries) == keys
    for c in m["kernels"]["auto_choices"]:
        assert c["source"] == "cache"
        for p in B.PASSES:
            times = entries[f"cpu|float32|T32|K{c['K']}|N{c['N']}|E8|{p}"]["times_ms"]
            assert set(times) == {"triton", "loop"} and all(t > 0 for t in times.values())
            assert c[p] == min(times, key=times.get)  # the fastest one, read from the file


def test_auto_at_device_offsets_only_considers_sync_free_backends(tmp_path, loop_run):
    # a cache that says loop is fastest: at sync_free_level 2 it must not be used (it reads offs back)
    entries = {f"cpu|float32|T32|K{K}|N{N}|E8|{p}": {"backend": "loop", "ms": 1.0,
                                                     "times_ms": {"loop": 1.0, "triton": 5.0}, "tuned_at": "test"}
               for K, N in ((64, 64), (32, 64)) for p in B.PASSES}
    B.cache_path().parent.mkdir(parents=True, exist_ok=True)
    B.cache_path().write_text(json.dumps({"version": 1, "entries": entries}))
    m = _train(tmp_path, "auto_l2", grouped_gemm_backend="auto", sync_free_level=2, steps=1)
    _same_training(m, loop_run)
    for c in m["kernels"]["auto_choices"]:
        assert c["sync_free"] is True and c["candidates"] == ["triton"]
        assert (c["fwd"], c["dx"], c["dw"], c["source"]) == ("triton", "triton", "triton", "only")


def _model_syncs(level: int, **over):
    cfg = load_config("tiny", {**SMALL, "sync_free_level": level, **over})
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights(0)
    tokens = torch.randint(0, cfg["vocab_size"], (1, cfg["seq_len"]))
    with HostSyncCounter() as counter:
        loss, aux = model(tokens, tokens)
        (loss + cfg["aux_loss_coef"] * aux).backward()
    return counter


@pytest.mark.parametrize("level", [0, 2])
def test_kernel_paths_keep_the_sync_counts_of_each_level(level):
    c = _model_syncs(level, grouped_gemm_backend="triton", use_triton_kernels=True, loss_fusion=True)
    assert c.total == c.moe_total  # the fused loss does not sync either
    # level 0: the tokens-per-expert read in the permutation, once for the one MoE layer; level 2: none
    assert dict(c.by_stage) == ({"permute": 1} if level == 0 else {})


def _moe_pair(**over):
    """The same MoE layer (same weights, same input) with and without use_triton_kernels: outputs,
    aux loss and gradients of both. The expert GEMMs are the per-expert loop in both (level 0)."""
    cfg = load_config("tiny", {**SMALL, **over})
    g = torch.Generator().manual_seed(0)
    ref = MoE(dict(cfg, use_triton_kernels=False))
    with torch.no_grad():
        for prm in ref.parameters():
            prm.copy_(torch.randn(prm.shape, generator=g) * 0.3)  # a spread router: top-k far from ties
    fused = MoE(dict(cfg, use_triton_kernels=True))
    fused.load_state_dict(ref.state_dict())
    x = torch.randn(1, 16, cfg["d_model"], generator=g)
    out = []
    for layer in (ref, fused):
        xi = x.clone().requires_grad_(True)
        y, aux = layer(xi)
        gy = torch.linspace(-1, 1, y.numel()).view_as(y)
        ((y * gy).sum() + 3.0 * aux).backward()
        out.append((y.detach(), aux.detach(), xi.grad, layer.gate.weight.grad, layer.experts.w13.grad,
                    layer.experts.w2.grad))
    return out


@pytest.mark.parametrize("route", [
    {"score_func": "softmax", "n_group": 2, "topk_group": 1},  # tiny.yaml: group-limited softmax
    {"score_func": "sigmoid", "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5},
    {"score_func": "softmax", "n_group": 1, "topk_group": 1, "norm_topk_prob": True},
], ids=["softmax-groups", "sigmoid", "softmax-norm"])
def test_fused_router_and_permutation_match_the_pytorch_moe_layer(route):
    ref, got = _moe_pair(**route)
    for name, a, b in zip(("y", "aux", "dx", "dgate", "dw13", "dw2"), got, ref):
        assert_close(a, b, torch.float32, name)  # max error relative to the largest magnitude: 1e-4
    assert experts.KERNEL_USE["router"] == "kernels.fused_router"


def test_sigmoid_group_routing_keeps_the_pytorch_router_with_a_note(caplog):
    # DeepSeek-V3 style: sigmoid scores, groups scored by their top-2 sum -- not the fused router's rule
    ref, got = _moe_pair(score_func="sigmoid", n_group=2, topk_group=1)
    for name, a, b in zip(("y", "aux", "dx", "dgate", "dw13", "dw2"), got, ref):
        assert_close(a, b, torch.float32, name)
    assert experts.KERNEL_USE["router"] == "trainer.model.moe.route"
    assert experts.KERNEL_USE["permute"] == "kernels.permute / kernels.unpermute"
    assert any("sigmoid routing with groups" in r.getMessage() for r in caplog.records)


def test_fused_loss_equals_cross_entropy_of_the_full_logits():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(20, 16, generator=g, requires_grad=True)
    w = (torch.randn(40, 16, generator=g) * 0.3).requires_grad_(True)
    t = torch.randint(0, 40, (20,), generator=g)
    from trainer.model.transformer import kernel_cross_entropy

    loss = kernel_cross_entropy(h, w, t, chunk=8)
    loss.backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    # by hand: mean over rows of logsumexp(logits) - logit[target]
    logits = h @ w.t()
    want = (torch.logsumexp(logits, 1) - logits.gather(1, t[:, None])[:, 0]).mean()
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    torch.testing.assert_close(gh, h.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, w.grad, rtol=1e-5, atol=1e-6)
    assert math.isfinite(loss.item())


# ---------------------------------------------------------------------------------------- expert_swiglu
def test_expert_swiglu_triton_trains_like_the_eager_activation(tmp_path, loop_run, monkeypatch):
    """expert_swiglu=triton (the fused kernel, interpreted) against the reference run, which differs only
    in the activation: same loss, aux loss and gradient norm per step; one kernels.swiglu call per MoE
    layer and step; the manifest names what ran."""
    calls = []
    orig = kernels.swiglu

    def spy(h, *a, **k):
        calls.append(tuple(h.shape))
        return orig(h, *a, **k)

    monkeypatch.setattr(kernels, "swiglu", spy)
    m = _train(tmp_path, "swiglu", expert_swiglu="triton")
    _same_training(m, loop_run)
    cfg = load_config("tiny", SMALL)
    rows = cfg["micro_batch_size"] * cfg["seq_len"] * cfg["top_k"]
    assert calls == [(rows, 2 * cfg["moe_d_ff"])] * 2  # 1 MoE layer x 2 steps, h = [T*k, 2F]
    assert m["kernels"]["expert_swiglu"] == "triton"
    assert m["kernels"]["ops"]["expert_swiglu"] == "kernels.swiglu (Triton, CPU interpreter)"
    assert m["notes"] == []


def test_expert_swiglu_moe_layer_gradients_match_eager():
    """One MoE layer on the torch grouped-GEMM path at level 3 (the benchmark's setting) with the fused
    and the eager activation: output and every gradient agree (fp32)."""
    cfg = load_config("tiny", {**SMALL, "grouped_gemm_backend": "torch", "sync_free_level": 3})
    g = torch.Generator().manual_seed(0)
    ref = MoE(dict(cfg, expert_swiglu="torch"))
    with torch.no_grad():
        for prm in ref.parameters():
            prm.copy_(torch.randn(prm.shape, generator=g) * 0.3)
    fused = MoE(dict(cfg, expert_swiglu="triton"))
    fused.load_state_dict(ref.state_dict())
    x = torch.randn(1, 16, cfg["d_model"], generator=g)
    res = []
    for layer in (ref, fused):
        xi = x.clone().requires_grad_(True)
        y, aux = layer(xi)
        ((y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum() + aux).backward()
        res.append((y.detach(), xi.grad, layer.gate.weight.grad, layer.experts.w13.grad, layer.experts.w2.grad))
    for name, a, b in zip(("y", "dx", "dgate", "dw13", "dw2"), res[1], res[0]):
        assert_close(a, b, torch.float32, name)
    assert experts.KERNEL_USE["expert_swiglu"] == "kernels.swiglu (Triton, CPU interpreter)"


def test_expert_swiglu_triton_is_refused_where_triton_cannot_run(tmp_path, monkeypatch):
    """Without Triton on the run's device (a CPU without the interpreter) the run stops before it starts,
    with one line naming the key, and writes no run dir."""
    from moespec.config import ConfigError
    from trainer.train import train

    monkeypatch.setattr(experts, "kernels_can_run", lambda t: False)
    with pytest.raises(ConfigError) as err:
        train(load_config("tiny", {**SMALL, "expert_swiglu": "triton"}), tmp_path / "refused")
    msg = str(err.value)
    assert msg.startswith("config error: expert_swiglu: triton needs Triton on this run's device (cpu)"), msg
    assert "\n" not in msg
    assert not (tmp_path / "refused").exists()


def test_expert_swiglu_refusal_names_a_missing_triton(monkeypatch):
    """Without triton at all the reason is the missing package, not the device."""
    monkeypatch.setattr(kernels, "HAS_TRITON", False)
    assert experts.swiglu_problem("cpu") == "needs triton, which is not importable here (pip install triton)"
    monkeypatch.undo()
    assert experts.swiglu_problem("cpu") is None  # the interpreter runs it here
