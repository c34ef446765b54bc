"""The search space of a sweep, read from YAML (schema and example: docs/autotune.md, autotune/spaces/).

    config: tiny                 # trainer config (name under trainer/configs or a path)
    nproc: 1                     # processes per trial (torchrun when > 1)
    knobs:                       # trainer config keys and the values to try, in order of preference
      sync_free_level: [0, 1, 2, 3]
      grouped_gemm_backend: [loop, torch, triton]
      manual_gc: [0, 5]
    baseline: {sync_free_level: 0, grouped_gemm_backend: loop, manual_gc: 0}   # default: first values
    fixed: {steps: 6}            # overrides applied to every trial
    constraints:                 # expressions over the knobs, `fixed`, the resolved trainer config and nproc
      - "not (grouped_gemm_backend == 'loop' and sync_free_level >= 2)"    # (autotune/constraints.py)
    objective: tokens_per_s_per_gpu   # or tokens_per_s, mfu (maximized), step_time (minimized)
    budget: {trials: 8, wall_s: 900}
    trial: {timeout_s: 300, stall_s: 120, env: {OMP_NUM_THREADS: "4"}}   # stall_s (optional): no new
                                 # output for this long, once the trial printed, = a hang; env: extra
                                 # environment variables of every trial
    limits: {memory_gib: 70}     # a trial whose peak memory exceeds this fails ("memory"); headroom
                                 # and near-OOM findings are measured against it
    guided: {explore: 0, min_gain: 0.02, noise_z: 2, gemm_roof_pct: 50, model: true, kernel_table: null}
    command: null                # argv prefix replacing `python -m trainer.launch` (wrappers, tests)

Every problem is a :class:`SpaceError` whose message is one line naming the file and the key.
Constraints are a small expression language (``autotune/constraints.py``), never ``eval``-ed; ``command``
runs any argv by design: a space file is trusted like code its user wrote (docs/robustness.md).
Knob names and values are checked against the trainer's own config loader (run as a subprocess, see
``autotune/_trainer_check.py``), so a key the trainer does not have yet (e.g. pipeline keys) is
reported as such, and becomes valid the day the trainer learns it.
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from moespec.yaml_bounded import short_repr

from .constraints import ConstraintError, compile_constraint

OBJECTIVES = {  # name -> (manifest metric, maximize?)
    "tokens_per_s_per_gpu": ("tokens_per_s_per_gpu", True),
    "tokens_per_s": ("tokens_per_s", True),
    "mfu": ("mfu", True),
    "step_time": ("mean_step_time_s", False),
}
_KEYS = {"config", "nproc", "knobs", "baseline", "fixed", "constraints", "objective", "budget", "trial",
         "limits", "guided", "command"}
_SUBKEYS = {"budget": {"trials", "wall_s"}, "trial": {"timeout_s", "stall_s", "env"}, "limits": {"memory_gib"},
            "guided": {"explore", "min_gain", "noise_z", "gemm_roof_pct", "model", "kernel_table"}}
MAX_GRID = 200_000
MAX_SPACE_BYTES = 1 << 20  # a space file is a page of YAML; more is a mistake (or an attack)


class SpaceError(ValueError):
    """A bad search-space file: one line naming the file and the key."""


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
    stall_s: float | None = None
    trial_env: dict[str, str] = field(default_factory=dict)
    memory_gib: float | None = None
    explore: int = 0
    min_gain: float = 0.02
    noise_z: float = 2.0
    gemm_roof_pct: float = 50.0
    use_model: bool = True  # guided.model: rank candidates by the what-if model (tracelens.projection)
    kernel_table: str | None = None  # guided.kernel_table: grouped-GEMM timings for the backend knob
    command: list[str] | None = None
    base_config: dict[str, Any] = field(default_factory=dict)  # resolved trainer config (+ fixed)

    @property
    def maximize(self) -> bool:
        return OBJECTIVES[self.objective][1]

    @property
    def metric(self) -> str:
        return OBJECTIVES[self.objective][0]

    def allowed(self, point: dict[str, Any]) -> bool:
        """True when the point satisfies every constraint (evaluated over ``nproc`` + config + fixed + point)."""
        env = {"nproc": self.nproc, **self.base_config, **self.fixed, **point}
        for i, c in enumerate(self.constraints):
            try:
                ok = compile_constraint(c).evaluate(env)
            except (ConstraintError, SyntaxError) as e:
                raise SpaceError(f"constraints[{i}]: {_cut(c)!r} cannot be evaluated for {_cut(key_of(point))} "
                                 f"({' '.join(str(e).split())})") from None
            if not ok:
                return False
        return True

    def grid(self) -> list[dict[str, Any]]:
        """Every allowed point, in the order of the knob lists (the first knob varies slowest)."""
        names = list(self.knobs)
        pts = (dict(zip(names, vals)) for vals in itertools.product(*(self.knobs[n] for n in names)))
        return [p for p in pts if self.allowed(p)]

    def grid_size(self) -> int:
        return math.prod(len(v) for v in self.knobs.values())

    def identity(self) -> dict[str, Any]:
        """What must match for `--resume` to continue a stored sweep (budgets may change)."""
        return {"config": self.config, "nproc": self.nproc, "knobs": self.knobs, "baseline": self.baseline,
                "fixed": self.fixed, "constraints": self.constraints, "objective": self.objective}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _cut(text: str, n: int = 120) -> str:
    return text if len(text) <= n else text[:n] + "..."


def key_of(point: dict[str, Any]) -> str:
    """Canonical identity of a trial: the same knobs always give the same key."""
    return json.dumps(point, sort_keys=True, separators=(",", ":"), default=str)


def load_space(path: str | Path, check_trainer: bool = True) -> Space:
    """Read and validate a space file; every error is one line naming the file. The YAML is read by
    the project's bounded loader (moespec.yaml_bounded: aliases cannot expand it without limit)."""
    import yaml

    from moespec.yaml_bounded import safe_load

    p = Path(path)
    try:
        if p.exists() and not p.is_file():
            raise SpaceError(f"{p}: cannot read: not a regular file")
        size = p.stat().st_size
        if size > MAX_SPACE_BYTES:
            raise SpaceError(f"{p}: {size} bytes is too large for a space file (at most {MAX_SPACE_BYTES})")
        doc = safe_load(p.read_bytes()[:MAX_SPACE_BYTES + 1].decode("utf-8"))
    except OSError as e:
        raise SpaceError(f"{p}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise SpaceError(f"{p}: not a UTF-8 text file (byte {e.start}): a YAML space file was expected") from None
    except RecursionError:
        raise SpaceError(f"{p}: not valid YAML (nested too deeply)") from None
    except yaml.YAMLError as e:
        raise SpaceError(f"{p}: not valid YAML ({' '.join(str(e).split())[:200]})") from None
    return parse_space(doc, str(p), check_trainer=check_trainer, base_dir=p.resolve().parent)


def _num(where: str, key: str, v: Any, kind: type, lo: float) -> Any:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
        raise SpaceError(f"{where}: {key}: expected {'an integer' if kind is int else 'a number'}, got {short_repr(v)}")
    if math.isnan(v):  # nan: no comparison is true of it, so it passed the bound (a trial.timeout_s of nan never fires)
        raise SpaceError(f"{where}: {key}: expected a number, got nan")
    if v < lo:
        raise SpaceError(f"{where}: {key}: must be >= {lo:g}, got {short_repr(v)}")
    return kind(v)


def _mapping(where: str, doc: dict, key: str) -> dict:
    v = doc.get(key)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise SpaceError(f"{where}: {key}: must be a mapping, got {type(v).__name__}")
    allowed = _SUBKEYS.get(key)
    if allowed is not None:
        bad = sorted(set(v) - allowed)
        if bad:
            raise SpaceError(f"{where}: {key}.{_cut(str(bad[0]), 80)}: unknown key (known: {', '.join(sorted(allowed))})")
    return v


def parse_space(doc: Any, where: str = "space", check_trainer: bool = True, base_dir: Path | None = None) -> Space:
    """Validate a parsed YAML document. ``check_trainer=False`` skips asking the trainer's config
    loader (unit tests of the schema itself; constraints then see only knobs and `fixed`).
    A ``config`` given as a file path is made absolute (relative to the working directory, else to
    ``base_dir``, the space file's directory), since trials run in the repository root."""
    if not isinstance(doc, dict):
        raise SpaceError(f"{where}: the search space must be a mapping")
    unknown = sorted(set(doc) - _KEYS)
    if unknown:
        raise SpaceError(f"{where}: {_cut(str(unknown[0]), 80)}: unknown key (known: {', '.join(sorted(_KEYS))})")
    if not isinstance(doc.get("config"), str) or not doc["config"]:
        raise SpaceError(f"{where}: config: missing (a trainer config name or YAML path)")
    knobs = doc.get("knobs")
    if not isinstance(knobs, dict) or not knobs:
        raise SpaceError(f"{where}: knobs: must map trainer config keys to lists of values")
    for k, v in knobs.items():
        if not isinstance(v, list) or not v:
            raise SpaceError(f"{where}: knobs.{k}: must be a non-empty list of values")
        keys = [key_of({"v": x}) for x in v]
        if len(set(keys)) != len(keys):
            dup = next(x for i, x in enumerate(v) if keys.index(keys[i]) != i)
            raise SpaceError(f"{where}: knobs.{k}: value {short_repr(dup)} is listed twice")
    fixed = _mapping(where, doc, "fixed")
    both = sorted(set(fixed) & set(knobs))
    if both:
        raise SpaceError(f"{where}: fixed.{both[0]}: is also a knob")
    baseline = {k: v[0] for k, v in knobs.items()}
    for k, v in _mapping(where, doc, "baseline").items():
        if k not in knobs:
            raise SpaceError(f"{where}: baseline.{k}: not a knob")
        if v not in knobs[k]:
            raise SpaceError(f"{where}: baseline.{k}: {short_repr(v)} is not one of {short_repr(knobs[k])}")
        baseline[k] = v
    constraints = doc.get("constraints") or []
    if not isinstance(constraints, list) or not all(isinstance(c, str) for c in constraints):
        raise SpaceError(f"{where}: constraints: must be a list of expressions (strings)")
    for i, c in enumerate(constraints):
        try:
            compile_constraint(c)
        except SyntaxError:
            raise SpaceError(f"{where}: constraints[{i}]: {_cut(c)!r} is not a Python expression") from None
        except ConstraintError as e:
            raise SpaceError(f"{where}: constraints[{i}]: {_cut(c)!r}: {e}") from None
    objective = doc.get("objective", "tokens_per_s_per_gpu")
    if objective not in OBJECTIVES:
        raise SpaceError(f"{where}: objective: {short_repr(objective)} is not one of {', '.join(OBJECTIVES)}")
    budget, trial = _mapping(where, doc, "budget"), _mapping(where, doc, "trial")
    limits, guided = _mapping(where, doc, "limits"), _mapping(where, doc, "guided")
    cmd = doc.get("command")
    if cmd is not None and (not isinstance(cmd, list) or not cmd or not all(isinstance(x, str) for x in cmd)):
        raise SpaceError(f"{where}: command: must be a non-empty list of strings")
    mem = limits.get("memory_gib")
    stall = trial.get("stall_s")
    tenv = trial.get("env") or {}
    if not isinstance(tenv, dict) or not all(isinstance(v, (str, int, float)) and not isinstance(v, bool)
                                             for v in tenv.values()):
        raise SpaceError(f"{where}: trial.env: must map variable names to strings or numbers")
    space = Space(
        config=_config_path(doc["config"], base_dir), knobs=knobs, baseline=baseline, fixed=dict(fixed), constraints=list(constraints),
        objective=objective, command=cmd,
        nproc=_num(where, "nproc", doc.get("nproc", 1), int, 1),
        max_trials=_num(where, "budget.trials", budget.get("trials", 20), int, 1),
        wall_s=_num(where, "budget.wall_s", budget.get("wall_s", 3600), float, 1),
        timeout_s=_num(where, "trial.timeout_s", trial.get("timeout_s", 900), float, 1),
        stall_s=None if stall is None else _num(where, "trial.stall_s", stall, float, 1),
        trial_env={str(k): str(v) for k, v in tenv.items()},
        memory_gib=None if mem is None else _num(where, "limits.memory_gib", mem, float, 0.001),
        explore=_num(where, "guided.explore", guided.get("explore", 0), int, 0),
        min_gain=_num(where, "guided.min_gain", guided.get("min_gain", 0.02), float, 0),
        noise_z=_num(where, "guided.noise_z", guided.get("noise_z", 2), float, 0),
        gemm_roof_pct=_num(where, "guided.gemm_roof_pct", guided.get("gemm_roof_pct", 50), float, 0),
        use_model=_flag(where, "guided.model", guided.get("model", True)),
        kernel_table=_kernel_table(where, guided.get("kernel_table"), base_dir),
    )
    if check_trainer:
        _check_with_trainer(space, where)
    if space.grid_size() > MAX_GRID:
        raise SpaceError(f"{where}: knobs: {space.grid_size()} combinations (more than {MAX_GRID}); split the sweep")
    try:  # every constraint must evaluate on every point (a typo in a name shows here, not mid-sweep)
        points = space.grid()
    except SpaceError as e:
        raise SpaceError(f"{where}: {e}") from None
    if not points:
        raise SpaceError(f"{where}: constraints: no combination of the knobs satisfies them")
    if not space.allowed(space.baseline):
        raise SpaceError(f"{where}: baseline: {_cut(key_of(space.baseline))} violates the constraints")
    if check_trainer:
        _check_world(space, points, where)
    return space


def _check_world(space: Space, points: list[dict[str, Any]], where: str) -> None:
    """Every allowed point must fit the space's ``nproc`` processes (pp * dp * ep == nproc, as the trainer's
    launcher checks): a point that cannot would only fail as a ``config`` trial, so it is a mistake of the
    space, said in one line naming the point (a constraint such as ``nproc % ep == 0`` excludes it)."""
    from moespec.config import ConfigError, resolve_world

    for p in points:
        env = {**space.base_config, **space.fixed, **p}
        if not all(k in env for k in ("ep", "dp")):
            return  # a trainer without these keys: nothing to check
        try:
            resolve_world(env, space.nproc)
        except ConfigError as e:
            raise SpaceError(f"{where}: nproc: {space.nproc} process(es) cannot run {_cut(key_of(p))} ({e}); "
                             "exclude it with a constraint") from None


def _flag(where: str, key: str, v) -> bool:
    if not isinstance(v, bool):
        raise SpaceError(f"{where}: {key}: must be true or false, got {short_repr(v)}")
    return v


def _kernel_table(where: str, v, base_dir: Path | None) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str):
        raise SpaceError(f"{where}: guided.kernel_table: must be a file path")
    p = Path(v)
    if not p.is_absolute() and base_dir is not None and (base_dir / p).is_file():
        p = base_dir / p
    if not p.is_file():
        raise SpaceError(f"{where}: guided.kernel_table: {v}: no such file")
    return str(p.resolve())


def _config_path(config: str, base_dir: Path | None) -> str:
    """A trainer config name (``tiny``) stays a name; an existing file path becomes absolute."""
    p = Path(config)
    for cand in (p, (base_dir / p) if base_dir is not None and not p.is_absolute() else None):
        if cand is not None and cand.is_file():
            return str(cand.resolve())
    return config


def _check_with_trainer(space: Space, where: str) -> None:
    """Resolve the trainer config and check every knob name and value with the trainer's loader."""
    req = {"config": space.config, "fixed": space.fixed, "baseline": space.baseline, "knobs": space.knobs}
    try:
        r = subprocess.run([sys.executable, "-m", "autotune._trainer_check"], input=json.dumps(req, default=str),
                           capture_output=True, text=True, timeout=120, cwd=str(Path(__file__).resolve().parents[1]))
        res = json.loads(r.stdout)
    except (OSError, ValueError, subprocess.TimeoutExpired) as e:
        raise SpaceError(f"{where}: config: cannot ask the trainer's config loader ({type(e).__name__})") from None
    if res.get("error"):
        key = f"fixed.{res['error_key']}" if res.get("error_key") in space.fixed else "config"
        raise SpaceError(f"{where}: {key}: {res['error']}")
    keys = set(res["keys"])
    for k in space.knobs:
        if k not in keys:
            raise SpaceError(f"{where}: knobs.{k}: not a trainer config key")
    if res["bad"]:
        name, i, msg = res["bad"][0]
        raise SpaceError(f"{where}: knobs.{name}[{i}]: {short_repr(space.knobs[name][i])} rejected by the trainer ({msg})")
    space.base_config = res["base"]
