"""``sync_free_level``: the MoE layer's blocking syncs (docs/trainer.md, 'Sync-free levels').

Going down in syncs, the MoE syncs of the profiled step are dropped (all of them when the new level has
none, else the permutation's), the host work after each kept; going up, one blocking sync per MoE layer
forward is added, costing the step's median sync return: at the layer's permutation, or for level 2 at EP > 1
(the `.item()` that trims the padded receive buffer) just before the receive-side regroup's gather of the rows
the experts take. (The per-expert backends at levels 2-3 run the masked reference, and levels 2 and 3 differ in
the rows the experts compute at EP > 1: the backend mechanism models both.)

The token all-to-alls: at EP > 1, levels 0-1 send the rows routed to each peer, levels 2-3 a worst-case buffer of
``tokens * min(top_k, local experts)`` rows to every peer (``a2a_rows``). Crossing between the two, each token
all-to-all's transfer (its kernel time less the rank's wait, as the model replays it) above the latency of the
step's smallest all-to-all (the counts exchange) scales with its rows: linear in bytes, an upper bound on the
change (NVLink moves a large message faster per byte).
"""

from __future__ import annotations

import re

import numpy as np

from .base import Change, Mechanism, register
from .layout import changes_layout  # a layout change sizes the token all-to-alls itself


def moe_syncs(cfg: dict, level: int, backend: str) -> int:
    """Blocking syncs per MoE layer forward (docs/trainer.md, 'Sync-free levels')."""
    ep = int(cfg.get("ep") or 1)
    if level >= 3:
        return 0
    if level == 2:
        return 1 if ep > 1 else 0  # EP: the receive-side permutation's `.item()` trims the padded buffer
    if level == 1:
        return 1
    return 2 if ep > 1 else 1


def _n(cfg: dict) -> int:
    return moe_syncs(cfg, int(cfg["sync_free_level"]), cfg["grouped_gemm_backend"])


def _a2a_padded(cfg: dict) -> bool:
    return int(cfg.get("ep") or 1) > 1 and int(cfg["sync_free_level"]) >= 2


def a2a_rows(cfg: dict, tokens: int) -> int:
    """Rows one rank's token all-to-all sends per micro-batch of ``tokens`` (docs/trainer.md, 'Sync-free levels'):
    at EP > 1 and levels 2-3 the worst-case buffer, ``ep * tokens * min(top_k, local experts)``; else the routed
    rows, ``tokens * top_k`` (on average over the EP group)."""
    k, ep = int(cfg["top_k"]), int(cfg.get("ep") or 1)
    if _a2a_padded(cfg):
        return ep * tokens * min(k, int(cfg["n_routed_experts"]) // ep)
    return tokens * k


def _token_a2a(plan, p, change: Change) -> tuple[str, float]:
    """Scale the token all-to-alls' transfer when the new level changes their buffer (module docstring); returns
    the line saying so ('' when nothing moved) and the ns moved."""
    w = p.work
    d_model = int(change.old["d_model"])
    comm = w["is_comm"].to_numpy() & np.isin(w["moe_stage"].to_numpy(), ("moe/dispatch", "moe/combine"))
    idx = np.flatnonzero(comm)
    if not len(idx):
        return "", 0.0
    pat = re.compile(rf"^\[\[(\d+), {d_model}\]")
    rows = {int(j): int(m.group(1)) for j in idx if (m := pat.match(str(w["dims"].iloc[j])))}
    if not rows:
        return "", 0.0
    floor = float(min(plan.dur[j] for j in idx))  # the smallest all-to-all (the counts exchange): its latency
    r1 = a2a_rows(change.new, change.t1) * change.t0 / change.t1  # at the run's tokens: the tokens mechanism scales
    before = after = 0.0
    for j, r0 in rows.items():
        d = plan.dur[j]
        plan.dur[j] = min(floor, d) + (d - min(floor, d)) * r1 / r0
        before, after = before + d, after + plan.dur[j]
    ds = change.device_scale
    return (f"sync_free_level: the token all-to-alls send {a2a_rows(change.new, change.t1):,} rows instead of "
            f"{round(np.mean(list(rows.values()))):,} ("
            + ("the worst-case buffer" if _a2a_padded(change.new) else "the routed rows")
            + f"): their transfer {ds * before / 1e6:.2f} -> {ds * after / 1e6:.2f} ms, linear in bytes"), after - before


def _trim_points(w, plan) -> dict[int, int]:
    """Per MoE layer, the item position of level 2's trim under EP: the last forward unit of the permutation stage
    launched before the layer's first forward expert-stage unit (the gather of the rows the experts take), else
    that expert-stage unit."""
    stage = w["moe_stage"].to_numpy()
    back = w["backward"].to_numpy()
    layer = w["layer"].to_numpy()
    last_perm: dict[int, int] = {}
    out: dict[int, int] = {}
    for i, (kd, j) in enumerate(zip(plan.kind, plan.ref)):
        if kd != 0 or j >= len(w) or back[j]:
            continue
        ly = int(layer[j])
        if stage[j] == "moe/permute":
            last_perm[ly] = i
        elif stage[j] == "moe/experts" and ly not in out:
            out[ly] = last_perm.get(ly, i)
    return out


@register
class SyncFree(Mechanism):
    name = "sync_free"
    keys = ("sync_free_level",)
    sigma = {"syncs": 0.30, "a2a_rows": 0.25}
    order = 50.0
    summary = "the MoE layer's blocking syncs per the sync-free level removed (their waits go) or added"

    def applies(self, change: Change) -> bool:
        return _n(change.new) != _n(change.old) or _a2a_padded(change.new) != _a2a_padded(change.old)

    def edit(self, plan, p, change: Change) -> float:
        n0, n1 = _n(change.old), _n(change.new)
        sy = p.syncs
        moe = sy["moe"].to_numpy() if len(sy) else np.zeros(0, bool)
        var = 0.0
        if _a2a_padded(change.new) != _a2a_padded(change.old) and not changes_layout(change):
            line, moved = _token_a2a(plan, p, change)
            if line:
                change.modeled.append(line)
                var = (self.sigma["a2a_rows"] * abs(moved) / max(float(p.step_ns), 1.0)) ** 2
        if n1 == n0:
            return var
        if n1 < n0:
            # drop MoE syncs: all of them when the new level has none, else the first (permute) ones
            moe_pos = [i for i, (kd, j) in enumerate(zip(plan.kind, plan.ref)) if kd == 1 and j < len(moe) and moe[j]]
            if n1 == 0:
                drop = set(moe_pos)
            else:
                paths = sy["path"].to_numpy()
                drop = {i for i in moe_pos if "moe/permute" in str(paths[plan.ref[i]])}
            for i in drop:  # the host work after a dropped sync stays; the wait goes
                if i + 1 < len(plan.gap):
                    plan.gap[i + 1] += plan.gap[i]
            plan.drop_items(drop)
            change.modeled.append(f"sync_free_level: {len(drop)} blocking MoE sync(s) per step removed")
        else:
            # add syncs: one per MoE layer forward (and per recomputed forward) at its permutation; level 2 under
            # EP: before the receive-side gather (the trim of the padded buffer)
            w = p.work
            stage = w["moe_stage"].to_numpy()
            back = w["backward"].to_numpy()
            layer = w["layer"].to_numpy()
            want = n1 - n0
            trim = int(change.new["sync_free_level"]) == 2 and int(change.new.get("ep") or 1) > 1
            firsts: dict[int, int] = _trim_points(w, plan) if trim else {}
            for i, (kd, j) in enumerate(zip(plan.kind, plan.ref)):
                if kd == 0 and j < len(w) and not back[j] and stage[j] in ("moe/permute", "moe/router", "moe/experts"):
                    firsts.setdefault(int(layer[j]), i)
            cost = float(np.median(plan.sync_ret)) if plan.sync_ret else 20_000.0
            added = 0
            for at in sorted(firsts.values(), reverse=True):
                for _ in range(want):
                    plan.add_sync(at, cost)
                    added += 1
            where = ("before each MoE layer's receive-side gather: the trim of the padded buffer" if trim
                     else "at each MoE layer's permutation")
            change.modeled.append(f"sync_free_level: {added} blocking MoE sync(s) per step added ({where})")
        return var + self.sigma["syncs"] ** 2 * 0.01
