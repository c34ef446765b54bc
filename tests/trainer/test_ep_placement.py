"""CI: ``ep_placement: balanced`` (moespec/placement.py, trainer/model/moe.py).

* On 4 gloo ranks, EP 4 and EP 2 (_ep_placement_worker.py): one MoE layer with a balanced placement computed
  from its own routing equals the contiguous layer bit for bit (outputs, input / gate / shared-expert
  gradients, expert weight gradients gathered into the logical order) through nccl (levels 0 and 3), capacity
  and symm (emulated) without drops, serial and overlapped; the routing log counts logical experts under
  both; with drops the balanced layer drops exactly the rows the capacity rule drops with the slots' peers.
* The trainer end to end (4 ranks, ep 4; in the same launch, each run's arguments parsed as the trainer's
  command line parses them): a contiguous run writes routing.json, a balanced run reads it, trains the same
  losses, records the placement in its manifest and its routing file. The launcher refuses a bad loads file
  before any rank starts.
* Bad input: one line, exit 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.moespec.test_placement import routing_doc
from tests.trainer._workers import run_worker

REPO = Path(__file__).resolve().parents[2]
TOL = 1e-5  # fp32; the drop cases' reference sums in another order (measured <= 3e-6)


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep_placement")
    return out, run_worker("_ep_placement_worker.py", out, env={"TRITON_INTERPRET": "1"})


@pytest.fixture(scope="module")
def results(launch):
    return launch[1]


@pytest.mark.slow
def test_balanced_equals_contiguous_bit_for_bit(results):
    assert len(results) == 2 * 10
    for key, res in results.items():
        assert "error" not in res, (key, res)
        assert res["moved"] > 0, key  # the placement really moves experts to other ranks
        before, after = res["imbalance"]
        assert after < before, key
        assert res["counts_equal"], key  # the routing log counts logical experts under both placements
        if "/f8.0" in key:
            assert all(res["bitwise"].values()), (key, res["err"])
            assert res["dropped"] == [0, 0], key


@pytest.mark.slow
def test_with_drops_the_slots_peers_decide(results):
    drops = {k: v for k, v in results.items() if "/f0.6" in k}
    assert len(drops) == 2 * 3
    for key, res in drops.items():
        assert max(res["err"].values()) < TOL, (key, res["err"])
        contiguous, balanced = res["dropped"]
        assert balanced == res["want_dropped"] > 0, key
        assert balanced <= contiguous, key  # even peers: fewer rows past a peer's capacity


def _sets(sets) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


def _launch(tmp_path, name, *sets, nproc=4):
    args = [sys.executable, "-m", "trainer.launch", "--config", "tiny", "--nproc", str(nproc),
            *_sets(["ep=4", "steps=6", "profile_step_end=0", "log_every=0", *sets]), "-o", str(tmp_path / name)]
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.slow
def test_trainer_balanced_run_from_a_previous_routing_file(launch):
    out, _ = launch
    loads = out / "contiguous" / "routing.json"
    a = json.loads((out / "contiguous" / "manifest.json").read_text())
    b = json.loads((out / "balanced" / "manifest.json").read_text())
    assert a["status"] == b["status"] == "complete" and a["world_size"] == b["world_size"] == 4
    assert a["ep_placement"] == {"mode": "contiguous"}
    pl = b["ep_placement"]
    assert pl["mode"] == "balanced" and pl["loads_file"] == str(loads) and pl["ep"] == 4
    assert pl["loads_run"]["run_id"] == a["run_id"]
    assert [ly["layer"] for ly in pl["layers"]] == [1, 2]
    for ly in pl["layers"]:
        assert sorted(e for r in ly["ranks"] for e in r) == list(range(8)) and all(len(r) == 2 for r in ly["ranks"])
        assert ly["imbalance_balanced"] <= ly["imbalance_contiguous"]
    # the same model, only where the experts live changed: the same losses (the clip's norm sums the experts'
    # squares in another order: not bit for bit)
    for x, y in zip(a["metrics"]["loss"], b["metrics"]["loss"], strict=True):
        assert abs(x - y) <= 1e-5 * abs(x), (a["metrics"]["loss"], b["metrics"]["loss"])
    # routing.json: per logical expert (comparable with the contiguous run's), with the placement it ran under
    ra = json.loads(loads.read_text())
    rb = json.loads((out / "balanced" / "routing.json").read_text())
    assert "placement" not in ra
    assert rb["placement"] == {"mode": "balanced", "layers": [{"layer": ly["layer"], "ranks": ly["ranks"]}
                                                               for ly in pl["layers"]]}
    assert [r["layers"][0]["total"] for r in ra["ranks"]] == [r["layers"][0]["total"] for r in rb["ranks"]]


def _trainer(tmp_path, *sets):
    return subprocess.run([sys.executable, "-m", "trainer", "--config", "tiny", *_sets(sets), "-o", str(tmp_path / "run")],
                          cwd=REPO, capture_output=True, text=True, timeout=120, check=False)


def _bad_files(tmp_path):
    files = {}
    for name, doc in {"manifest": {"schema_version": 1, "status": "complete"}, "e16": routing_doc(E=16),
                      "layers": routing_doc(layers=(1, 2, 3)),
                      "idle": routing_doc(count=lambda r, lid, e: 0 if lid == 2 else 1)}.items():
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps(doc))
    files["cut"] = tmp_path / "cut.json"
    files["cut"].write_text(json.dumps(routing_doc())[:50])
    return files


@pytest.mark.parametrize("sets, needle", [
    (["ep_placement=balanced", "ep_placement_loads=x.json"], "ep_placement: 'balanced' needs expert parallelism (ep > 1)"),
    (["ep=2", "ep_placement=balanced"], "ep_placement_loads: ep_placement=balanced needs the expected expert loads"),
    (["ep=2", "ep_placement_loads=x.json"], "ep_placement_loads: is read only by ep_placement=balanced"),
    (["ep=2", "ep_placement=even"], "ep_placement: 'even' is not one of contiguous, balanced"),
    (["ep=2", "ep_placement=balanced", "ep_placement_loads={missing}"], "ep_placement_loads: {missing}: no such file"),
    (["ep=2", "ep_placement=balanced", "ep_placement_loads={manifest}"],
     "ep_placement_loads: {manifest}: not a routing-counts file (format 'None'"),
    (["ep=2", "ep_placement=balanced", "ep_placement_loads={cut}"],
     "ep_placement_loads: {cut}: not a complete JSON document (truncated?)"),
    (["ep=2", "ep_placement=balanced", "ep_placement_loads={e16}"],
     "ep_placement_loads: {e16}: routes over n_routed_experts = 16, the model has 8"),
    (["ep=2", "ep_placement=balanced", "ep_placement_loads={layers}"],
     "ep_placement_loads: {layers}: holds MoE layers [1, 2, 3], the model's are [1, 2]"),
    (["ep=2", "ep_placement=balanced", "ep_placement_loads={idle}"],
     "ep_placement_loads: {idle}: MoE layer 2 routed no token in that run"),
])
def test_bad_placement_input_is_one_line_exit_2(tmp_path, capsys, sets, needle):
    """The trainer's command line (``trainer.cli.main``, what ``python -m trainer`` runs) in this process: the loads
    file is read with the config, before any training; the command itself is run by the next test."""
    from trainer.cli import main

    files = {**_bad_files(tmp_path), "missing": tmp_path / "nope" / "routing.json"}
    sets = [s.format(**files) for s in sets]
    rc = main(["--config", "tiny", *_sets(sets), "-o", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2, (rc, err[-2000:])
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle.format(**files) in lines[0], err
    assert lines[0].startswith("config error: ")
    assert not (tmp_path / "run").exists()


def test_a_bad_loads_file_is_one_line_exit_2_from_the_command(tmp_path):
    """``python -m trainer`` itself: exit status 2, one line, no traceback."""
    r = _trainer(tmp_path, "ep=2", "ep_placement=balanced", f"ep_placement_loads={tmp_path / 'none.json'}")
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"config error: ep_placement_loads: {tmp_path / 'none.json'}: "
                                                   "no such file"), r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "run").exists()


def test_the_launcher_refuses_a_bad_loads_file_before_any_rank_starts(tmp_path):
    r = _launch(tmp_path, "run", "ep_placement=balanced", f"ep_placement_loads={tmp_path / 'none.json'}", nproc=4)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    want = (f"config error: ep_placement_loads: {tmp_path / 'none.json'}: no such file (ep_placement_loads: "
            "the routing.json of an earlier run)")
    assert lines == [want], r.stderr
    assert not (tmp_path / "run" / "logs").exists()  # torchrun never started
