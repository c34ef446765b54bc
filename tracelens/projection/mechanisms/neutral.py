"""Keys that do not change a step's time: accepted by the what-if, nothing edited.

Numeric constants of the model (``rms_eps``, ``rope_theta``, ``routed_scaling_factor``: the same kernels on the same
shapes) and ``norm_topk_prob`` (a sum and a division over the [tokens, top_k] weights per MoE layer forward, and their
backward: microseconds of a step of hundreds of milliseconds; the softmax scores are renormalised, the choice of
experts is the same) are here with the run's length, logging and learning-rate schedule.
"""

from __future__ import annotations

from .base import Mechanism, register


@register
class Neutral(Mechanism):
    name = "neutral"
    keys = ("steps", "profile_step_start", "profile_step_end", "log_every", "timing_warmup_steps", "seed", "lr",
            "min_lr_ratio", "warmup_steps", "weight_decay", "adam_beta1", "adam_beta2", "grad_clip", "numa_bind",
            "env", "multistream_num_streams", "init_std", "rms_eps", "rope_theta", "routed_scaling_factor",
            "norm_topk_prob")
    changes_step = False
    order = 0.0
    summary = ("run length, profiling window, logging, seed, learning-rate schedule, optimizer and numeric constants: "
               "the step's work and launches are the same (norm_topk_prob: two [tokens, top_k] kernels per MoE layer, "
               "microseconds)")

    def applies(self, change) -> bool:
        return False
