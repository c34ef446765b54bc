"""``step_timing``: a ``torch.cuda.synchronize`` after every step (``sync``), or none (``events``).

``sync`` -> ``events``: the blocking sync after the step's last launch goes, and the host queues the
next steps while the device works: a chain of ``log_every`` steps is replayed
(:meth:`replay.Plan.replay_chain`), each one's host starting when the previous one's is done and the
device work it left running carried over as the next step's backlog, with a blocking read after the last
(the trainer's log point); the mean step of the chain is the prediction. ``events`` -> ``sync``: a sync
after the last launch, every step on a drained device. On a CPU: no change. Its edit acts on the step's
end: it runs after every other edit (phase ``end``).
"""

from __future__ import annotations

import numpy as np

from .base import Change, Mechanism, register


def log_cycle(cfg: dict) -> int:
    """Steps between two blocking reads when steps are timed by events: the trainer reads the loss and the
    step time at each log point (``log_every``); without one, only at the run's end (a long chain: 8 steps
    stand for it, past which the mean changes little)."""
    every = int(cfg.get("log_every") or 0)
    return max(1, min(every if every > 0 else 8, int(cfg.get("steps") or 8), 64))


def median_sync_return(plan) -> float:
    """A blocking sync's return after the device drained: the step's recorded syncs' median (20 µs
    without one)."""
    ret = [r for r, st in zip(plan.sync_ret, plan.sync_streams) if r > 0]
    return float(np.median(ret)) if ret else 20_000.0


def step_timing(plan, p, s0: str, s1: str, modeled: list, notes: list) -> None:
    """Edit ``plan`` for ``s0`` -> ``s1``: drop the end syncs (sync -> events), or add one and no backlog
    (events -> sync: the device is drained at every step start)."""
    if p.device != "gpu":
        modeled.append(f"step_timing {s0} -> {s1}: no change on a CPU (nothing asynchronous to wait for)")
        return
    units = [i for i, kd in enumerate(plan.kind) if kd == 0]
    last_launch = units[-1] if units else -1
    trailing = {i for i, kd in enumerate(plan.kind) if kd == 1 and i > last_launch}
    if s1 == "events":
        if not trailing:
            notes.append("step_timing sync -> events: no blocking sync after the step's last launch in the "
                         "profiled step; only the run-ahead across steps is modeled")
        plan.drop_items(trailing)
        modeled.append(f"step_timing sync -> events: the sync after the step dropped ({len(trailing)} blocking "
                       "call(s)); the host queues the next steps while the device works, a blocking read at "
                       "each log point (a chain of log_every steps replayed)")
    else:
        if not trailing:
            plan.add_sync(len(plan.kind), median_sync_return(plan))
        plan.backlog = {}
        modeled.append("step_timing events -> sync: a blocking sync after each step; every step starts on a "
                       "drained device")


def _timing(cfg: dict) -> str:
    return cfg.get("step_timing", "sync")


@register
class StepTiming(Mechanism):
    name = "step_timing"
    keys = ("step_timing",)
    sigma = {"timing": 0.30}
    phase = "end"
    order = 85.0
    summary = ("sync -> events: the end-of-step sync goes and a chain of log_every steps is replayed with the host "
               "running ahead; events -> sync: a sync after each step")

    def applies(self, change: Change) -> bool:
        return _timing(change.old) != _timing(change.new)

    def edit(self, plan, p, change: Change) -> float:
        step_timing(plan, p, _timing(change.old), change.new["step_timing"], change.modeled, change.notes)
        return 0.0

    def replay(self, plan, host_scale: float, change: Change):
        if not (self.applies(change) and change.new.get("step_timing") == "events"):
            return None
        # the steady state of steps the host queues ahead; its change from one step is uncertain
        one = plan.replay(host_scale).step_ns
        res = plan.replay_chain(host_scale, log_cycle(change.new), median_sync_return(plan))
        return res, (self.sigma["timing"] * abs(res.step_ns - one) / max(one, 1.0)) ** 2
