"""Device drains inside a per-expert backend's expert stage (the caching allocator waiting for the device).

Per-expert backends (loop, multistream) allocate per-expert buffers of a different size for every
expert: inside their expert stage's backward the host sometimes waits until the device has drained
(the caching allocator reorganising its pool; no sync call is recorded: the replay finds these waits,
``replay._hidden_syncs``). On the H100 proxy (3 grids, 52 runs) such a drain appeared in 7 of 7
per-expert runs whose peak memory grew past the level of micro-batch 2 (without recompute), in 1 of 9
at that level, and in none of 34 grouped-backend runs inside the expert stage. So: a grouped backend
has none (the baseline's are dropped: the host work before them stays, the wait goes); a per-expert
backend whose projected peak grows past the baseline's gets one at the first expert backward, where
the measured ones are, unless the baseline already shows it (it then moves with the device time).
"""

from __future__ import annotations

from .base import Change, Mechanism, register
from .gemm_backend import PER_EXPERT

# the host's return after a device drain inside a per-expert expert stage (124-256 µs on the H100 proxy)
DRAIN_RETURN_NS = 150_000.0


@register
class Drains(Mechanism):
    name = "drains"
    keys = ()  # follows grouped_gemm_backend and the projected peak memory
    sigma = {"drains": 0.30}
    order = 10.0  # first: before anything moves item positions
    summary = ("a grouped backend's expert stage has no device drains (the baseline's dropped, their host work kept); "
               "a per-expert backend whose projected peak grows gets one at the first expert backward")

    def applies(self, change: Change) -> bool:
        return change.old["grouped_gemm_backend"] in PER_EXPERT or change.new["grouped_gemm_backend"] in PER_EXPERT

    def edit(self, plan, p, change: Change) -> float:
        model = change.model
        w = p.work
        b0, b1 = change.old["grouped_gemm_backend"], change.new["grouped_gemm_backend"]
        n_rec = len(p.syncs)
        stage = w["moe_stage"].to_numpy()
        back = w["backward"].to_numpy()
        hidden = [i for i, (kd, j) in enumerate(zip(plan.kind, plan.ref))
                  if kd == 1 and j >= n_rec and i + 1 < len(plan.kind) and plan.kind[i + 1] == 0
                  and plan.ref[i + 1] < len(w) and stage[plan.ref[i + 1]] == "moe/experts"]
        if b0 in PER_EXPERT and b1 not in PER_EXPERT:
            if not hidden:
                return 0.0
            waited = sum(plan.sync_ret[plan.ref[i]] for i in hidden)
            for i in hidden:
                plan.gap[i + 1] += plan.gap[i]
            plan.drop_items(set(hidden))
            change.modeled.append(f"{b1}: the {len(hidden)} device drain(s) inside the per-expert expert stage removed "
                                  "(a grouped backend's expert stage has none)")
            return (self.sigma["drains"] * 0.1 * waited / max(float(p.step_ns), 1.0)) ** 2
        if b1 not in PER_EXPERT or hidden:
            return 0.0
        try:
            grows = (model._project(change.new) or 0.0) > (model._project(change.old) or 0.0) * 1.001
        except Exception:  # noqa: BLE001 - no projection: no basis to add one
            return 0.0
        if not grows:
            return 0.0
        first = next((i for i, (kd, j) in enumerate(zip(plan.kind, plan.ref))
                      if kd == 0 and j < len(w) and back[j] and stage[j] == "moe/experts"), None)
        if first is None:
            return 0.0
        plan.add_sync(first, DRAIN_RETURN_NS)
        change.modeled.append(f"{b1}: a device drain at the first expert backward (per-expert buffers with more memory "
                              "in use: measured in every such run on the H100 proxy)")
        return self.sigma["drains"] ** 2 * 0.01
