"""DeepSeek-style MoE decoder: RMSNorm, RoPE attention (MHA/GQA/MLA), routed + shared experts."""

from trainer.model.transformer import Transformer, model_flops_per_token, count_params

__all__ = ["Transformer", "model_flops_per_token", "count_params"]
