"""Keys that do not change a step's time: accepted by the what-if, nothing edited."""

from __future__ import annotations

from .base import Mechanism, register


@register
class Neutral(Mechanism):
    name = "neutral"
    keys = ("steps", "profile_step_start", "profile_step_end", "log_every", "timing_warmup_steps", "seed", "lr",
            "min_lr_ratio", "warmup_steps", "weight_decay", "adam_beta1", "adam_beta2", "grad_clip", "numa_bind",
            "env", "multistream_num_streams", "init_std")
    changes_step = False
    order = 0.0
    summary = ("run length, profiling window, logging, seed, learning-rate schedule and optimizer constants: the "
               "step's work and launches are the same")

    def applies(self, change) -> bool:
        return False
