"""Every row of benchmarks/bench_ep.sh is a trainer config its world size can hold: the rows run only on GPU
machines (some only on 8-GPU kinds, lent at times), so a typo or a layout the world cannot hold would otherwise
be found there, in device time. Each row's `--set`s (its variables expanded as the script defines them) go
through the trainer's own config loading and world resolution."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from moespec.config import load_config, resolve_world
from moespec.yaml_bounded import safe_load

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_ep.sh"


def _rows() -> dict[str, tuple[int, dict]]:
    text = SCRIPT.read_text()
    env = {"WORK": "/tmp/work", "CAPF": "1.25"}
    for name, value in re.findall(r'^([A-Z]+)="(.*)"$', text, flags=re.M):  # STEPS=, PROF=, CAP=, ...
        env[name] = value
    body = text[text.index("declare -A RUNS=("):]
    body = body[:body.index("\n)\n")]
    rows = {}
    for name, spec in re.findall(r'^\s*\[(\w+)\]="(.*)"$', body, flags=re.M):
        for _ in range(3):  # variables that name variables ($CAP inside $BAL's siblings)
            spec = re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: env.get(m.group(1), m.group(2)), spec)
            spec = re.sub(r"\$(\w+)", lambda m: env.get(m.group(1), ""), spec)
        argv = shlex.split(spec)
        nproc, sets, i = int(argv[0]), {}, 1
        while i < len(argv):
            if argv[i] == "--set":
                k, _, v = argv[i + 1].partition("=")
                sets[k] = safe_load(v)
                i += 2
            elif argv[i] == "--sync-free-level":
                sets["sync_free_level"] = int(argv[i + 1])
                i += 2
            else:
                raise AssertionError(f"row {name}: an argument this test does not know: {argv[i]}")
        rows[name] = (nproc, sets)
    return rows


ROWS = _rows()


def test_the_rows_are_read():
    assert len(ROWS) > 40 and {"dp4", "ep4_cap", "dp8", "ep8_cap_ovl", "pp4_ep2_vpp2"} <= set(ROWS)
    assert ROWS["ep8_cap"][0] == 8 and ROWS["ep8_cap"][1]["ep_dispatch"] == "capacity"


@pytest.mark.parametrize("name", sorted(ROWS))
def test_every_row_is_a_config_its_world_holds(name):
    nproc, sets = ROWS[name]
    cfg = load_config("gpu_proxy_train", sets)
    dp, ep = resolve_world(cfg, nproc)
    assert dp * ep * int(cfg.get("pp") or 1) == nproc
