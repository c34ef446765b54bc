"""A run's routing counts (``RUN/routing.json``, written by the trainer: docs/trainer.md "Routing counts"),
decoded and checked. `tracelens.io.run.Run.routing` reads the file; this module turns its JSON into
`RoutingCounts` or says in one line what is wrong with it (`RoutingError`, naming the file): not JSON (a
truncated copy), another format, a count list of the wrong length or with a negative value, a file whose
``run`` is not the manifest's (left behind by another run). Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT = "moe-routing-counts"
SCHEMA_VERSIONS = (1,)


class RoutingError(ValueError):
    """What is wrong with a routing file, in one line (without the file name: `Run.routing` adds it)."""


@dataclass(frozen=True)
class LayerCounts:
    layer: int
    total: tuple[int, ...]  # tokens per global expert over every step of the run
    total_forwards: int
    steps: dict[int, tuple[int, tuple[int, ...]]]  # profiled step -> (forwards, tokens per global expert)


@dataclass(frozen=True)
class RankCounts:
    rank: int
    ep_rank: int
    ep_group: tuple[int, ...]  # global ranks of the rank's expert-parallel group, in EP-rank order
    pp_rank: int
    layers: dict[int, LayerCounts]


@dataclass(frozen=True)
class RoutingCounts:
    n_experts: int
    top_k: int
    d_model: int
    dtype: str
    ep: int
    tokens_per_microbatch: int
    steps: int
    profiled_steps: tuple[int, ...]
    run: dict[str, Any]
    ranks: dict[int, RankCounts]
    # ``ep_placement: balanced`` runs: per MoE layer, the EP rank (index into a group) holding each expert;
    # a layer not listed (every layer of a contiguous run) has rank p hold experts [p*El, (p+1)*El)
    placement: dict[int, tuple[int, ...]] = field(default_factory=dict)

    def ep_rank_of(self, expert: int, layer: int, group_size: int) -> int:
        """The EP rank (index into an EP group of ``group_size``) that holds ``expert`` in ``layer``."""
        where = self.placement.get(layer)
        return where[expert] if where is not None else expert // (self.n_experts // group_size)

    def owner(self, rank: int, expert: int, layer: int | None = None) -> int:
        """The global rank holding ``expert`` (of ``layer``: its placement, if the run recorded one) for the
        tokens of ``rank`` (in ``rank``'s EP group)."""
        g = self.ranks[rank].ep_group
        return g[self.ep_rank_of(expert, layer, len(g)) if layer is not None else expert // (self.n_experts // len(g))]


def _int(v: Any, where: str, lo: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise RoutingError(f"{where}: {str(v)[:40]!r} is not an integer >= {lo}")
    return v


def _obj(v: Any, where: str) -> dict:
    if not isinstance(v, dict):
        raise RoutingError(f"{where}: not a JSON object")
    return v


def _list(v: Any, where: str) -> list:
    if not isinstance(v, list):
        raise RoutingError(f"{where}: not a JSON list")
    return v


def _counts(v: Any, n: int, where: str) -> tuple[int, ...]:
    v = _list(v, where)
    if len(v) != n:
        raise RoutingError(f"{where}: {len(v)} counts, expected n_routed_experts = {n}")
    for i, x in enumerate(v):
        _int(x, f"{where}[{i}]")
    return tuple(v)


def decode(doc: Any) -> RoutingCounts:
    """`RoutingCounts` from a routing file's JSON document; `RoutingError` naming the first bad field."""
    d = _obj(doc, "the document")
    if d.get("format") != FORMAT:
        raise RoutingError(f"format {str(d.get('format'))[:40]!r}, expected {FORMAT!r}: not a routing-counts file")
    if d.get("schema_version") not in SCHEMA_VERSIONS:
        raise RoutingError(f"schema_version {str(d.get('schema_version'))[:20]!r} is not one this tracelens reads "
                           f"({', '.join(map(str, SCHEMA_VERSIONS))})")
    E = _int(d.get("n_routed_experts"), "n_routed_experts", 1)
    ranks: dict[int, RankCounts] = {}
    for i, r in enumerate(_list(d.get("ranks"), "ranks")):
        w = f"ranks[{i}]"
        r = _obj(r, w)
        rank = _int(r.get("rank"), f"{w}.rank")
        group = tuple(_int(x, f"{w}.ep_group") for x in _list(r.get("ep_group"), f"{w}.ep_group"))
        if not group or E % len(group) or rank not in group:
            raise RoutingError(f"{w}.ep_group: {list(group)[:8]} does not hold rank {rank} with {E} experts split evenly")
        layers: dict[int, LayerCounts] = {}
        for j, ly in enumerate(_list(r.get("layers"), f"{w}.layers")):
            lw = f"{w}.layers[{j}]"
            ly = _obj(ly, lw)
            steps: dict[int, tuple[int, tuple[int, ...]]] = {}
            for k, s in enumerate(_list(ly.get("steps"), f"{lw}.steps")):
                sw = f"{lw}.steps[{k}]"
                s = _obj(s, sw)
                steps[_int(s.get("step"), f"{sw}.step")] = (_int(s.get("forwards"), f"{sw}.forwards"),
                                                            _counts(s.get("counts"), E, f"{sw}.counts"))
            lid = _int(ly.get("layer"), f"{lw}.layer")
            layers[lid] = LayerCounts(lid, _counts(ly.get("total"), E, f"{lw}.total"),
                                      _int(ly.get("total_forwards"), f"{lw}.total_forwards"), steps)
        if rank in ranks:
            raise RoutingError(f"{w}: rank {rank} listed twice")
        ranks[rank] = RankCounts(rank, _int(r.get("ep_rank"), f"{w}.ep_rank"), group,
                                 _int(r.get("pp_rank", 0), f"{w}.pp_rank"), layers)
    if not ranks:
        raise RoutingError("ranks: empty")
    placement = _placement(d.get("placement"), E, {len(r.ep_group) for r in ranks.values()})
    run = d.get("run") if isinstance(d.get("run"), dict) else {}
    return RoutingCounts(
        n_experts=E, top_k=_int(d.get("top_k"), "top_k", 1), d_model=_int(d.get("d_model"), "d_model", 1),
        dtype=str(d.get("dtype", "")), ep=_int(d.get("ep", 1), "ep", 1),
        tokens_per_microbatch=_int(d.get("tokens_per_microbatch"), "tokens_per_microbatch", 1),
        steps=_int(d.get("steps"), "steps"),
        profiled_steps=tuple(_int(s, "profiled_steps") for s in _list(d.get("profiled_steps", []), "profiled_steps")),
        run=run, ranks=ranks, placement=placement)


def _placement(doc: Any, E: int, group_sizes: set[int]) -> dict[int, tuple[int, ...]]:
    """The optional ``placement`` (trainer ``ep_placement: balanced``): per layer the experts of each EP rank
    -> per layer the EP rank of each expert. Every layer's lists must split the E experts evenly over the
    ranks of the file's EP groups."""
    if doc is None:
        return {}
    layers = _list(_obj(doc, "placement").get("layers"), "placement.layers")
    out: dict[int, tuple[int, ...]] = {}
    for i, ly in enumerate(layers):
        w = f"placement.layers[{i}]"
        ly = _obj(ly, w)
        lid = _int(ly.get("layer"), f"{w}.layer")
        lists = [[_int(e, f"{w}.ranks") for e in _list(r, f"{w}.ranks")] for r in _list(ly.get("ranks"), f"{w}.ranks")]
        flat = sorted(e for r in lists for e in r)
        if flat != list(range(E)) or len({len(r) for r in lists}) != 1 or group_sizes != {len(lists)}:
            raise RoutingError(f"{w}.ranks: not the {E} experts split evenly over the {sorted(group_sizes)[:4]} "
                               "ranks of the EP groups")
        where = [0] * E
        for p, r in enumerate(lists):
            for e in r:
                where[e] = p
        out[lid] = tuple(where)
    return out


def check_run(counts: RoutingCounts, manifest: dict | None) -> None:
    """`RoutingError` when the file was written by another run than the manifest's: their ``run_id`` differ
    (a manifest without one, written before the field existed, is compared by ``created_utc``)."""
    if not manifest:
        return
    for key in ("run_id", "created_utc"):
        mine, theirs = counts.run.get(key), manifest.get(key)
        if mine and theirs:
            if mine != theirs:
                raise RoutingError(f"from another run ({key} {str(mine)[:40]}, the manifest's is {str(theirs)[:40]}); "
                                   "the trainer writes it with each run: re-run, or remove the stale file")
            return


def problem_line(path: Path, err: tuple[str, str]) -> str:
    """The one line for a routing file that could not be read as JSON."""
    kind, msg = err
    msg = " ".join(msg.split())[:160]
    if kind in ("JSONDecodeError", "ValueError", "UnicodeDecodeError"):
        return f"{path}: not a complete JSON document (truncated?): {msg}"
    return f"{path}: {msg}" if not kind else f"{path}: unreadable ({kind}: {msg})"


__all__ = ["FORMAT", "LayerCounts", "RankCounts", "RoutingCounts", "RoutingError", "check_run", "decode", "problem_line"]
