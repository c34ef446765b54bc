"""moespec.placement: the balanced expert placement against a brute-force optimum (every partition of the
experts into ep groups of E/ep), the guarantees its docstring states, and the loads file's one-line errors."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from moespec.placement import (
    PlacementError,
    balanced_placement,
    contiguous_placement,
    imbalance,
    plan_layer,
    rank_loads,
    read_loads,
    slot_map,
)


def _partitions(items: list[int], el: int):
    """Every split of ``items`` into groups of ``el`` (unordered groups: the first item anchors each)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for mates in itertools.combinations(rest, el - 1):
        group = (first, *mates)
        left = [x for x in rest if x not in mates]
        for tail in _partitions(left, el):
            yield [group, *tail]


def _optimum(loads: list[int], ep: int) -> int:
    return min(max(rank_loads(loads, p)) for p in _partitions(list(range(len(loads))), len(loads) // ep))


SHAPES = [(4, 2), (6, 2), (6, 3), (8, 2), (8, 4), (9, 3)]


def _cases(seed: int, per_shape: int):
    rng = random.Random(seed)
    for E, ep in SHAPES:
        for i in range(per_shape):
            if i % 2:  # heavy-tailed, like a fresh router's (one expert at several times the mean)
                loads = [int(rng.paretovariate(1.2) * 10) for _ in range(E)]
            else:
                loads = [rng.randint(0, 30) for _ in range(E)]
            yield loads, ep


def test_against_the_brute_force_optimum():
    """Valid, never above the contiguous placement, within the additive bound of the perfect split, never
    below the optimum (the brute force is right); and how close to the optimum it gets, measured: on these
    600 cases it found the optimum in all but 7, at most 2.2 % above it."""
    above, worst = 0, 1.0
    for loads, ep in _cases(seed=0, per_shape=100):
        E, el = len(loads), len(loads) // ep
        got = balanced_placement(loads, ep)
        assert sorted(e for r in got.ranks for e in r) == list(range(E))
        assert all(len(r) == el for r in got.ranks)
        peak = max(rank_loads(loads, got.ranks))
        best = _optimum(loads, ep)
        assert peak >= best
        assert peak <= max(rank_loads(loads, contiguous_placement(E, ep)))
        assert got.swap_optimal
        assert peak <= sum(loads) / ep + (1 - 1 / ep) * (max(loads) - min(loads)) + 1e-9
        if peak > best:
            above += 1
            worst = max(worst, peak / best)
    assert above == 7 and worst < 1.022, (above, worst)


def test_a_case_where_the_heuristic_misses_the_optimum():
    """The problem is NP-hard: here LPT + swaps stop at 54 where the brute force finds 52."""
    loads = [4, 28, 18, 17, 26, 22, 9, 15, 17]
    got = balanced_placement(loads, 3)
    assert max(rank_loads(loads, got.ranks)) == 54 and _optimum(loads, 3) == 52


def test_one_hot_expert_is_paired_with_the_coldest():
    # expert 0 takes 7x the mean expert load (issue 33's fresh router): its rank gets the three coldest others
    loads = [70, 10, 10, 10, 10, 10, 10, 10, 1, 2, 3, 4, 10, 10, 10, 10]
    got = balanced_placement(loads, 4)
    assert got.ranks[0] == (0, 8, 9, 10)
    assert imbalance(loads, got.ranks) == pytest.approx(76 / (190 / 4))  # = max(mean, p_max + 6): the best there is
    assert imbalance(loads, contiguous_placement(16, 4)) == pytest.approx(100 / (190 / 4))


def test_slots_and_plan():
    lp = plan_layer(3, [5, 1, 1, 5], 2)
    assert lp.ranks == ((0, 1), (2, 3)) or lp.ranks == ((0, 2), (1, 3))
    assert lp.imbalance_balanced == 1.0 and lp.imbalance_contiguous == 1.0
    assert slot_map(((1, 3), (0, 2))) == [2, 0, 3, 1]
    lp = plan_layer(1, [9, 8, 1, 1], 2)
    assert lp.ranks == ((0, 3), (1, 2)) and lp.slots == [0, 2, 3, 1]
    assert lp.imbalance_contiguous == pytest.approx(17 / 9.5) and lp.imbalance_balanced == pytest.approx(10 / 9.5)


@pytest.mark.parametrize("loads, ep, msg", [
    ([1, 2, 3], 2, "do not split evenly"), ([1, 2], 1, "ep >= 2"), ([1, -1], 2, ">= 0"),
    ([1.0, float("nan")], 2, "finite"),
])
def test_bad_arguments(loads, ep, msg):
    with pytest.raises(ValueError, match=msg):
        balanced_placement(loads, ep)


def routing_doc(E=8, layers=(1, 2), ranks=2, count=lambda r, lid, e: 1 + (e == 0) * 9 * lid):
    return {"format": "moe-routing-counts", "schema_version": 1, "run": {"run_id": "r1", "name": "n", "created_utc": "t"},
            "n_routed_experts": E, "top_k": 2, "d_model": 64, "dtype": "fp32", "ep": 2, "tokens_per_microbatch": 256,
            "steps": 3, "profiled_steps": [], "ranks": [
                {"rank": r, "ep_rank": r, "ep_group": list(range(ranks)), "pp_rank": 0,
                 "layers": [{"layer": lid, "total_forwards": 3, "total": [count(r, lid, e) for e in range(E)], "steps": []}
                            for lid in layers]} for r in range(ranks)]}


def test_read_loads_sums_the_ranks(tmp_path):
    p = tmp_path / "routing.json"
    p.write_text(json.dumps(routing_doc()))
    loads, run = read_loads(p, 8, [1, 2])
    assert loads == {1: [20, 2, 2, 2, 2, 2, 2, 2], 2: [38, 2, 2, 2, 2, 2, 2, 2]}
    assert run == {"run_id": "r1", "name": "n", "created_utc": "t"}


@pytest.mark.parametrize("write, E, layers, msg", [
    (None, 8, [1, 2], "no such file"),
    (b'{"format": "moe-rout', 8, [1, 2], "not a complete JSON document (truncated?)"),
    (b"\xff\xfe", 8, [1, 2], "not a UTF-8 text file"),
    ({"format": "x"}, 8, [1, 2], "not a routing-counts file (format 'x'"),
    ([1, 2], 8, [1, 2], "not a routing-counts file (format 'list'"),
    (routing_doc(), 16, [1, 2], "routes over n_routed_experts = 8, the model has 16"),
    (routing_doc(), 8, [1, 2, 3], "holds MoE layers [1, 2], the model's are [1, 2, 3]"),
    (routing_doc(count=lambda r, lid, e: 0 if lid == 2 else 1), 8, [1, 2], "MoE layer 2 routed no token"),
    ({**routing_doc(), "schema_version": 9}, 8, [1, 2], "schema_version '9'"),
])
def test_read_loads_errors_are_one_line_naming_the_file(tmp_path, write, E, layers, msg):
    p = tmp_path / "loads.json"
    if isinstance(write, bytes):
        p.write_bytes(write)
    elif write is not None:
        p.write_text(json.dumps(write))
    with pytest.raises(PlacementError) as err:
        read_loads(p, E, layers)
    text = str(err.value)
    assert text.startswith(f"{p}: ") and msg in text and "\n" not in text, text


def test_a_malformed_count_list_is_named(tmp_path):
    doc = routing_doc()
    doc["ranks"][1]["layers"][0]["total"] = [1, 2]
    p = tmp_path / "routing.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(PlacementError, match=r"ranks\[1\]\.layers\[0\]\.total: not a list of n_routed_experts = 8"):
        read_loads(p, 8, [1, 2])
