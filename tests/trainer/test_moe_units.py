"""Router, aux loss, permutation and the MoE layer against a naive per-token reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moespec.config import load_config
from moespec.params import count_params, model_flops_per_token
from trainer.data import MemmapData, SyntheticData
from trainer.model.moe import MoE, expert_counts, load_balance_loss, permutation, route
from trainer.model.transformer import cross_entropy


def test_softmax_topk_matches_manual():
    torch.manual_seed(0)
    logits = torch.randn(32, 8)
    idx, w, scores = route(logits, top_k=2, score_func="softmax")
    p = logits.softmax(-1)
    ref_w, ref_idx = p.topk(2, dim=-1)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(w, ref_w)
    torch.testing.assert_close(scores, p)
    idx_n, w_n, _ = route(logits, top_k=2, score_func="softmax", norm_topk_prob=True, routed_scaling_factor=2.5)
    torch.testing.assert_close(w_n.sum(-1), torch.full((32,), 2.5))


def test_sigmoid_weights_are_normalised():
    logits = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    idx, w, scores = route(logits, top_k=3, score_func="sigmoid", routed_scaling_factor=2.0)
    torch.testing.assert_close(w.sum(-1), torch.full((16,), 2.0))
    torch.testing.assert_close(scores, logits.sigmoid())
    assert torch.equal(idx, logits.topk(3, dim=-1).indices)


def test_group_limited_topk_stays_in_selected_groups():
    torch.manual_seed(2)
    T, E, G, TG, k = 64, 16, 4, 2, 3
    logits = torch.randn(T, E)
    idx, _, scores = route(logits, top_k=k, score_func="softmax", n_group=G, topk_group=TG)
    best_groups = scores.view(T, G, E // G).amax(-1).topk(TG, dim=-1).indices
    for t in range(T):
        allowed = {int(g) * (E // G) + j for g in best_groups[t] for j in range(E // G)}
        assert set(idx[t].tolist()) <= allowed
        # and they are the best k experts among the allowed ones
        cand = sorted(allowed, key=lambda e: -scores[t, e].item())[:k]
        assert set(idx[t].tolist()) == set(cand)
    # with one group per token the choice differs from unconstrained top-k for some tokens
    idx_free, _, _ = route(logits, top_k=k, score_func="softmax")
    assert not torch.equal(idx.sort(-1).values, idx_free.sort(-1).values)


def test_counts_and_aux_loss():
    idx = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 1]])
    counts = expert_counts(idx, 4)
    assert counts.tolist() == [3, 3, 1, 1]
    # uniform probabilities + perfectly balanced counts -> aux == 1
    scores = torch.full((4, 4), 0.25)
    assert load_balance_loss(scores, torch.tensor([2, 2, 2, 2]), 2, "softmax").item() == pytest.approx(1.0)
    # imbalance raises it: f = counts * E / (T*k) = [1.5, 1.5, .5, .5]; P = .25 -> 1.0 ... use skewed P
    p = torch.tensor([[0.7, 0.1, 0.1, 0.1]] * 4)
    expected = sum(c * 4 / 8 * pi for c, pi in zip([3, 3, 1, 1], [0.7, 0.1, 0.1, 0.1]))
    assert load_balance_loss(p, counts, 2, "softmax").item() == pytest.approx(expected)


def test_permutation_sorts_and_inverts():
    idx = torch.tensor([[3, 0], [1, 3], [0, 2], [2, 1]])
    order, inverse, sorted_exp = permutation(idx)
    flat = idx.reshape(-1)
    assert sorted_exp.tolist() == sorted(flat.tolist())
    assert torch.equal(flat[order], sorted_exp)
    assert torch.equal(order[inverse], torch.arange(8))
    # stable: equal experts keep (token, slot) order
    for e in range(4):
        pos = order[sorted_exp == e].tolist()
        assert pos == sorted(pos)


def _naive_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Per token, per chosen expert, straight from the definition."""
    c = moe.cfg
    T, D = x.shape[0] * x.shape[1], x.shape[2]
    xf = x.reshape(T, D)
    idx, w, _ = route(F.linear(xf, moe.gate.weight), top_k=c["top_k"], score_func=c["score_func"],
                      n_group=c["n_group"], topk_group=c["topk_group"], norm_topk_prob=c["norm_topk_prob"],
                      routed_scaling_factor=c["routed_scaling_factor"])
    out = torch.zeros_like(xf)
    for t in range(T):
        for j in range(c["top_k"]):
            e = int(idx[t, j])
            h = moe.experts.w13[e] @ xf[t]
            g, u = h.chunk(2)
            out[t] += w[t, j] * (moe.experts.w2[e] @ (F.silu(g) * u))
    return (out + moe.shared(xf)).view_as(x)


@pytest.mark.parametrize("level", [0, 1, 2, 3])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_moe_layer_matches_naive_reference(level, score_func):
    cfg = load_config("tiny", {"sync_free_level": level, "score_func": score_func, "grouped_gemm_backend": "torch"})
    torch.manual_seed(3)
    moe = MoE(cfg)
    for p in moe.parameters():
        p.data.normal_(0, 0.2)
    x = torch.randn(2, 8, cfg["d_model"])
    y, aux = moe(x)
    with torch.no_grad():
        ref = _naive_moe(moe, x)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-5)
    assert aux.item() > 0.5  # ~1 at balance, larger when skewed


def test_chunked_cross_entropy_equals_full():
    torch.manual_seed(4)
    h = torch.randn(100, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    t = torch.randint(0, 50, (100,))
    full = cross_entropy(h, w, t, fused=False, chunk=7)
    full.backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    fused = cross_entropy(h, w, t, fused=True, chunk=7)
    fused.backward()
    torch.testing.assert_close(fused, full)
    torch.testing.assert_close(h.grad, gh)
    torch.testing.assert_close(w.grad, gw)


def test_synthetic_data_is_deterministic_and_learnable(tmp_path):
    cfg = load_config("tiny")
    a, b = SyntheticData(cfg, rank=0), SyntheticData(cfg, rank=0)
    x1, y1 = a.batch(5)
    x2, y2 = b.batch(5)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])
    assert x1.shape == (cfg["micro_batch_size"], cfg["seq_len"])
    assert not torch.equal(SyntheticData(cfg, rank=1).batch(5)[0], x1)
    # bigram structure: >= 90% of transitions are one of the 4 successors
    ok = sum(int(y1[i, t]) in set(a.succ[int(x1[i, t])].tolist()) for i in range(x1.shape[0]) for t in range(x1.shape[1]))
    assert ok / x1.numel() > 0.9


def test_memmap_data(tmp_path):
    path = tmp_path / "tokens.bin"
    toks = (np.arange(5000) % 97).astype(np.uint16)
    toks.tofile(path)
    cfg = load_config("tiny", {"data": "memmap", "data_path": str(path)})
    x, y = MemmapData(cfg, rank=0).batch(0)
    assert x.shape == (cfg["micro_batch_size"], cfg["seq_len"])
    assert torch.equal((x + 1) % 97, y)  # consecutive tokens of the file


def test_flops_and_params_of_deepseek_v2_lite():
    cfg = load_config("deepseek_v2_lite")
    p = count_params(cfg)
    # DeepSeek-V2-Lite: 15.7B total, 2.4B active (model card)
    assert 15.0e9 < p["total"] < 16.5e9
    assert 2.2e9 < p["active"] < 2.8e9
    fpt = model_flops_per_token(cfg)
    assert fpt > 6 * 2.0e9
    assert math.isfinite(fpt)


@pytest.mark.parametrize("overrides", [
    {"attn_type": "mla", "q_lora_rank": 16, "n_kv_heads": None},
    {"attn_type": "mla", "q_lora_rank": None, "n_kv_heads": None},
    {"tie_embeddings": True, "first_k_dense": 0},
    {"n_kv_heads": 4, "score_func": "sigmoid", "n_group": 4, "topk_group": 2, "n_shared_experts": 0},
])
def test_model_variants_train_a_step(overrides):
    from trainer.model import Transformer

    cfg = load_config("tiny", overrides)
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights(0)
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == count_params(cfg)["total"]
    if cfg["tie_embeddings"]:
        assert model.head is None and model.output_weight() is model.embed.weight
    tokens = torch.randint(0, cfg["vocab_size"], (2, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        loss, aux = model(tokens, tokens.roll(-1, 1))
        (loss + 0.01 * aux).backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses
    assert model(tokens).shape == (2, 16, cfg["vocab_size"])
