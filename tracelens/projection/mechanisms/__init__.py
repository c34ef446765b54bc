"""The what-if model's mechanisms: one module per knob family (docs/whatif.md, "Mechanisms").

Every module of this package is imported here; each registers its mechanism with
``@base.register``. :data:`REGISTRY` lists them by their declared ``order``; the model
(``whatif.Model.predict``) runs them phase by phase (:data:`base.PHASES`), in that order within a
phase. What the model can predict is derived from the registry:

* :data:`MODELED`: the keys of the mechanisms that change the step, in registry order;
* :data:`NEUTRAL`: the keys declared not to change a step's time;
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
EDITS: tuple[Mechanism, ...] = tuple(m for ph in ("units", "end") for m in REGISTRY if m.changes_step and m.phase == ph)
STEPS: tuple[Mechanism, ...] = tuple(m for m in REGISTRY if m.changes_step and m.phase == "step")
MODELED: tuple[str, ...] = tuple(k for m in REGISTRY if m.changes_step for k in m.keys)
NEUTRAL: tuple[str, ...] = tuple(k for m in REGISTRY if not m.changes_step for k in m.keys)
SIGMA: dict[str, float] = {s: v for m in REGISTRY for s, v in m.sigma.items()}
BY_NAME: dict[str, Mechanism] = {m.name: m for m in REGISTRY}

__all__ = ["BY_NAME", "Change", "EDITS", "MODELED", "Mechanism", "NEUTRAL", "REGISTRY", "SIGMA", "STEPS",
           "WhatIfError", "register"]
