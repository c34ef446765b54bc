"""Dense building blocks: RMSNorm, rotary embeddings, GQA and MLA attention, SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def rope_cache(seq_len: int, dim: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    t = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv)  # [S, dim/2]
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, S, D] (rotate-half convention, as in the HF DeepSeek/Llama code)."""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d].float(), x[..., d:].float()
    c, s = cos[None, None], sin[None, None]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


class Attention(nn.Module):
    """Causal MHA/GQA with RoPE on scaled_dot_product_attention."""

    def __init__(self, cfg: dict):
        super().__init__()
        d = cfg["d_model"]
        self.n_heads = cfg["n_heads"]
        self.n_kv = cfg["n_kv_heads"] or self.n_heads
        self.hd = cfg["head_dim"] or d // self.n_heads
        self.wq = nn.Linear(d, self.n_heads * self.hd, bias=False)
        self.wk = nn.Linear(d, self.n_kv * self.hd, bias=False)
        self.wv = nn.Linear(d, self.n_kv * self.hd, bias=False)
        self.wo = nn.Linear(self.n_heads * self.hd, d, bias=False)
        self.rope_dim = self.hd

    def forward(self, x, cos, sin):
        B, S, _ = x.shape
        q = self.wq(x).view(B, S, self.n_heads, self.hd).transpose(1, 2)
        k = self.wk(x).view(B, S, self.n_kv, self.hd).transpose(1, 2)
        v = self.wv(x).view(B, S, self.n_kv, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.n_kv != self.n_heads:
            rep = self.n_heads // self.n_kv
            k = k.repeat_interleave(rep, dim=1)  # int repeats: no host sync
            v = v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(B, S, -1))


class MLAttention(nn.Module):
    """DeepSeek-V2 multi-head latent attention (training form, no weight absorption).

    KV are compressed to ``kv_lora_rank`` plus a shared RoPE key of ``qk_rope_head_dim``;
    q optionally through a ``q_lora_rank`` bottleneck.
    """

    def __init__(self, cfg: dict):
        super().__init__()
        d = cfg["d_model"]
        self.n_heads = cfg["n_heads"]
        self.nope, self.rope_dim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
        self.vd, self.kv_rank, self.q_rank = cfg["v_head_dim"], cfg["kv_lora_rank"], cfg["q_lora_rank"]
        qd = self.nope + self.rope_dim
        if self.q_rank:
            self.wq_a = nn.Linear(d, self.q_rank, bias=False)
            self.q_norm = RMSNorm(self.q_rank, cfg["rms_eps"])
            self.wq_b = nn.Linear(self.q_rank, self.n_heads * qd, bias=False)
        else:
            self.wq = nn.Linear(d, self.n_heads * qd, bias=False)
        self.wkv_a = nn.Linear(d, self.kv_rank + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(self.kv_rank, cfg["rms_eps"])
        self.wkv_b = nn.Linear(self.kv_rank, self.n_heads * (self.nope + self.vd), bias=False)
        self.wo = nn.Linear(self.n_heads * self.vd, d, bias=False)

    def forward(self, x, cos, sin):
        B, S, _ = x.shape
        H = self.n_heads
        q = self.wq_b(self.q_norm(self.wq_a(x))) if self.q_rank else self.wq(x)
        q = q.view(B, S, H, -1).transpose(1, 2)
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
        kv_a = self.wkv_a(x)
        c, k_pe = kv_a.split([self.kv_rank, self.rope_dim], dim=-1)
        k_pe = apply_rope(k_pe.unsqueeze(1), cos, sin)  # [B, 1, S, r] shared by all heads
        kv = self.wkv_b(self.kv_norm(c)).view(B, S, H, self.nope + self.vd).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.vd], dim=-1)
        q = torch.cat([q_nope, apply_rope(q_pe, cos, sin)], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(B, H, S, self.rope_dim)], dim=-1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(B, S, H * self.vd))


class SwiGLU(nn.Module):
    def __init__(self, d: int, ff: int):
        super().__init__()
        self.w1 = nn.Linear(d, ff, bias=False)
        self.w3 = nn.Linear(d, ff, bias=False)
        self.w2 = nn.Linear(ff, d, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
