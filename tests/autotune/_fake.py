"""A stand-in trial runner for unit tests of strategies and the store: results from a table, no trainer."""

from __future__ import annotations

from autotune.runner import TrialResult
from autotune.space import key_of


class FakeRunner:
    """``table``: key_of(point) -> (objective or None for a crash, findings, signals, noise).
    ``interrupt_at``: raise KeyboardInterrupt on that call (1-based), like a sweep killed mid-trial."""

    def __init__(self, table: dict, interrupt_at: int | None = None, default=None):
        self.table, self.interrupt_at, self.default = table, interrupt_at, default
        self.calls: list[dict] = []

    def __call__(self, space, point, run_dir, on_start):
        self.calls.append(dict(point))
        on_start(0)
        if self.interrupt_at is not None and len(self.calls) == self.interrupt_at:
            raise KeyboardInterrupt("killed")
        obj, findings, signals, noise = self.table.get(key_of(point), self.default)
        if obj is None:
            return TrialResult("failed", "crash", "crash: exit 1: boom", None, {"wall_s": 0.1})
        return TrialResult("ok", None, None, float(obj), {"noise": noise, "signals": signals, "wall_s": 0.1}, findings)
