"""The search space of a sweep, read from YAML.

    config: tiny                 # trainer config (name under trainer/configs or a path)
    nproc: 1                     # processes per trial (torchrun when > 1)
    knobs:                       # trainer config keys and the values to try, in order of preference
      sync_free_level: [0, 1, 2, 3]
      grouped_gemm_backend: [loop, torch, triton]
      manual_gc: [0, 5]
    baseline: {sync_free_level: 0, grouped_gemm_backend: loop, manual_gc: 0}   # default: first values
    fixed: {steps: 6}            # overrides applied to every trial
    constraints:                 # Python expressions over knob values; a trial must satisfy all
      - "not (grouped_gemm_backend == 'loop' and sync_free_level >= 2)"
    objective: tokens_per_s_per_gpu   # or step_time (minimized), mfu
    budget: {trials: 8, wall_s: 900}
    trial: {timeout_s: 300}
    command: null                # test hook: argv prefix replacing `python -m trainer.launch`

Unknown keys, empty knob lists, a baseline value outside its knob's values, or a constraint that does
not parse are errors naming the key.
"""

from __future__ import annotations

import ast
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OBJECTIVES = {  # name -> (manifest metric, maximize?)
    "tokens_per_s_per_gpu": ("tokens_per_s_per_gpu", True),
    "tokens_per_s": ("tokens_per_s", True),
    "mfu": ("mfu", True),
    "step_time": ("mean_step_time_s", False),
}
_KEYS = {"config", "nproc", "knobs", "baseline", "fixed", "constraints", "objective", "budget", "trial", "command"}


class SpaceError(ValueError):
    """A bad search-space file: one line naming the key."""


@dataclass
class Space:
    config: str
    knobs: dict[str, list[Any]]
    nproc: int = 1
    baseline: dict[str, Any] = field(default_factory=dict)
    fixed: dict[str, Any] = field(default_factory=dict)
    constraints: list[str] = field(default_factory=list)
    objective: str = "tokens_per_s_per_gpu"
    max_trials: int = 20
    wall_s: float = 3600.0
    timeout_s: float = 900.0
    command: list[str] | None = None

    @property
    def maximize(self) -> bool:
        return OBJECTIVES[self.objective][1]

    @property
    def metric(self) -> str:
        return OBJECTIVES[self.objective][0]

    def allowed(self, point: dict[str, Any]) -> bool:
        env = {**self.fixed, **point}
        return all(bool(eval(compile(c, "<constraint>", "eval"), {"__builtins__": {}}, env)) for c in self.constraints)

    def grid(self) -> list[dict[str, Any]]:
        names = list(self.knobs)
        pts = [dict(zip(names, vals)) for vals in itertools.product(*(self.knobs[n] for n in names))]
        return [p for p in pts if self.allowed(p)]


def key_of(point: dict[str, Any]) -> str:
    """Canonical identity of a trial: the same knobs always give the same key."""
    return json.dumps(point, sort_keys=True, separators=(",", ":"))


def load_space(path: str | Path) -> Space:
    import yaml

    p = Path(path)
    try:
        doc = yaml.safe_load(p.read_text())
    except OSError as e:
        raise SpaceError(f"{p}: cannot read: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise SpaceError(f"{p}: not valid YAML ({str(e).splitlines()[0]})") from None
    return parse_space(doc, str(p))


def parse_space(doc: Any, where: str = "space") -> Space:
    if not isinstance(doc, dict):
        raise SpaceError(f"{where}: the search space must be a mapping")
    unknown = set(doc) - _KEYS
    if unknown:
        raise SpaceError(f"{where}: unknown key {sorted(unknown)[0]!r} (known: {', '.join(sorted(_KEYS))})")
    if "config" not in doc:
        raise SpaceError(f"{where}: missing key 'config'")
    knobs = doc.get("knobs")
    if not isinstance(knobs, dict) or not knobs:
        raise SpaceError(f"{where}: 'knobs' must map trainer config keys to lists of values")
    for k, v in knobs.items():
        if not isinstance(v, list) or not v:
            raise SpaceError(f"{where}: knobs.{k}: must be a non-empty list of values")
    baseline = {k: v[0] for k, v in knobs.items()}
    for k, v in (doc.get("baseline") or {}).items():
        if k not in knobs:
            raise SpaceError(f"{where}: baseline.{k}: not a knob")
        if v not in knobs[k]:
            raise SpaceError(f"{where}: baseline.{k}: {v!r} is not one of {knobs[k]}")
        baseline[k] = v
    constraints = list(doc.get("constraints") or [])
    for c in constraints:
        try:
            ast.parse(c, mode="eval")
        except SyntaxError:
            raise SpaceError(f"{where}: constraints: {c!r} is not a Python expression") from None
    objective = doc.get("objective", "tokens_per_s_per_gpu")
    if objective not in OBJECTIVES:
        raise SpaceError(f"{where}: objective: {objective!r} is not one of {', '.join(OBJECTIVES)}")
    budget = doc.get("budget") or {}
    trial = doc.get("trial") or {}
    cmd = doc.get("command")
    if cmd is not None and (not isinstance(cmd, list) or not all(isinstance(x, str) for x in cmd)):
        raise SpaceError(f"{where}: command: must be a list of strings")
    space = Space(
        config=str(doc["config"]), knobs=knobs, nproc=int(doc.get("nproc", 1)), baseline=baseline,
        fixed=dict(doc.get("fixed") or {}), constraints=constraints, objective=objective,
        max_trials=int(budget.get("trials", 20)), wall_s=float(budget.get("wall_s", 3600)),
        timeout_s=float(trial.get("timeout_s", 900)), command=cmd,
    )
    try:
        if not space.allowed(space.baseline):
            raise SpaceError(f"{where}: baseline violates the constraints")
    except SpaceError:
        raise
    except Exception as e:  # a constraint naming something that is not a knob or fixed key
        raise SpaceError(f"{where}: constraints: cannot evaluate ({type(e).__name__}: {e})") from None
    return space
