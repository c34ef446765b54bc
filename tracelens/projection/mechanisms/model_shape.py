"""The model's own shape (layers, widths, experts, heads, vocabulary, sequence length, the router's rule): refused.

Every kernel of the step is the model's: another width, depth, expert count or sequence length changes the shapes
(and so the times) of kernels this trace only shows at the run's shapes, and another router rule (``top_k``,
``score_func``, group-limited routing) changes the routing itself. No measured ratio carries one model's trace to
another's; the memory projection (``tracelens memory``) answers the memory side without a trace.
"""

from __future__ import annotations

from .base import Mechanism, register

MODEL_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "attn_type", "q_lora_rank",
              "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "d_ff", "moe_d_ff",
              "n_routed_experts", "n_shared_experts", "top_k", "score_func", "n_group", "topk_group", "first_k_dense",
              "tie_embeddings", "seq_len")


@register
class ModelShape(Mechanism):
    name = "model_shape"
    keys = MODEL_KEYS
    order = 200.0
    summary = "refused: another model's kernels are not in this trace"
    refuses = ("another model: its kernels' shapes (and its routing) are not in this run's trace; profile that model "
               "(`tracelens memory CONFIG` projects its memory without one)")
