"""Interval arithmetic against a brute-force reference on a bitmap."""

from __future__ import annotations

import numpy as np
import pytest

from tracelens.analysis import intervals as I


def brute(starts, ends, size=400):
    bits = np.zeros(size, dtype=bool)
    for s, e in zip(starts, ends):
        bits[s:e] = True
    return bits


@pytest.mark.parametrize("seed", range(30))
def test_union_matches_bitmap(seed):
    rng = np.random.default_rng(seed)
    n = rng.integers(0, 40)
    s = rng.integers(0, 350, n)
    e = s + rng.integers(0, 50, n)
    assert I.length(s, e) == brute(s, e).sum()
    us, ue = I.union(s, e)
    assert (us[1:] > ue[:-1]).all() if len(us) > 1 else True  # disjoint, sorted, not touching
    bits = np.zeros(400, dtype=bool)
    for a, b in zip(us, ue):
        bits[a:b] = True
    assert (bits == brute(s, e)).all()


@pytest.mark.parametrize("seed", range(10))
def test_exposed_identity(seed):
    rng = np.random.default_rng(100 + seed)
    a_s = rng.integers(0, 300, 20); a_e = a_s + rng.integers(1, 60, 20)
    b_s = rng.integers(0, 300, 20); b_e = b_s + rng.integers(1, 60, 20)
    A, B = brute(a_s, a_e), brute(b_s, b_e)
    assert I.union_length((a_s, a_e), (b_s, b_e)) - I.length(b_s, b_e) == (A & ~B).sum()


def test_hand_cases():
    assert I.length([0, 5, 20], [10, 15, 30]) == 25  # [0,15) + [20,30)
    assert I.length([], []) == 0
    assert I.length([5], [5]) == 0
    s, e = I.gaps([0, 20], [10, 30])
    assert s.tolist() == [10] and e.tolist() == [20]
    cs, ce = I.clip(np.array([0, 50]), np.array([100, 60]), 10, 55)
    assert cs.tolist() == [10, 50] and ce.tolist() == [55, 55]
