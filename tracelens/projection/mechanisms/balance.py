"""``router_bias_update_rate``, ``aux_loss_coef``: load balancing that changes the routing over the run, refused.

Both act on *where tokens go*, step after step: the aux-loss-free bias (trainer/model/balance.py, DeepSeek-V3) moves
each expert's selection score against its load after every optimizer step, the auxiliary loss pulls the router's
weights toward balance through the gradient. Their cost on the step is two device ops and one small all-reduce
(the bias) or a few router-sized kernels (the loss); their effect is the routing they lead to, and the trace of a
run without them shows only that run's routing: how balanced the router becomes, and how fast, is a property of the
training (the rate, the router, the data, the number of steps), not of any kernel in the trace.

Why no bound either. A bound would take the routing to perfect balance (the placement machinery with uniform loads:
every rank the mean rows). Measured on 4 x H100 (docs/performance.md, stop 24: `gpu_proxy_train`, EP 4, capacity
1.25), after 18-26 bias updates at 0.001 the hottest expert still took 5-7.6x the mean load and the rank imbalance
was 1.22-1.42, and the speed moved +0.3 % (0.001) to +2-3 % (0.003, 0.01, which then oscillate); and placing the
experts so that the expected loads are even (`ep_placement: balanced`, imbalance 1.14-1.19 -> 1.00) changed the step
by -0.1 %, because the capacity buffers make every all-to-all the same size whatever the routing. A perfectly
balanced bound would overstate what a run of any length shows, and the guided search would chase it. So the key is
refused; what answers it is a run with the bias, long enough for the routing to settle, profiled: its routing.json
gives `tracelens moe`'s imbalance and its trace the what-if's baseline.
"""

from __future__ import annotations

from .base import Mechanism, register


@register
class Balance(Mechanism):
    name = "balance"
    keys = ("router_bias_update_rate", "aux_loss_coef")
    order = 206.0
    summary = "refused: the routing the balancing leads to is not in the trace of a run without it"
    refuses = ("load balancing changes the routing over the run, which this run's trace does not show (measured: after "
               "26 bias updates the hottest expert still took 5-7.6x the mean load, +0.3-3 % speed; docs/performance.md "
               "stop 24); profile a run with it, long enough for the routing to settle")
