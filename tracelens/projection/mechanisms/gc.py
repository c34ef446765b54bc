"""``manual_gc``: Python's garbage collector.

The collector leaves no trace in a profile: a run's step-time tail above its median may be its pauses,
or anything else (allocator, host jitter). Measured on the H100 proxy (dev runs and the gc grid, 7
pairs), manual GC moved tokens/s by -3.5 % to +0.0 %, and the largest tail (11 % of the mean,
multistream) was still 6 % with it on: the step is kept, the tail is the uncertainty.
"""

from __future__ import annotations

from .base import Change, Mechanism, register


@register
class ManualGC(Mechanism):
    name = "gc"
    keys = ("manual_gc",)
    sigma = {"gc": 1.0}
    phase = "step"
    order = 75.0
    summary = "the step is kept (the collector's pauses are not in a trace); the run's step-time tail is the uncertainty"

    def applies(self, change: Change) -> bool:
        return "manual_gc" in change.diff

    def finish(self, change: Change, step_s: float, components: dict, rank: int) -> tuple[float, dict, float]:
        jitter = change.model.jitter
        change.modeled.append(f"manual_gc={change.new['manual_gc']}: step kept (the collector's pauses are not in the "
                              f"trace); the run's step-time tail above the median, {100 * jitter:.1f}% of the mean, is "
                              "the uncertainty")
        return step_s, components, (self.sigma["gc"] * max(jitter, 0.01)) ** 2
