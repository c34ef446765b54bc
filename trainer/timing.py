"""Step timing (``step_timing`` config key): how the trainer measures each step's time.

``sync``: wall clock around the step, with ``torch.cuda.synchronize`` at its end (the step's time is
exact, but the host waits for the GPU after every step and never runs ahead).

``events``: on a GPU, a CUDA event is recorded on the current stream at the start and at the end of
each step; the pairs are read (``elapsed_time``) only when a value is wanted: where the trainer logs a
step (``log_every``) and at the end of the run. Between those points nothing blocks the host, which
queues the next steps while the GPU works. A step's time is then the GPU-stream time between its two
events. On a CPU there is nothing asynchronous to wait for: the wall clock around the step, no sync.

Either way the step intervals are disjoint and lie within the host's wall time from the first step's
start to :meth:`StepTimer.finish` (``steps_wall_s`` in the manifest), so ``sum(step_times_s) <=
steps_wall_s``: an event is recorded by the host before the GPU reaches it, and ``finish`` returns only
after the last one has completed.
"""

from __future__ import annotations

import time

import torch

METHODS = {"sync": "host_sync", "events": "cuda_events", "wall": "wall_clock"}


class StepTimer:
    """``start()`` / ``stop()`` around every step; ``last()`` (blocks on that step in events mode),
    ``finish()`` at the end: every step's time in seconds, in step order."""

    def __init__(self, mode: str, device: torch.device):
        if mode not in ("sync", "events"):
            raise ValueError(f"step_timing: {mode!r} is not sync or events")
        self.device = device
        self.cuda = device.type == "cuda"
        self.events = mode == "events" and self.cuda
        # what the manifest records as metrics.step_timing
        self.method = METHODS["events"] if self.events else (METHODS["sync"] if self.cuda else METHODS["wall"])
        self.deferred = self.events  # values are read later than the step ends
        self.times: list[float] = []
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._start: torch.cuda.Event | float | None = None
        self.wall_start: float | None = None
        self.wall_s: float | None = None

    def start(self) -> None:
        if self.wall_start is None:
            self.wall_start = time.perf_counter()
        if self.events:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._start = ev
        else:
            self._start = time.perf_counter()

    def stop(self) -> None:
        if self._start is None:
            raise RuntimeError("StepTimer.stop() without start()")
        if self.events:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._pending.append((self._start, ev))
        else:
            if self.cuda:
                torch.cuda.synchronize(self.device)
            self.times.append(time.perf_counter() - self._start)
        self._start = None

    def resolve(self) -> list[float]:
        """Every stopped step's time (seconds); in events mode this waits for the last stopped step."""
        if self._pending:
            self._pending[-1][1].synchronize()
            self.times.extend(s.elapsed_time(e) / 1e3 for s, e in self._pending)
            self._pending.clear()
        return self.times

    def last(self) -> float:
        return self.resolve()[-1]

    def finish(self) -> list[float]:
        """End of the loop: wait for the device, record the wall time of the steps, return all times."""
        times = self.resolve()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        if self.wall_start is not None:
            self.wall_s = time.perf_counter() - self.wall_start
        return times
