"""MoE stage ranges and a host-sync counter.

``moe_stage(name)`` opens a ``record_function`` range ``moe/<name>`` (what the trace analyzer keys
on) and records the current stage so that :class:`HostSyncCounter` can attribute every host sync it
intercepts to a stage. On CPU there is no cudaStreamSynchronize to see, so the counter intercepts
the operations that force one on a GPU: ``aten._local_scalar_dense`` (``.item()``), ``aten.nonzero``
and friends through a ``TorchDispatchMode``, and ``Tensor.tolist``/``Tensor.item``/``Tensor.__bool__``
/``Tensor.cpu`` by patching, since ``tolist`` never reaches the dispatcher on CPU.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_state = threading.local()


def current_stage() -> str | None:
    stack = getattr(_state, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def moe_stage(name: str):
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    stack.append(name)
    try:
        with torch.profiler.record_function(f"moe/{name}"):
            yield
    finally:
        stack.pop()


# aten ops whose result size or value must be known on the host: each is a device->host sync on GPU.
SYNC_OPS = {
    "aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::masked_select",
    "aten::unique", "aten::_unique2", "aten::unique_consecutive", "aten::unique_dim",
    "aten::is_nonzero", "aten::equal", "aten::bincount",
    "aten::repeat_interleave",  # the Tensor-repeats overload without output_size
}


class HostSyncCounter(TorchDispatchMode):
    """Counts host syncs, keyed by MoE stage (``None`` = outside the MoE path).

    ``events`` holds (stage, op) tuples; ``moe_total`` counts the ones inside MoE stages.
    """

    def __init__(self):
        super().__init__()
        self.events: list[tuple[str | None, str]] = []
        self._patched: list = []
        self._inside = False

    def _record(self, op: str):
        self.events.append((current_stage(), op))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name in SYNC_OPS and not self._inside:
            # repeat_interleave syncs only with tensor repeats and no output_size
            if not (name == "aten::repeat_interleave"
                    and (func._overloadname == "self_int" or kwargs.get("output_size") is not None)):
                self._record(name)
        elif name in ("aten::index", "aten::index_put", "aten::index_put_") and not self._inside:
            # boolean-mask indexing sizes its result by a nonzero() below the dispatcher
            idx = args[1] if len(args) > 1 else ()
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in idx or ()):
                self._record(f"{name}(bool mask)")
        return func(*args, **kwargs)

    def __enter__(self):
        counter = self

        def wrap(attr):
            orig = getattr(torch.Tensor, attr)

            def patched(t, *a, **k):
                if counter._inside:
                    return orig(t, *a, **k)
                counter._record(f"Tensor.{attr}")
                counter._inside = True
                try:
                    return orig(t, *a, **k)
                finally:
                    counter._inside = False

            setattr(torch.Tensor, attr, patched)
            self._patched.append((attr, orig))

        for attr in ("tolist", "item", "__bool__"):
            wrap(attr)
        return super().__enter__()

    def __exit__(self, *exc):
        for attr, orig in reversed(self._patched):
            setattr(torch.Tensor, attr, orig)
        self._patched.clear()
        return super().__exit__(*exc)

    @property
    def by_stage(self) -> Counter:
        return Counter(stage for stage, _ in self.events)

    @property
    def moe_total(self) -> int:
        return sum(1 for stage, _ in self.events if stage is not None)

    @property
    def total(self) -> int:
        return len(self.events)
