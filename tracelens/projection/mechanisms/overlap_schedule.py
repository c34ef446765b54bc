"""``ep_overlap_schedule`` (chunked <-> pipelined): refused, with what would model it.

``pipelined`` (trainer/model/moe.py ``_ep_forward``) splits the shared expert in two halves around the chunk chain:
the first half computes while the first chunk's rows go out, the second right after the last chunk's outputs are
sent, and by autograd's order the backward mirrors it. A replay of it would move half of each MoE layer's
shared-expert kernels (forward and backward) from the head of the chain to its tail in the overlap mechanism's
rebuilt chunks (overlap.py). What decides the result is how much of the tail's return trip that half covers against
how much of the head's dispatch it uncovers, a difference of a few hundred microseconds per layer that the replay
would have to get right beside NCCL's SM contention with the compute it overlaps, which the overlap mechanism does
not model (a grouped GEMM beside an all-to-all ran 1.9x slower on the `ep4_cap_ovl` fixture).

Measured instead (docs/performance.md, "The overlap schedules, measured", 4 x H100, `gpu_proxy_train` at EP 4,
capacity 1.25): pipelined vs chunked +0.6 % at 2 chunks (102,532 -> 103,141 tokens/s/GPU) and +0.9 % at 4,
within the run-to-run noise of those rows, with 2 points more of the all-to-all transfer hidden. So the change is
refused with that measurement: a prediction of +/- 0.6 % would be below the model's own uncertainty.
"""

from __future__ import annotations

from .base import Mechanism, register


@register
class OverlapSchedule(Mechanism):
    name = "overlap_schedule"
    keys = ("ep_overlap_schedule",)
    order = 207.0
    summary = "refused: measured +0.6 % (pipelined vs chunked), below the model's uncertainty"
    refuses = ("the shared expert split around the chunk chain is not replayed (its effect is under the model's "
               "uncertainty: measured +0.6 % pipelined vs chunked at 2 chunks, +0.9 % at 4, docs/performance.md); "
               "measure it: benchmarks/bench_ep.sh rows ep4_cap_pipe*")
