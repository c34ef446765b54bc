"""Parameter counts and model FLOPs per token of a trainer config (flat keys, ``moespec.config``).

The counts are of the model ``trainer/model`` builds: per decoder layer an attention block (GQA/MHA:
``wq``, ``wk``, ``wv``, ``wo``; MLA: the low-rank q and kv projections and ``wo``) with two RMSNorms, then
a dense SwiGLU FFN (the first ``first_k_dense`` layers) or an MoE block (router, shared and routed SwiGLU
experts, each ``3 * d_model * moe_d_ff``); the embedding and the LM head (tied or not) and a final norm.
The trainer records them in the manifest and divides by them for MFU; the analyzer uses them for the
memory projection, the automatic pipeline layout's cost model and the what-if. Standard library only.
"""

from __future__ import annotations


def attention_dims(c: dict) -> tuple[int, int]:
    """(query/key head dim, value head dim) of the attention scores."""
    if c["attn_type"] == "mla":
        return c["qk_nope_head_dim"] + c["qk_rope_head_dim"], c["v_head_dim"]
    hd = c["head_dim"] or c["d_model"] // c["n_heads"]
    return hd, hd


def attention_params(c: dict) -> int:
    """Matmul weights of one attention block (as trainer/model/layers.py builds it)."""
    d, H = c["d_model"], c["n_heads"]
    if c["attn_type"] == "mla":
        qd = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
        qr = c["q_lora_rank"]
        q = d * qr + qr * H * qd if qr else d * H * qd
        kv_a = d * (c["kv_lora_rank"] + c["qk_rope_head_dim"])
        kv_b = c["kv_lora_rank"] * H * (c["qk_nope_head_dim"] + c["v_head_dim"])
        return q + kv_a + kv_b + H * c["v_head_dim"] * d
    hd = c["head_dim"] or d // H
    kv = c["n_kv_heads"] or H
    return d * H * hd + 2 * d * kv * hd + H * hd * d  # wq, wk, wv, wo


def expert_params(c: dict) -> int:
    """Matmul weights of one expert (routed or shared): SwiGLU gate, up and down, ``3 * d_model * moe_d_ff``."""
    return 3 * c["d_model"] * c["moe_d_ff"]


def moe_active_params(c: dict) -> int:
    """Matmul weights of one MoE layer a token runs through: its ``top_k`` routed experts, the shared
    experts and the router."""
    return (c["top_k"] + c["n_shared_experts"]) * expert_params(c) + c["d_model"] * c["n_routed_experts"]


def layer_params(c: dict, layer: int) -> dict[str, int]:
    """Parameters of one decoder layer by part: attention (+ its norms), dense FFN or MoE parts."""
    d = c["d_model"]
    norms = 2 * d + (c["kv_lora_rank"] + (c["q_lora_rank"] or 0) if c["attn_type"] == "mla" else 0)
    out = {"attention": attention_params(c), "norms": norms, "dense_ffn": 0, "router": 0, "shared": 0, "experts": 0}
    if layer < c["first_k_dense"]:
        out["dense_ffn"] = 3 * d * c["d_ff"]
    else:
        out["router"] = d * c["n_routed_experts"]
        out["shared"] = expert_params(c) * c["n_shared_experts"]
        out["experts"] = c["n_routed_experts"] * expert_params(c)
    return out


def count_params(c: dict) -> dict:
    """Total and per-token-active parameter counts (matmul weights; norms included in total)."""
    d, L, V = c["d_model"], c["n_layers"], c["vocab_size"]
    n_dense, n_moe = c["first_k_dense"], L - c["first_k_dense"]
    attn = attention_params(c)
    dense_ffn = 3 * d * c["d_ff"]
    expert = expert_params(c)
    moe_total = c["n_routed_experts"] * expert + c["n_shared_experts"] * expert + d * c["n_routed_experts"]
    moe_active = moe_active_params(c)
    emb = V * d * (1 if c["tie_embeddings"] else 2)
    norms = L * 2 * d + d
    if c["attn_type"] == "mla":
        norms += L * (c["kv_lora_rank"] + (c["q_lora_rank"] or 0))
    total = L * attn + n_dense * dense_ffn + n_moe * moe_total + emb + norms
    active = L * attn + n_dense * dense_ffn + n_moe * moe_active + emb + norms
    return {"total": total, "active": active, "embedding": emb, "norms": norms,
            "routed_experts": n_moe * c["n_routed_experts"] * expert}


def total_params(c: dict) -> int:
    """All parameters of the model (each counted once), from `layer_params`; equals
    ``count_params(c)["total"]`` (tested)."""
    V, d = c["vocab_size"], c["d_model"]
    body = sum(sum(layer_params(c, i).values()) for i in range(c["n_layers"]))
    return body + V * d * (1 if c["tie_embeddings"] else 2) + d


def attention_score_flops(c: dict) -> float:
    """Training FLOPs per token of one layer's causal attention scores, ``3 * S * H * (d_qk + d_v)``
    (QK^T and PV: forward 1x + backward 2x, halved by causality)."""
    dqk, dv = attention_dims(c)
    return 3.0 * c["seq_len"] * c["n_heads"] * (dqk + dv)


def model_flops_per_token(c: dict) -> float:
    """Training FLOPs per token: 6 x active matmul params (incl. LM head, not the embedding lookup)
    plus causal attention scores 3 * S * H * (d_qk + d_v) per layer (fwd 1x + bwd 2x, halved by causality)."""
    d, L, V = c["d_model"], c["n_layers"], c["vocab_size"]
    p = count_params(c)
    matmul_active = p["active"] - p["embedding"] + V * d - p["norms"]
    return 6.0 * matmul_active + L * attention_score_flops(c)
