"""Expert placement by load (``ep_placement: balanced``): which EP rank holds which routed expert, per MoE layer.

Under expert parallelism the rank whose experts receive the most rows sets the pace of every all-to-all
(the others wait inside the collective), and the capacity paths drop the rows past a peer's capacity. The
contiguous placement (rank ``p`` holds experts ``[p*El, (p+1)*El)``) puts hot experts wherever their ids
happen to fall. Given each expert's expected load (tokens routed to it, from the routing counts of an
earlier run of the same model), :func:`balanced_placement` assigns exactly ``El = E/ep`` experts to every
rank so that the most loaded rank carries as little as it can find: DeepSeek's EPLB without redundant
experts.

The algorithm, per layer:

1. **LPT with a cardinality limit**: experts in decreasing load (ties: lower id first), each to the least
   loaded rank that still has fewer than ``El`` experts (ties: lower rank).
2. **Swap refinement**, from that start and from the contiguous placement: while some swap of one expert
   of a most-loaded rank ``A`` with one expert of another rank ``B`` lowers ``max(load A, load B)`` below
   ``load A``, make the best such swap. Each swap makes the sorted vector of rank loads lexicographically
   smaller, so this ends (a cap of ``E*E`` swaps bounds the time; ``swap_optimal`` says whether it ended
   on its own).
3. The better of the two refined placements (lower maximum; ties: the LPT one).

What it guarantees (``tests/moespec/test_placement.py`` checks each against a brute-force optimum):

* every rank holds exactly ``El`` experts, each expert lives on exactly one rank (a valid placement);
* the maximum rank load is never above the contiguous placement's;
* at a swap-local optimum (``swap_optimal``): for every rank ``B``, ``load(A) - load(B) <= p_max - p_min``
  (largest and smallest expert load), since otherwise swapping ``A``'s smallest item that is larger than
  one of ``B``'s with that one would lower the maximum. Hence ``max <= mean + (1 - 1/ep) * (p_max - p_min)``,
  where ``mean`` (the perfect split) is a lower bound on the optimum;
* nothing more: balancing with a cardinality constraint is NP-hard, and on small cases the result is
  sometimes above the optimum (the test measures how often and by how much). No placement brings the
  maximum below ``max(mean, p_max)``: an expert hotter than the mean rank load stays the bottleneck
  (that needs redundant experts, which this placement does not make).

Pure Python (the trainer builds the model from it, `tracelens moe` predicts the gain with it): the
standard library only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROUTING_FORMAT = "moe-routing-counts"  # trainer/routing_log.py's file (docs/trainer.md "Routing counts")
ROUTING_SCHEMA_VERSIONS = (1,)
PLACEMENTS = ("contiguous", "balanced")
MAX_LOADS_BYTES = 512 << 20


class PlacementError(ValueError):
    """A loads file that cannot give a placement for this model; ``str(err)`` is one line naming the file."""


# ------------------------------------------------------------------------------------------ the algorithm


def contiguous_placement(n_experts: int, ep: int) -> list[list[int]]:
    """Rank ``p`` holds experts ``[p*El, (p+1)*El)`` (the trainer's default)."""
    _check_sizes(n_experts, ep)
    el = n_experts // ep
    return [list(range(p * el, (p + 1) * el)) for p in range(ep)]


def rank_loads(loads: Sequence[float], ranks: Sequence[Sequence[int]]) -> list[float]:
    """The load of each rank: the sum of its experts' loads."""
    return [sum(loads[e] for e in r) for r in ranks]


def imbalance(loads: Sequence[float], ranks: Sequence[Sequence[int]]) -> float | None:
    """Max / mean of the rank loads (1.0 = perfectly even); None when nothing is routed."""
    per = rank_loads(loads, ranks)
    total = sum(per)
    if total <= 0:
        return None
    return max(per) / (total / len(per))


def slot_map(ranks: Sequence[Sequence[int]]) -> list[int]:
    """Logical expert -> physical slot: expert ``ranks[p][i]`` lives in slot ``p*El + i`` (rank ``p``, local
    expert ``i``), the layout the dispatch and the grouped GEMMs work in."""
    el = len(ranks[0])
    out = [-1] * (el * len(ranks))
    for p, r in enumerate(ranks):
        for i, e in enumerate(r):
            out[e] = p * el + i
    return out


@dataclass(frozen=True)
class Balanced:
    """The result of :func:`balanced_placement`: the experts of each rank (ascending), whether the swap
    refinement ended at a local optimum (not at its cap), and which start won (``lpt`` or ``contiguous``)."""

    ranks: tuple[tuple[int, ...], ...]
    swap_optimal: bool
    start: str


def balanced_placement(loads: Sequence[float], ep: int) -> Balanced:
    """Experts to ranks, ``E/ep`` each, with the maximum rank load as low as the algorithm of the module
    docstring finds. ``loads``: one non-negative number per expert (e.g. tokens routed to it)."""
    E = len(loads)
    _check_sizes(E, ep)
    if any(not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0 for v in loads):
        raise ValueError("loads must be finite numbers >= 0")
    el = E // ep
    order = sorted(range(E), key=lambda e: (-loads[e], e))
    lpt: list[list[int]] = [[] for _ in range(ep)]
    lpt_load = [0.0] * ep
    for e in order:
        p = min((q for q in range(ep) if len(lpt[q]) < el), key=lambda q: (lpt_load[q], q))
        lpt[p].append(e)
        lpt_load[p] += loads[e]
    best: tuple[float, list[list[int]], bool, str] | None = None
    for start, ranks in (("lpt", lpt), ("contiguous", contiguous_placement(E, ep))):
        ranks, done = _refine(loads, ranks, cap=E * E)
        peak = max(rank_loads(loads, ranks))
        if best is None or peak < best[0]:
            best = (peak, ranks, done, start)
    _, ranks, done, start = best
    return Balanced(tuple(tuple(sorted(r)) for r in ranks), done, start)


def _refine(loads: Sequence[float], ranks: list[list[int]], cap: int) -> tuple[list[list[int]], bool]:
    """The swap refinement (module docstring, step 2) -> (placement, ended at a local optimum)."""
    ranks = [list(r) for r in ranks]
    per = rank_loads(loads, ranks)
    for _ in range(cap):
        top = max(per)
        a = per.index(top)
        best = None  # (new max of the pair, b, i, j)
        for b in range(len(ranks)):
            if b == a:
                continue
            for i, x in enumerate(ranks[a]):
                for j, y in enumerate(ranks[b]):
                    d = loads[x] - loads[y]
                    if d <= 0:
                        continue
                    pair = max(per[a] - d, per[b] + d)
                    if pair < top and (best is None or pair < best[0]):
                        best = (pair, b, i, j)
        if best is None:
            return ranks, True
        _, b, i, j = best
        x, y = ranks[a][i], ranks[b][j]
        ranks[a][i], ranks[b][j] = y, x
        d = loads[x] - loads[y]
        per[a] -= d
        per[b] += d
    return ranks, False


def _check_sizes(n_experts: int, ep: int) -> None:
    if ep < 2:
        raise ValueError(f"a placement spreads experts over ep >= 2 ranks, got ep={ep}")
    if n_experts < ep or n_experts % ep:
        raise ValueError(f"{n_experts} experts do not split evenly over ep={ep} ranks")


# ------------------------------------------------------------------------------------------ the loads file


def loads_of_routing(doc: Any, where: str) -> tuple[int, dict[int, list[int]]]:
    """(n_experts, layer -> tokens per expert) from a routing-counts document (trainer/routing_log.py's
    ``routing.json``): each layer's ``total`` (every step of that run), summed over the ranks that ran it.
    `PlacementError` (one line starting with ``where``) for anything else."""
    if not isinstance(doc, dict) or doc.get("format") != ROUTING_FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise PlacementError(f"{where}: not a routing-counts file (format {str(got)[:40]!r}, expected "
                             f"{ROUTING_FORMAT!r}: the routing.json of an earlier run)")
    if doc.get("schema_version") not in ROUTING_SCHEMA_VERSIONS:
        raise PlacementError(f"{where}: schema_version {str(doc.get('schema_version'))[:20]!r} is not one this "
                             f"trainer reads ({', '.join(map(str, ROUTING_SCHEMA_VERSIONS))})")
    E = doc.get("n_routed_experts")
    if isinstance(E, bool) or not isinstance(E, int) or E < 1:
        raise PlacementError(f"{where}: n_routed_experts {str(E)[:40]!r} is not an integer >= 1")
    ranks = doc.get("ranks")
    if not isinstance(ranks, list) or not ranks:
        raise PlacementError(f"{where}: ranks: not a non-empty list")
    out: dict[int, list[int]] = {}
    for i, r in enumerate(ranks):
        layers = r.get("layers") if isinstance(r, dict) else None
        if not isinstance(layers, list):
            raise PlacementError(f"{where}: ranks[{i}].layers: not a list")
        for j, ly in enumerate(layers):
            w = f"ranks[{i}].layers[{j}]"
            lid = ly.get("layer") if isinstance(ly, dict) else None
            if isinstance(lid, bool) or not isinstance(lid, int) or lid < 0:
                raise PlacementError(f"{where}: {w}.layer: not an integer >= 0")
            tot = ly.get("total")
            if not isinstance(tot, list) or len(tot) != E:
                raise PlacementError(f"{where}: {w}.total: not a list of n_routed_experts = {E} counts")
            if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in tot):
                raise PlacementError(f"{where}: {w}.total: counts must be integers >= 0")
            acc = out.setdefault(lid, [0] * E)
            for e, v in enumerate(tot):
                acc[e] += v
    return E, out


def read_loads(path: str | Path, n_experts: int, moe_layers: Sequence[int]) -> tuple[dict[int, list[int]], dict]:
    """Per MoE layer of the model, the tokens routed to each expert in the routing file ``path``, and the
    file's ``run`` (what ties it to its manifest). `PlacementError` (one line naming the file) when the file
    is missing, unreadable, not a routing-counts file, or not of this model: another expert count, other MoE
    layers, a layer that routed nothing."""
    p = Path(path)
    try:
        if not p.is_file():
            raise PlacementError(f"{p}: no such file (ep_placement_loads: the routing.json of an earlier run)")
        size = p.stat().st_size
        if size > MAX_LOADS_BYTES:
            raise PlacementError(f"{p}: {size} bytes is more than a routing file holds (at most {MAX_LOADS_BYTES})")
        text = p.read_bytes().decode("utf-8")
    except OSError as err:
        raise PlacementError(f"{p}: cannot read ({err.strerror or err})") from None
    except UnicodeDecodeError as err:
        raise PlacementError(f"{p}: not a UTF-8 text file (byte {err.start}): a routing.json was expected") from None
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as err:
        raise PlacementError(f"{p}: not a complete JSON document (truncated?): {' '.join(str(err).split())[:120]}") from None
    E, layers = loads_of_routing(doc, str(p))
    if E != n_experts:
        raise PlacementError(f"{p}: routes over n_routed_experts = {E}, the model has {n_experts}: the loads of "
                             "another model")
    want = sorted(moe_layers)
    if sorted(layers) != want:
        raise PlacementError(f"{p}: holds MoE layers {_ids(sorted(layers))}, the model's are {_ids(want)}: the loads "
                             "of another model")
    idle = [lid for lid in want if not any(layers[lid])]
    if idle:
        raise PlacementError(f"{p}: MoE layer {idle[0]} routed no token in that run: nothing to balance on")
    run = doc.get("run") if isinstance(doc.get("run"), dict) else {}
    return {lid: layers[lid] for lid in want}, {k: run.get(k) for k in ("run_id", "name", "created_utc")}


def _ids(ids: list[int]) -> str:
    return "[" + ", ".join(map(str, ids[:12])) + (", ..." if len(ids) > 12 else "") + "]"


# ------------------------------------------------------------------------------------------ the trainer's plan


@dataclass(frozen=True)
class LayerPlacement:
    layer: int
    ranks: tuple[tuple[int, ...], ...]  # the experts of each EP rank, ascending
    loads: tuple[int, ...]              # tokens per expert in the loads file
    imbalance_contiguous: float | None  # expected max / mean rank load under the contiguous placement
    imbalance_balanced: float | None    # ... under this one
    swap_optimal: bool

    @property
    def slots(self) -> list[int]:
        """Logical expert -> physical slot (:func:`slot_map`)."""
        return slot_map(self.ranks)


@dataclass(frozen=True)
class PlacementPlan:
    """``ep_placement: balanced``: where every MoE layer's experts live, from ``loads_file``."""

    loads_file: str
    loads_run: dict
    ep: int
    layers: dict[int, LayerPlacement]

    def record(self) -> dict:
        """For the run manifest (``ep_placement``) and the routing file (``placement``)."""
        return {"mode": "balanced", "loads_file": self.loads_file, "loads_run": self.loads_run, "ep": self.ep,
                "layers": [{"layer": lp.layer, "ranks": [list(r) for r in lp.ranks],
                            "imbalance_contiguous": _r(lp.imbalance_contiguous),
                            "imbalance_balanced": _r(lp.imbalance_balanced), "swap_optimal": lp.swap_optimal}
                           for lp in self.layers.values()]}


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


def plan_layer(layer: int, loads: Sequence[int], ep: int) -> LayerPlacement:
    """One layer's balanced placement and its expected imbalance before and after."""
    b = balanced_placement(loads, ep)
    return LayerPlacement(layer, b.ranks, tuple(loads), imbalance(loads, contiguous_placement(len(loads), ep)),
                          imbalance(loads, b.ranks), b.swap_optimal)


def moe_layer_ids(cfg: dict) -> list[int]:
    """The MoE layers of a config's model (``Block.is_moe``: every layer from ``first_k_dense`` on)."""
    return list(range(cfg["first_k_dense"], cfg["n_layers"]))


def placement_plan(cfg: dict) -> PlacementPlan | None:
    """The placement a (validated) config asks for: None for ``contiguous``; for ``balanced`` the plan from
    ``ep_placement_loads``. A loads file that does not fit raises the config's one-line error
    (``ConfigError`` on ``ep_placement_loads``)."""
    if cfg.get("ep_placement", "contiguous") != "balanced":
        return None
    # imported here: config does not import this module, so there is no cycle either way
    from .config import ConfigError

    path, ep = cfg["ep_placement_loads"], cfg["ep"]
    try:
        loads, run = read_loads(path, cfg["n_routed_experts"], moe_layer_ids(cfg))
    except PlacementError as err:
        raise ConfigError("ep_placement_loads", str(err)) from None
    return PlacementPlan(str(path), run, ep, {lid: plan_layer(lid, v, ep) for lid, v in loads.items()})


__all__ = ["PLACEMENTS", "Balanced", "LayerPlacement", "PlacementError", "PlacementPlan", "balanced_placement",
           "contiguous_placement", "imbalance", "loads_of_routing", "moe_layer_ids", "placement_plan", "plan_layer",
           "rank_loads", "read_loads", "slot_map"]
