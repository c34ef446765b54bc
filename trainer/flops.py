"""Parameter counts, model FLOPs per token and the device bf16 peak table (no torch import)."""

from __future__ import annotations

# Dense bf16 tensor-core peak, FLOP/s, by a substring of torch.cuda.get_device_name(). The one place
# MFU's denominator comes from. Order matters: the first matching substring wins.
BF16_PEAK_FLOPS = [
    ("H200", 989.4e12),        # H200 SXM (same SM config as H100 SXM)
    ("H100 PCIe", 756.0e12),
    ("H100 NVL", 835.0e12),
    ("H100", 989.4e12),        # H100 SXM5
    ("H800", 989.4e12),
    ("GH200", 989.4e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("MI300X", 1307.4e12),
    ("MI325X", 1307.4e12),
    ("MI250", 362.1e12),
]


def peak_bf16_flops(device_name: str | None) -> float | None:
    if not device_name:
        return None
    for key, peak in BF16_PEAK_FLOPS:
        if key.lower() in device_name.lower():
            return peak
    return None


def _attn_params(c: dict) -> int:
    d, H = c["d_model"], c["n_heads"]
    if c["attn_type"] == "mla":
        qd = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
        q = d * c["q_lora_rank"] + c["q_lora_rank"] * H * qd if c["q_lora_rank"] else d * H * qd
        kv = (d * (c["kv_lora_rank"] + c["qk_rope_head_dim"])
              + c["kv_lora_rank"] * H * (c["qk_nope_head_dim"] + c["v_head_dim"]))
        return q + kv + H * c["v_head_dim"] * d
    hd = c["head_dim"] or d // H
    kv = c["n_kv_heads"] or H
    return d * H * hd * 2 + 2 * d * kv * hd


def _attn_dims(c: dict) -> tuple[int, int]:
    if c["attn_type"] == "mla":
        return c["qk_nope_head_dim"] + c["qk_rope_head_dim"], c["v_head_dim"]
    hd = c["head_dim"] or c["d_model"] // c["n_heads"]
    return hd, hd


def count_params(c: dict) -> dict:
    """Total and per-token-active parameter counts (matmul weights; norms included in total)."""
    d, L, V = c["d_model"], c["n_layers"], c["vocab_size"]
    n_dense, n_moe = c["first_k_dense"], L - c["first_k_dense"]
    attn = _attn_params(c)
    dense_ffn = 3 * d * c["d_ff"]
    expert = 3 * d * c["moe_d_ff"]
    moe_total = c["n_routed_experts"] * expert + c["n_shared_experts"] * expert + d * c["n_routed_experts"]
    moe_active = c["top_k"] * expert + c["n_shared_experts"] * expert + d * c["n_routed_experts"]
    emb = V * d * (1 if c["tie_embeddings"] else 2)
    norms = L * 2 * d + d
    if c["attn_type"] == "mla":
        norms += L * (c["kv_lora_rank"] + (c["q_lora_rank"] or 0))
    total = L * attn + n_dense * dense_ffn + n_moe * moe_total + emb + norms
    active = L * attn + n_dense * dense_ffn + n_moe * moe_active + emb + norms
    return {"total": total, "active": active, "embedding": emb, "norms": norms,
            "routed_experts": n_moe * c["n_routed_experts"] * expert}


def model_flops_per_token(c: dict) -> float:
    """Training FLOPs per token: 6 x active matmul params (incl. LM head, not the embedding lookup)
    plus causal attention scores 3 * S * H * (d_qk + d_v) per layer (fwd 1x + bwd 2x, halved by causality)."""
    d, L, V, S, H = c["d_model"], c["n_layers"], c["vocab_size"], c["seq_len"], c["n_heads"]
    p = count_params(c)
    matmul_active = p["active"] - p["embedding"] + V * d - p["norms"]
    dqk, dv = _attn_dims(c)
    return 6.0 * matmul_active + L * 3.0 * S * H * (dqk + dv)
