"""The bounded YAML loader (moespec.yaml_bounded): a "billion laughs" document of a few hundred bytes is
rejected while it is composed, in one line, before any expanded value exists; ordinary aliases, merge
keys and documents up to the bounds load as PyYAML loads them."""

from __future__ import annotations

import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
import yaml

from moespec.yaml_bounded import MAX_NODES, YAMLBoundError, check_expansion, safe_load, short_repr

REPO = Path(__file__).resolve().parents[2]


def laughs(levels: int = 9, width: int = 9, flow: bool = False) -> str:
    """The classic document: level k is a list of `width` aliases of level k-1 (width**levels leaves)."""
    names = [chr(ord("a") + i) for i in range(levels)]
    rows = ["&a [" + ",".join(['"lol"'] * width) + "]"]
    rows += [f"&{n} [" + ",".join([f"*{p}"] * width) + "]" for p, n in zip(names, names[1:])]
    if flow:  # one value (for `--set key=VALUE`)
        return "[" + ", ".join(rows) + "]"
    return "".join(f"{n}: {r}\n" for n, r in zip(names, rows))


BILLION = laughs()  # 9**9 = 387,420,489 "lol"s in 342 bytes: GBs once anything walks it


def test_billion_laughs_is_rejected_while_composed():
    assert len(BILLION.encode()) < 500
    tracemalloc.start()
    t0 = time.process_time()  # CPU time of this process, whatever else runs
    with pytest.raises(YAMLBoundError) as e:
        safe_load(BILLION)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert time.process_time() - t0 < 2 and peak < 20 * 2**20  # nothing expanded
    assert isinstance(e.value, yaml.YAMLError) and "\n" not in e.value.problem
    assert e.value.problem.startswith(f"aliases (*name) expand this value to 5,380,840 nodes (at most {MAX_NODES:,})")
    assert e.value.problem_mark.line == 6  # the first level past the bound: g (9**7 leaves)


def test_expansion_just_past_the_bound_is_rejected_and_at_it_accepted():
    # level k is a list of 9 level k-1 lists: 9**0 + ... + 9**(k+1) nodes; g (k = 6) has 5,380,840.
    # Plain PyYAML returns it at once (as shared references); the bounded loader refuses it.
    assert yaml.safe_load(laughs(7))["g"][0][0][0][0][0][0] == ["lol"] * 9
    with pytest.raises(YAMLBoundError, match="5,380,840 nodes"):
        safe_load(laughs(7))
    n = check_expansion(yaml.compose(laughs(7)), max_nodes=10**7)[0]
    assert n == 1 + sum(1 + sum(9**j for j in range(k + 2)) for k in range(7))  # root + (key + level) each
    assert safe_load(laughs(7), max_nodes=n)["a"] == ["lol"] * 9
    with pytest.raises(YAMLBoundError, match=f"{n:,} nodes \\(at most {n - 1:,}\\)"):
        safe_load(laughs(7), max_nodes=n - 1)
    with pytest.raises(YAMLBoundError, match="characters of values"):
        safe_load("- &s " + "x" * 1000 + "\n" + "- *s\n" * 20, max_scalar_chars=20_000)


def test_recursive_alias_is_rejected():
    for doc in ("&a [*a]", "a: &a {x: [1, *a]}", "- &a\n  - &b [*a]\n"):
        with pytest.raises(YAMLBoundError, match="an alias refers to a node that contains it"):
            safe_load(doc)


def test_ordinary_yaml_loads_as_pyyaml_loads_it():
    docs = ["x: 1\ny: [1, 2.5, null, true, 'on']\n",
            "base: &b {lr: 0.001, steps: 4}\nrun: {<<: *b, steps: 8}\nsame: *b\n",
            "a: &a {x: 1, y: 2}\nb: &b {<<: [*a, *a]}\nc: {<<: [*b, *b], z: 3}\n",
            "knobs: {ids: &ids [[], [1], [0, 3]]}\nagain: *ids\n", "", "just a string", "- " + "[" * 50 + "]" * 50]
    for d in docs:
        assert safe_load(d) == yaml.safe_load(d)
    with pytest.raises(yaml.YAMLError, match="could not determine a constructor"):
        safe_load("x: !!python/name:os.system\n")  # still SafeLoader: no Python tags


@pytest.mark.parametrize("doc, shown", [("9" * 5000, "'99999999"), ("d: 2001-02-30", "'2001-02-30'"),
                                        ("x: !!int abc", "'abc'")])
def test_values_pyyaml_lets_through_as_valueerror_are_yaml_errors(doc, shown):
    with pytest.raises(yaml.YAMLError) as e:
        safe_load(doc)
    assert e.value.problem.startswith(f"cannot read the value {shown}") and e.value.problem_mark is not None
    assert len(e.value.problem) < 250


def test_short_repr_never_builds_the_whole_repr():
    x: list = ["lol"]
    for _ in range(300):  # 2**300 leaves through shared references
        x = [x, x]
    # this thread's CPU time, with a bound no whole repr could meet (2**300 leaves): the process's CPU time counted
    # the other threads a test before left running in the worker, and failed once at 0.30 s against 0.1 under load
    t0 = time.thread_time()
    text = short_repr(x)
    assert time.thread_time() - t0 < 2.0 and len(text) <= 83 and text.startswith("[[[")
    assert short_repr("x" * 10**6).endswith("'") and len(short_repr("x" * 10**6)) <= 83
    assert short_repr(list(range(10**6))) == "[0, 1, 2, 3, 4, 5, 6, 7, ...]"


def _err_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and len(lines[0]) < 600, r.stderr[-2000:]
    return lines[0]


def _run(args: list[str]) -> subprocess.CompletedProcess:
    # under a 2 GiB address-space limit: without the bound this would take GBs and die, not pass
    limit = "import resource; resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30)); "
    return subprocess.run([sys.executable, "-c", limit + "import runpy, sys; sys.argv = sys.argv[1:]; "
                           "runpy.run_module(sys.argv[0], run_name='__main__')", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def test_every_yaml_entry_point_rejects_it_in_one_line(tmp_path):
    """Trainer config file and --set value, autotune space file, tracelens whatif --set."""
    cfg = tmp_path / "laughs.yaml"
    cfg.write_text("seed: 1\nsteps: " + laughs(flow=True) + "\n")
    line = _err_line(_run(["trainer.launch", "--nproc", "1", "--config", str(cfg), "-o", str(tmp_path / "r")]))
    assert line.startswith(f"config error: config: {cfg}: invalid YAML: line 2, column ")
    assert "aliases (*name) expand this value to 5,380,840 nodes" in line
    line = _err_line(_run(["trainer.launch", "--nproc", "1", "--config", "tiny", "--set",
                           f"recompute_layer_ids={laughs(flow=True)}", "-o", str(tmp_path / "r")]))
    assert line.startswith("config error: recompute_layer_ids: invalid YAML: line 1, column ")
    assert "expand this value to 5,380,840 nodes" in line

    space = tmp_path / "space.yaml"
    space.write_text(BILLION + "config: tiny\nknobs: {recompute_layer_ids: [*i, []]}\n")
    line = _err_line(_run(["tracelens.cli", "autotune", str(space), "-o", str(tmp_path / "sweep")]))
    assert line.startswith(f"tracelens: error: {space}: not valid YAML (aliases (*name) expand this value to")
    assert not (tmp_path / "sweep").exists()

    line = _err_line(_run(["tracelens.cli", "whatif", str(tmp_path), "--set", f"micro_batch_size={laughs(flow=True)}"]))
    assert line.startswith("tracelens: error: --set 'micro_batch_size=[&a [") and "expand this value to 5,380,840" in line
    assert not (tmp_path / "r").exists()
