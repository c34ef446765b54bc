"""The what-if model's mechanisms: one module per knob family (docs/whatif.md, "Mechanisms").

Every module of this package is imported here; each registers its mechanism with
``@base.register``. :data:`REGISTRY` lists them by their declared ``order``; the model
(``whatif.Model.predict``) runs them phase by phase (:data:`base.PHASES`), in that order within a
phase. What the model can predict is derived from the registry:

* :data:`MODELED`: the keys of the mechanisms that change the step, in registry order;
* :data:`NEUTRAL`: the keys declared not to change a step's time;
* :data:`REFUSED`: key -> the one line a change of it is refused with (a family declared with ``refuses``: the
  trace cannot support a prediction);
* :data:`LEGACY`: key -> the value a trainer without the key ran with (a manifest without it is read so);
* :data:`SIGMA`: every mechanism's uncertainty entries.

Adding a knob family is one new module here (and its test): see docs/whatif.md.
"""

from __future__ import annotations

import importlib
import pkgutil

from . import base
from .base import Change, Mechanism, WhatIfError, register

for _m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if _m.name != "base" and not _m.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_m.name}")


def _registry() -> tuple[Mechanism, ...]:
    reg = tuple(sorted(base._REGISTERED, key=lambda m: (m.order, m.name)))
    owner: dict[str, str] = {}
    for m in reg:
        for k in m.keys:
            if k in owner:
                raise ValueError(f"what-if key {k!r} is owned by two mechanisms: {owner[k]} and {m.name}")
            owner[k] = m.name
    sig: dict[str, str] = {}
    for m in reg:
        for s in m.sigma:
            if s in sig:
                raise ValueError(f"what-if uncertainty {s!r} is declared by two mechanisms: {sig[s]} and {m.name}")
            sig[s] = m.name
    return reg


REGISTRY: tuple[Mechanism, ...] = _registry()
# the order the model applies them in: the per-rank edits (units, then end), then the step's
_ACTS = tuple(m for m in REGISTRY if m.changes_step and not m.refuses)
EDITS: tuple[Mechanism, ...] = tuple(m for ph in ("units", "end") for m in _ACTS if m.phase == ph)
STEPS: tuple[Mechanism, ...] = tuple(m for m in _ACTS if m.phase == "step")
MODELED: tuple[str, ...] = tuple(k for m in _ACTS for k in m.keys)
NEUTRAL: tuple[str, ...] = tuple(k for m in REGISTRY if not m.changes_step and not m.refuses for k in m.keys)
REFUSED: dict[str, str] = {k: m.refuses for m in REGISTRY if m.refuses for k in m.keys}
LEGACY: dict = {k: v for m in REGISTRY for k, v in m.legacy.items()}
SIGMA: dict[str, float] = {s: v for m in REGISTRY for s, v in m.sigma.items()}
BY_NAME: dict[str, Mechanism] = {m.name: m for m in REGISTRY}

__all__ = [
    "BY_NAME",
    "EDITS",
    "LEGACY",
    "MODELED",
    "NEUTRAL",
    "REFUSED",
    "REGISTRY",
    "SIGMA",
    "STEPS",
    "Change",
    "Mechanism",
    "WhatIfError",
    "register",
]
