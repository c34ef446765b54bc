"""The declared interface of a what-if mechanism, and the change it is applied to.

A mechanism is one knob family's account of how a changed config changes the measured step. It
declares the config ``keys`` it owns (what the model can predict is the union of them), the relative
uncertainty (1 sigma) of each kind of change it models (``sigma``), the ``phase`` it acts in, and its
place in the application ``order``; it says whether it ``applies`` to a what-if and then edits the
replayed step. Every line it appends to ``change.modeled`` says what it modeled (and what it kept from
the measurement); ``change.notes`` takes what it could not model.

Phases, in the order the model runs them (within a phase, by ``order``):

* ``units``: :meth:`Mechanism.edit` edits one rank's replay program (``replay.Plan``: its units'
  durations, host gaps, syncs, launches), before the step is replayed; returns the variance
  (relative^2 of the step) its edit adds;
* ``end``: the same, after every ``units`` edit (a mechanism acting on the step's end);
* ``step``: :meth:`Mechanism.finish` acts once on the replayed step of the slowest rank (its seconds and
  components), after every rank was replayed.

An optional hook :meth:`Mechanism.measure` reads, once when the model is built, what the mechanism needs from
the run's analysis beyond the step profiles (``model.measured[name]``). Two optional hooks for any phase: :meth:`Mechanism.hold` names keys the per-rank replay keeps at the
run's values (the mechanism predicts them itself in its ``step`` phase), and :meth:`Mechanism.replay`
replaces the plain replay of a rank's edited program (the first mechanism that returns one wins).

A module in this package defines a subclass and decorates it with :func:`register`; the package finds
the modules itself (``mechanisms/__init__.py``), so a new knob family is one new module.

A knob family whose effect the trace of a run cannot show (another model, code generation, routing that changes
over the run) is still declared, with ``refuses`` set: the one line a what-if changing one of its keys is refused
with (why, and what measurement would answer it). Every trainer key is owned by exactly one mechanism, modeled,
neutral or refused (``tests/tracelens/test_whatif_mechanisms.py`` fails on a key that is none of them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

PHASES = ("units", "end", "step")


class WhatIfError(ValueError):
    """A what-if that cannot be answered: one line naming the run or key and why."""


@dataclass
class Change:
    """One what-if as the mechanisms see it."""

    model: Any  # the calibrated whatif.Model: config, manifest, kernel table, memory projection, ...
    old: dict  # the run's config (as its manifest holds it)
    new: dict  # the config the per-rank replay edits toward (keys a mechanism holds stay at the run's values)
    target: dict  # the full changed config (validated by the trainer's rules)
    diff: dict  # the keys whose value changed, with their new values
    modeled: list = field(default_factory=list)  # one line per modeled change (the shown rank's replay's)
    notes: list = field(default_factory=list)  # what could not be modeled, caveats
    device_scale: float = 1.0  # the rank's profiled -> calibrated time factor: what a line about times multiplies by
    # phase ``step``: the slowest rank's edited program, its replay (unit start / end times) and its device scale
    # (``Replayed``), for a mechanism that cuts the replayed timeline (pp_layout)
    replayed: Any = None
    replayed_all: list = field(default_factory=list)  # every rank's, in the model's profile order

    @property
    def t0(self) -> int:
        """Tokens per micro-batch of the run."""
        return int(self.old["micro_batch_size"]) * int(self.old["seq_len"])

    @property
    def t1(self) -> int:
        """Tokens per micro-batch of the replayed config."""
        return int(self.new["micro_batch_size"]) * int(self.new["seq_len"])

    @property
    def s_tok(self) -> float:
        return self.t1 / self.t0


@dataclass
class Replayed:
    """One rank's edited replay program and its replay, as the ``step`` phase sees the slowest rank's."""

    plan: Any  # replay.Plan after every ``units`` / ``end`` edit
    profile: Any  # its profile.StepProfile
    result: Any  # replay.Result (``start`` / ``end`` per unit, ns in the step's frame; None for a chained replay)
    device_scale: float  # profiled -> calibrated time
    host_scale: float  # the rank's calibrated host factor (a host gap's replayed time is gap x host_scale)


class Mechanism:
    """Base of a knob family's mechanism (see the module docstring). Subclasses set the class
    attributes and override :meth:`applies` and the hook of their phase."""

    name: ClassVar[str] = ""
    keys: ClassVar[tuple[str, ...]] = ()  # config keys it owns
    sigma: ClassVar[dict[str, float]] = {}  # relative uncertainty (1 sigma) per kind of change, on the time it changes
    phase: ClassVar[str] = "units"
    order: ClassVar[float] = 0.0  # place in the application order (and in the listing of keys)
    changes_step: ClassVar[bool] = True  # False: its keys are accepted and change nothing in the step
    summary: ClassVar[str] = ""  # one line: what is modeled, what is kept from the measurement
    # a knob family the model names but does not predict: the one line (why the trace cannot support a
    # prediction, and what measurement would) a what-if that changes one of its keys is refused with
    refuses: ClassVar[str] = ""
    # the value each of its keys had in a trainer that did not have the key yet (a manifest without it ran so)
    legacy: ClassVar[dict] = {}

    def applies(self, change: Change) -> bool:
        """Whether this what-if needs this mechanism's edit."""
        return any(change.old.get(k) != change.new.get(k) for k in self.keys)

    def hold(self, change: Change) -> tuple[str, ...]:
        """Keys the per-rank replay keeps at the run's values (this mechanism predicts them in its
        ``step`` phase)."""
        return ()

    def measure(self, model, analysis) -> None:
        """Once, when the model is built: read what this mechanism needs from the run's analysis tables (the
        collectives, the routing counts) into ``model.measured[self.name]``. Default: nothing."""

    def edit(self, plan, profile, change: Change) -> float:
        """``units`` / ``end`` phase: edit ``plan`` (replay.Plan of ``profile``'s rank); return the variance
        (relative^2 of the step) the edit adds."""
        raise NotImplementedError(f"mechanism {self.name}: no edit for phase {self.phase!r}")

    def replay(self, plan, host_scale: float, change: Change):
        """``(replay.Result, variance)`` replacing the plain replay of the edited ``plan``, or None."""
        return None

    def finish(self, change: Change, step_s: float, components: dict, rank: int) -> tuple[float, dict, float]:
        """``step`` phase: the predicted step (seconds), its components (seconds, adding up to it) and the
        variance this mechanism adds, from the slowest rank's replayed ones."""
        raise NotImplementedError(f"mechanism {self.name}: no finish for phase {self.phase!r}")


_REGISTERED: list[Mechanism] = []


def register(cls: type[Mechanism]) -> type[Mechanism]:
    """Class decorator: add one instance of the mechanism to the registry."""
    if cls.phase not in PHASES:
        raise ValueError(f"mechanism {cls.__name__}: phase {cls.phase!r} is not one of {PHASES}")
    if not cls.name:
        raise ValueError(f"mechanism {cls.__name__}: no name")
    if any(m.name == cls.name for m in _REGISTERED):
        raise ValueError(f"mechanism {cls.name!r} registered twice")
    if "\n" in cls.refuses:
        raise ValueError(f"mechanism {cls.name!r}: its refusal must be one line")
    if set(cls.legacy) - set(cls.keys):
        raise ValueError(f"mechanism {cls.name!r}: a legacy value for a key it does not own")
    _REGISTERED.append(cls())
    return cls


def unit_positions(plan) -> dict[int, int]:
    """Unit index -> its item position in the plan's host order."""
    return {j: i for i, (kd, j) in enumerate(zip(plan.kind, plan.ref)) if kd == 0}
