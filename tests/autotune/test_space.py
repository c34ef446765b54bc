"""Search-space YAML: parsing, validation with one-line errors naming the key, constraint filtering."""

from __future__ import annotations

import itertools

import pytest

from autotune.space import SpaceError, load_space, parse_space

BASE = {"config": "tiny", "knobs": {"sync_free_level": [0, 1, 2, 3], "grouped_gemm_backend": ["loop", "torch"]}}


def _err(doc, check_trainer=False) -> str:
    with pytest.raises(SpaceError) as e:
        parse_space(doc, "s.yaml", check_trainer=check_trainer)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("s.yaml: ")
    return msg


def test_defaults_and_baseline():
    s = parse_space(BASE, check_trainer=False)
    assert s.baseline == {"sync_free_level": 0, "grouped_gemm_backend": "loop"}  # first values
    assert (s.objective, s.maximize, s.metric) == ("tokens_per_s_per_gpu", True, "tokens_per_s_per_gpu")
    assert (s.max_trials, s.timeout_s, s.stall_s, s.explore, s.min_gain) == (20, 900.0, None, 0, 0.02)
    s = parse_space({**BASE, "baseline": {"grouped_gemm_backend": "torch"}, "objective": "step_time",
                     "budget": {"trials": 5, "wall_s": 60}, "trial": {"timeout_s": 30, "stall_s": 10, "env": {"A": 1}}},
                    check_trainer=False)
    assert s.baseline == {"sync_free_level": 0, "grouped_gemm_backend": "torch"}
    assert (s.maximize, s.metric, s.max_trials, s.wall_s, s.stall_s, s.trial_env) == (
        False, "mean_step_time_s", 5, 60.0, 10.0, {"A": "1"})


@pytest.mark.parametrize("doc, expect", [
    ([1, 2], "s.yaml: the search space must be a mapping"),
    ({**BASE, "knobz": {}}, "s.yaml: knobz: unknown key"),
    ({"knobs": BASE["knobs"]}, "s.yaml: config: missing"),
    ({"config": "tiny"}, "s.yaml: knobs: must map trainer config keys to lists of values"),
    ({"config": "tiny", "knobs": {"manual_gc": []}}, "s.yaml: knobs.manual_gc: must be a non-empty list"),
    ({"config": "tiny", "knobs": {"manual_gc": 5}}, "s.yaml: knobs.manual_gc: must be a non-empty list"),
    ({"config": "tiny", "knobs": {"manual_gc": [0, 5, 0]}}, "s.yaml: knobs.manual_gc: value 0 is listed twice"),
    ({**BASE, "baseline": {"manual_gc": 0}}, "s.yaml: baseline.manual_gc: not a knob"),
    ({**BASE, "baseline": {"sync_free_level": 7}}, "s.yaml: baseline.sync_free_level: 7 is not one of [0, 1, 2, 3]"),
    ({**BASE, "fixed": {"sync_free_level": 1}}, "s.yaml: fixed.sync_free_level: is also a knob"),
    ({**BASE, "fixed": [1]}, "s.yaml: fixed: must be a mapping"),
    ({**BASE, "constraints": "sync_free_level > 0"}, "s.yaml: constraints: must be a list of expressions"),
    ({**BASE, "constraints": ["sync_free_level >"]}, "s.yaml: constraints[0]: 'sync_free_level >' is not a Python expression"),
    ({**BASE, "constraints": ["n_layerz > 1"]}, "s.yaml: constraints[0]: 'n_layerz > 1' cannot be evaluated"),
    ({**BASE, "constraints": ["sync_free_level > 9"]}, "s.yaml: constraints: no combination of the knobs satisfies them"),
    ({**BASE, "constraints": ["sync_free_level > 0"]}, "s.yaml: baseline: "),
    ({**BASE, "objective": "speed"}, "s.yaml: objective: 'speed' is not one of"),
    ({**BASE, "budget": {"trials": 0}}, "s.yaml: budget.trials: must be >= 1, got 0"),
    ({**BASE, "budget": {"trials": "many"}}, "s.yaml: budget.trials: expected an integer, got 'many'"),
    ({**BASE, "budget": {"trails": 3}}, "s.yaml: budget.trails: unknown key"),
    ({**BASE, "trial": {"timeout_s": True}}, "s.yaml: trial.timeout_s: expected a number, got True"),
    # nan (YAML .nan) passed the bound check: the sweep started with a trial timeout that never fires
    ({**BASE, "trial": {"timeout_s": float("nan")}}, "s.yaml: trial.timeout_s: expected a number, got nan"),
    ({**BASE, "budget": {"wall_s": float("nan")}}, "s.yaml: budget.wall_s: expected a number, got nan"),
    ({**BASE, "guided": {"min_gain": float("nan")}}, "s.yaml: guided.min_gain: expected a number, got nan"),
    ({**BASE, "trial": {"env": {"A": [1]}}}, "s.yaml: trial.env: must map variable names"),
    ({**BASE, "nproc": 1.5}, "s.yaml: nproc: expected an integer, got 1.5"),
    ({**BASE, "command": "python x.py"}, "s.yaml: command: must be a non-empty list of strings"),
    ({**BASE, "guided": {"explore": -1}}, "s.yaml: guided.explore: must be >= 0, got -1"),
])
def test_schema_errors_are_one_line(doc, expect):
    assert _err(doc).startswith(expect)


def test_constraints_filter_the_grid():
    doc = {"config": "tiny", "knobs": {"pp": [1, 2, 4], "vpp": [1, 2, 3], "micro_batch_size": [1, 2]},
           "fixed": {"n_layers": 8},
           "constraints": ["n_layers % (pp * vpp) == 0", "not (pp == 1 and vpp > 1)", "pp * micro_batch_size <= 4"]}
    s = parse_space(doc, check_trainer=False)  # pipeline keys need not exist in the trainer for the schema
    expect = [{"pp": pp, "vpp": v, "micro_batch_size": m}
              for pp, v, m in itertools.product([1, 2, 4], [1, 2, 3], [1, 2])
              if 8 % (pp * v) == 0 and not (pp == 1 and v > 1) and pp * m <= 4]
    # by hand: pp1: vpp1 x mbs1,2; pp2: vpp1,2 x mbs1,2; pp4: vpp1,2 x mbs1 -> 2 + 4 + 2 = 8
    assert s.grid() == expect and len(expect) == 8
    assert s.allowed({"pp": 4, "vpp": 2, "micro_batch_size": 1})
    assert not s.allowed({"pp": 4, "vpp": 2, "micro_batch_size": 2})
    assert not s.allowed({"pp": 2, "vpp": 3, "micro_batch_size": 1})
    # constraints cannot reach Python's builtins beyond a few pure functions
    assert _err({**doc, "constraints": ["__import__('os') is None"]}).startswith("s.yaml: constraints[0]:")


def test_trainer_checks_names_values_and_resolves_config(tmp_path):
    s = parse_space({"config": "tiny", "knobs": {"sync_free_level": [0, 3]}, "fixed": {"n_layers": 4},
                     "constraints": ["n_layers == 4 and d_model == 64"]}, "s.yaml")
    assert s.base_config["n_layers"] == 4 and s.base_config["d_model"] == 64  # tiny.yaml + fixed
    assert _err({"config": "tiny", "knobs": {"sync_free_levle": [0]}}, True) == \
        "s.yaml: knobs.sync_free_levle: not a trainer config key"
    assert _err({"config": "tiny", "knobs": {"sync_free_level": [0, 4]}}, True) == (
        "s.yaml: knobs.sync_free_level[1]: 4 rejected by the trainer "
        "(config error: sync_free_level: must be 0, 1, 2 or 3, got 4)")
    # a value valid only next to another knob's value (zbv needs vpp=2; the baseline has vpp=1) is fine;
    # one valid with no combination is not
    pp = {"config": "tiny", "nproc": 2, "fixed": {"pp": 2, "microbatches": 4, "dp_mode": "ddp", "n_layers": 4}, "baseline": {"vpp": 1}}
    s = parse_space({**pp, "knobs": {"pipeline_schedule": ["1f1b", "zbv"], "vpp": [1, 2]},
                     "constraints": ["not (pipeline_schedule == 'zbv' and vpp != 2)"]}, "s.yaml")
    assert {"pipeline_schedule": "zbv", "vpp": 2} in s.grid() and len(s.grid()) == 3
    assert _err({**pp, "knobs": {"pipeline_schedule": ["1f1b", "zbv"], "vpp": [1, 3]}}, True).startswith(
        "s.yaml: knobs.pipeline_schedule[1]: 'zbv' rejected by the trainer (config error: vpp: ")
    assert _err({"config": "nope", "knobs": {"manual_gc": [0]}}, True) == \
        "s.yaml: config: config error: config: file not found: nope"
    assert _err({"config": "tiny", "knobs": {"manual_gc": [0]}, "fixed": {"stepz": 3}}, True) == \
        "s.yaml: fixed.stepz: config error: stepz: unknown config key"
    bad = tmp_path / "bad.yaml"
    bad.write_text("knobs: [1, 2\n")
    with pytest.raises(SpaceError, match=r"bad.yaml: not valid YAML") as e:
        load_space(bad)
    assert "\n" not in str(e.value)
    with pytest.raises(SpaceError, match=r"missing.yaml: cannot read"):
        load_space(tmp_path / "missing.yaml")


def test_example_spaces_load():
    from pathlib import Path

    spaces = sorted((Path(__file__).resolve().parents[2] / "autotune" / "spaces").glob("*.yaml"))
    assert spaces
    for p in spaces:
        s = load_space(p)
        assert s.grid() and s.allowed(s.baseline)


def test_config_file_paths_are_made_absolute(tmp_path, monkeypatch):
    """Trials run in the repository root, so a config file named relative to the space file (or the
    working directory) is resolved when the space is read."""
    (tmp_path / "cfgs").mkdir()
    (tmp_path / "cfgs" / "mine.yaml").write_text("n_layers: 5\nd_model: 32\n")
    (tmp_path / "space.yaml").write_text("config: cfgs/mine.yaml\nknobs: {manual_gc: [0, 1]}\n"
                                         "constraints: ['n_layers == 5']\n")
    monkeypatch.chdir("/")
    s = load_space(tmp_path / "space.yaml")
    assert s.config == str(tmp_path / "cfgs" / "mine.yaml") and s.base_config["d_model"] == 32
    assert parse_space({"config": "tiny", "knobs": {"manual_gc": [0]}}, check_trainer=False).config == "tiny"


def test_cli_bad_space_is_one_line_exit_2(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    bad = tmp_path / "s.yaml"
    bad.write_text("config: tiny\nknobs: {sync_free_level: [0, 5]}\n")
    r = subprocess.run([sys.executable, "-m", "tracelens.cli", "autotune", str(bad), "-o", str(tmp_path / "o")],
                       cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == (f"tracelens: error: {bad}: knobs.sync_free_level[1]: 5 rejected by the trainer "
                        "(config error: sync_free_level: must be 0, 1, 2 or 3, got 5)\n")
    assert not (tmp_path / "o").exists()  # nothing started


def test_cli_nan_in_a_space_file_is_one_line_exit_2(tmp_path):
    """`trial: {timeout_s: .nan}` was accepted and the sweep started trials."""
    import subprocess
    import sys
    from pathlib import Path

    bad = tmp_path / "s.yaml"
    bad.write_text("config: tiny\nknobs: {sync_free_level: [0, 1]}\ntrial: {timeout_s: .nan}\n")
    r = subprocess.run([sys.executable, "-m", "tracelens.cli", "autotune", str(bad), "-o", str(tmp_path / "o")],
                       cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == f"tracelens: error: {bad}: trial.timeout_s: expected a number, got nan\n"
    assert not (tmp_path / "o").exists()  # nothing started


@pytest.mark.parametrize("expr, construct", [
    ("().__class__.__base__.__subclasses__()", "attribute access (`.`): not allowed"),
    ("sum(range(10**12)) > 0", "calling 'range': not allowed"),
    ("__import__('os').system('touch pwned') == 0", "attribute access (`.`): not allowed"),
    ("__import__('os') is None", "calling '__import__': not allowed"),
    ("[x for x in [1, 2]] == []", "comprehensions: not allowed"),
    ("grouped_gemm_backend[0] == 'l'", "subscripts (`[...]`): not allowed"),
    ("(lambda: 1)() == 1", "lambda: not allowed"),
    ("f'{sync_free_level}' == '1'", "f-strings: not allowed"),
    ("sync_free_level | 1", "bit operations: not allowed"),
    ("max(sync_free_level, key=abs) > 0", "the keyword argument 'key' of max: not allowed"),
    ("sync_free_level is 1", "`is` / `is not` other than against None: not allowed"),
    ("{1: 2} != {}", "dict displays (`{...}`): not allowed"),
])
def test_constraints_outside_the_language_are_rejected_at_load(expr, construct):
    """Constraints are not Python: a tree walker over a whitelist. Anything else fails when the file
    is read, in one line naming the file, the constraint and the construct."""
    assert _err({**BASE, "constraints": [expr]}) == f"s.yaml: constraints[0]: {expr!r}: {construct}" + (
        " (callable: min max abs len sum any all int float bool)" if construct.startswith("calling") else
        " (only min and max take default=)" if "keyword" in construct else
        " (use == / !=)" if construct.startswith("`is`") else "")


def test_constraints_cannot_blow_up_work_or_memory():
    """No loops and bounded numbers: what hung or filled memory under eval ends at load, at once."""
    import time

    t0 = time.process_time()  # CPU time of this process: what other processes on the machine do not change
    for expr, why in [("10 ** 10 ** 10 > 0", "an exponent of 10000000000 (at most 64 in magnitude)"),
                      ("sync_free_level + 2 ** 64 * 2 ** 64 * 2 ** 64 > 0", "an integer beyond +-2**128"),
                      ("'x' * 10 ** 9 == ''", "* needs numbers, got str 'x'")]:
        assert _err({**BASE, "constraints": [expr]}).startswith(f"s.yaml: constraints[0]: {expr!r} cannot be evaluated")
        assert why in _err({**BASE, "constraints": [expr]})
    assert "nested too deeply" in _err({**BASE, "constraints": ["not " * 100 + "sync_free_level"]})
    assert "characters (at most 2000)" in _err({**BASE, "constraints": ["sync_free_level + " * 200 + "1 > 0"]})
    assert time.process_time() - t0 < 5


def test_constraint_language_covers_what_spaces_write():
    """The language keeps what space files use: chained comparisons, in / not in, min/max with
    default=, lists as values, conditional expressions, arithmetic with Python's semantics."""
    knobs = {"pp": [1, 2, 4], "vpp": [1, 2], "recompute_layer_ids": [[], [1], [0, 3]],
             "grouped_gemm_backend": ["loop", "torch"]}
    doc = {"config": "tiny", "knobs": knobs, "fixed": {"n_layers": 4, "data_path": None},
           "constraints": ["1 <= pp * vpp <= 4", "grouped_gemm_backend in ('loop', 'torch')",
                           "grouped_gemm_backend not in ['triton']", "max(recompute_layer_ids, default=0) < n_layers",
                           "len(recompute_layer_ids) <= pp if data_path is None else False",
                           "n_layers % (pp * vpp) == 0 and -pp < abs(-vpp) ** 2 + n_layers // 3 - 7 / 2 + 1",
                           "sum(recompute_layer_ids) >= 0 or any([pp == 4, vpp == 2]) or not all([])"]}
    s = parse_space(doc, check_trainer=False)
    expect = [p for p in (dict(zip(knobs, v)) for v in itertools.product(*knobs.values()))
              if 1 <= p["pp"] * p["vpp"] <= 4 and max(p["recompute_layer_ids"], default=0) < 4
              and len(p["recompute_layer_ids"]) <= p["pp"] and 4 % (p["pp"] * p["vpp"]) == 0
              and -p["pp"] < abs(-p["vpp"]) ** 2 + 4 // 3 - 7 / 2 + 1]
    # by hand: (pp, vpp) in (1,1) (1,2) (2,1) (2,2) (4,1); recompute lists <= pp long: 2+2+3+3+3 = 13; x 2 backends
    assert s.grid() == expect and len(expect) == 26


def test_example_spaces_use_only_the_language():
    """Every shipped space file's constraints compile (the trainer-free part of test_example_spaces_load)."""
    from pathlib import Path

    import yaml

    from autotune.constraints import compile_constraint

    spaces = sorted((Path(__file__).resolve().parents[2] / "autotune" / "spaces").glob("*.yaml"))
    exprs = [c for p in spaces for c in (yaml.safe_load(p.read_text()).get("constraints") or [])]
    assert len(exprs) >= 10
    for c in exprs:
        compile_constraint(c)


def test_space_file_is_bounded_yaml(tmp_path):
    """The space file goes through the project's bounded YAML loader (moespec.yaml_bounded): aliases
    that would expand it without end, a huge or non-text file, a FIFO are one line naming the file."""
    import os

    laughs = tmp_path / "laughs.yaml"
    laughs.write_text("config: tiny\nknobs:\n  manual_gc: [0, 1]\n  recompute_layer_ids: [[], &a [1, 1, 1, 1, 1, 1, 1, 1]"
                      + "".join(f", &{n} [" + ", ".join([f"*{p}"] * 8) + "]" for p, n in zip("abcdefgh", "bcdefghi")) + "]\n")
    with pytest.raises(SpaceError) as e:
        load_space(laughs, check_trainer=False)
    assert str(e.value).startswith(f"{laughs}: not valid YAML (aliases (*name) expand this value to ")
    big = tmp_path / "big.yaml"
    big.write_text("config: tiny\n" + "#" * (1 << 20))
    with pytest.raises(SpaceError, match=r"big.yaml: 1048589 bytes is too large for a space file \(at most 1048576\)"):
        load_space(big, check_trainer=False)
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"config: \xff\xfe\n")
    with pytest.raises(SpaceError, match=r"bin.yaml: not a UTF-8 text file \(byte 8\)"):
        load_space(binary, check_trainer=False)
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    with pytest.raises(SpaceError, match=r"fifo.yaml: cannot read: not a regular file"):
        load_space(fifo, check_trainer=False)


def test_every_point_must_fit_nproc_and_constraints_can_read_it():
    doc = {"config": "tiny", "nproc": 4, "knobs": {"ep": [1, 2, 8]}, "fixed": {"n_routed_experts": 16}}
    assert _err(doc, True) == ('s.yaml: nproc: 4 process(es) cannot run {"ep":8} (config error: ep: world size 4 is '
                               'not a multiple of ep = 8: no whole dp (dp*ep must be the world size)); exclude it '
                               'with a constraint')
    s = parse_space({**doc, "constraints": ["nproc % ep == 0"]}, "s.yaml")
    assert s.grid() == [{"ep": 1}, {"ep": 2}]
    # a fixed dp that the world cannot hold is named too (here: every point)
    assert _err({**doc, "knobs": {"ep": [1, 2]}, "fixed": {"dp": 4}}, True).startswith(
        's.yaml: nproc: 4 process(es) cannot run {"ep":2} (config error: dp: world size 4 != dp*ep = 4*2)')


@pytest.mark.parametrize("name, nproc, points", [("tiny_cpu_ep.yaml", 4, 13), ("gpu_ep4.yaml", 4, 18)])
def test_ep_spaces_search_the_dispatch_knobs_only_where_the_trainer_takes_them(name, nproc, points):
    """The EP spaces' constraints leave out exactly the points the trainer refuses (a dispatch knob off its
    default at ep=1) and the ones that repeat another (the capacity factor without the capacity path, the chunk
    count without the overlap); every point left is a valid trainer config on ``nproc`` processes."""
    from pathlib import Path

    from moespec.config import ConfigError, load_config, resolve_world

    space = load_space(Path(__file__).resolve().parents[2] / "autotune" / "spaces" / name)
    assert space.nproc == nproc and len(space.grid()) == points
    names = list(space.knobs)
    for vals in itertools.product(*space.knobs.values()):
        p = dict(zip(names, vals))
        try:
            # the GPU space's points are for GPUs (ep_dispatch=symm is refused on a CPU)
            cfg = load_config(space.config, {**space.fixed, **p, "device": "cuda" if name.startswith("gpu") else "cpu"})
            resolve_world(cfg, space.nproc)
            valid = True
        except ConfigError:
            valid = False
        repeats = ((p.get("ep_capacity_factor", 1.25) != 1.25 and p["ep_dispatch"] not in ("capacity", "symm"))
                   or (p.get("ep_overlap_chunks", 2) != 2 and not p["ep_overlap"]))
        assert space.allowed(p) == (valid and not repeats), p
        if p["ep"] == 1:
            assert valid == (p["ep_dispatch"] == "nccl" and not p["ep_overlap"]
                             and p.get("ep_overlap_schedule", "chunked") == "chunked"), p
