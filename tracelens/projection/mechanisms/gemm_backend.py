"""``grouped_gemm_backend``: the routed experts' GEMMs (and the rows they see at sync-free levels 2-3).

Expert GEMM time per MoE layer and pass is the measured time times the ratio of the kernel table's
timings (``kerneltable.py``: tuner rows or cache) of the new backend at the new rows to the old backend
at the old rows; a per-expert backend (loop, multistream) launches one GEMM per local expert, a grouped
one (torch, triton) one per pass: launches and their host time are removed or added, and the per-expert
copies and elementwise kernels merge into one each. Without a table the per-expert kernels are merged
(their work adds, one fixed part is paid) and the prediction says so. The per-expert backends at levels
2-3 run the masked reference (every expert over all rows).

Padding (``padded_rows``): at EP > 1 and level 3 the experts run on the whole worst-case buffer, ``ep * tokens *
min(top_k, local experts)`` rows, of which ``tokens * top_k`` are routed on average; level 2 trims it to the
routed rows (one host sync: the sync-free mechanism adds it) before the experts. A level change across 3 scales
the expert GEMMs by the kernel table at the new rows or, without a table, linearly in rows, and the row-shaped
kernels the trimmed rows feed (the expert stage's activations and copies, the receive-side regroup's gather and
its backward scatter: kernels with a ``[rows, ...]`` input) linearly too; the token all-to-alls send the
worst-case buffer at levels 2 and 3 alike. Linear in rows is an upper bound on the saving: a GEMM's time falls
less than its rows (``tracelens.analysis.moe``, which counts the same padding in a trace).

That is the trainer before issue 33's dispatch paths. A run whose manifest has ``ep_dispatch`` comes from the
trainer whose grouped GEMMs stop at the routed rows at every level (the padded tail is sent, not multiplied):
for it no level change scales the expert GEMMs, and the prediction is for that trainer, as the run is.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from moespec.backends import PER_EXPERT_BACKENDS as PER_EXPERT

from ...analysis.moe import GROUPED_GEMM_OPS, grouped_rows
from .base import Change, Mechanism, register, unit_positions


def _masked(cfg: dict) -> bool:
    return cfg["grouped_gemm_backend"] in PER_EXPERT and int(cfg["sync_free_level"]) >= 2


def gemms_stop_at_routed_rows(manifest: dict | None) -> bool:
    """Whether the run's trainer computes only the routed rows of a padded EP buffer (issue 33 and later: its
    manifest has ``ep_dispatch``)."""
    return isinstance(manifest, dict) and "ep_dispatch" in manifest


def _manifest(change: Change) -> dict | None:
    return getattr(change.model, "manifest", None)


def _padded(cfg: dict, manifest: dict | None = None) -> bool:
    return (not gemms_stop_at_routed_rows(manifest) and int(cfg.get("ep") or 1) > 1
            and int(cfg["sync_free_level"]) >= 3)


def padded_rows(cfg: dict, tokens: int, manifest: dict | None = None) -> int:
    """Rows the expert GEMMs of one rank compute per micro-batch of ``tokens`` (moespec/gemm_shapes.py): at EP > 1
    and level 3 the whole worst-case buffer, ``ep * tokens * min(top_k, local experts)``, for a run of the trainer
    before issue 33 (``manifest`` without ``ep_dispatch``); else the routed rows, ``tokens * top_k`` (on average
    over the EP group)."""
    k, ep = int(cfg["top_k"]), int(cfg.get("ep") or 1)
    if _padded(cfg, manifest):
        return tokens * ep * min(k, int(cfg["n_routed_experts"]) // ep)
    return tokens * k


def _row_shaped(w: pd.DataFrame, rows: set[int]) -> np.ndarray:
    """Units of the expert stage and the receive-side regroup whose work is on the buffer's rows: an input shaped
    ``[rows, ...]`` for one of ``rows`` (activations, copies, gather / scatter of token rows), not FSDP's parameter
    traffic (the expert GEMMs are scaled on their own)."""
    if not rows:
        return np.zeros(len(w), dtype=bool)
    alts = "|".join(str(int(r)) for r in sorted(rows))
    pat = re.compile(rf"\[\s*(?:{alts})\s*,")
    stage = w["moe_stage"].to_numpy()
    paths = w["path"].astype(str).to_numpy()
    dims = w["dims"].astype(str).to_numpy() if "dims" in w else np.full(len(w), "")
    ok = np.isin(stage, ("moe/experts", "moe/permute")) & ~w["expert"].to_numpy()
    return np.array([bool(o) and "FSDP" not in pth and bool(pat.search(d)) for o, pth, d in zip(ok, paths, dims)],
                    dtype=bool)


@register
class GemmBackend(Mechanism):
    name = "gemm_backend"
    keys = ("grouped_gemm_backend",)
    sigma = {"table": 0.10, "merge": 0.30, "padding": 0.25}
    order = 40.0
    summary = ("expert GEMMs x the kernel table's new/old ratio (or the per-expert kernels merged without one); "
               "launches and the expert stage's host time follow the launch structure")

    def applies(self, change: Change) -> bool:
        old, new = change.old, change.new
        return (old["grouped_gemm_backend"] != new["grouped_gemm_backend"]
                or (change.model.table is not None and change.s_tok != 1.0)
                or _masked(old) != _masked(new)
                or _padded(old, _manifest(change)) != _padded(new, _manifest(change)))

    def edit(self, plan, p, change: Change) -> float:
        model, old, new = change.model, change.old, change.new
        modeled, notes = change.modeled, change.notes
        b0, b1 = old["grouped_gemm_backend"], new["grouped_gemm_backend"]
        t0, t1 = change.t0, change.t1
        masked0, masked1 = _masked(old), _masked(new)
        w = p.work
        ex = np.flatnonzero(w["expert"].to_numpy())
        if not len(ex):
            notes.append("no expert GEMM kernels in the profiled step: the backend change is not modeled")
            return 0.0
        ep = int(old.get("ep") or 1)
        e_local = int(old["n_routed_experts"]) // ep
        # rows the expert GEMMs see: at EP > 1 and level 3 the whole worst-case buffer (module docstring)
        man = _manifest(change)
        rows0, rows1 = padded_rows(old, t0, man), padded_rows(new, t1, man)
        pad = 1.0  # the buffer's change beyond the tokens' (which the tokens mechanism scales)
        seen: set[int] = set()
        if _padded(old, man) != _padded(new, man):
            # the rows this rank's grouped expert GEMMs computed (at level 2 the received rows: they vary by rank); a
            # per-expert backend's GEMMs are one expert's rows each: the config's rows then
            grouped = ex[w["op"].astype(str).isin(GROUPED_GEMM_OPS).to_numpy()[ex]] if "dims" in w else ex[:0]
            got = [r for r in (grouped_rows(d) for d in w["dims"].to_numpy()[grouped]) if r]
            seen = set(got)
            rows0 = round(float(np.mean(got))) if got else rows0
            pad = (rows1 / t1) / (rows0 / t0)
        ds = change.device_scale  # profiled -> calibrated time: what the prediction's table shows
        rows_ns = (0.0, 0.0)
        if pad != 1.0:
            shaped = np.flatnonzero(_row_shaped(w, seen or {rows0}))
            before = float(sum(plan.dur[j] for j in shaped))
            for j in shaped:
                plan.dur[j] *= pad
            rows_ns = (before, before * pad)
        d, ff = int(old["d_model"]), int(old["moe_d_ff"])
        layer = w["layer"].to_numpy()
        back = w["backward"].to_numpy()
        base_ns = float(w["dur"].to_numpy()[ex].sum())  # the run's
        passes = {False: (("fwd", rows0, d, 2 * ff), ("fwd", rows0, ff, d)),
                  True: (("dx", rows0, d, 2 * ff), ("dw", rows0, d, 2 * ff), ("dx", rows0, ff, d), ("dw", rows0, ff, d))}
        table = model.table

        def table_ms(backend: str, rows: int, bw: bool) -> float | None:
            if table is None:
                return None
            tot = 0.0
            for pass_, _r, K, N in passes[bw]:
                ms = table.ms(pass_, rows, K, N, e_local, "loop" if backend == "multistream" else
                              ("torch" if backend == "auto" else backend))
                if ms is None:
                    return None
                tot += ms
            return tot

        pos = unit_positions(plan)
        source = "table" if table is not None else "merge"
        pending: list[tuple] = []  # (item position, units, ns each, stream, host gap each) to insert
        inserted: list[int] = []
        drop: set[int] = set()
        groups: dict[tuple, list[int]] = {}
        for j in ex:
            groups.setdefault((int(layer[j]), bool(back[j])), []).append(int(j))
        host_gap = float(np.median([plan.gap[pos[j]] for j in ex if j in pos])) if pos else 0.0
        used_table = False
        merged_ns = 0.0
        for (ly, bw), js in groups.items():
            meas = float(sum(w["dur"].iloc[j] for j in js))
            m_old = table_ms(b0, rows0, bw)
            m_new = table_ms(b1, rows1, bw)
            if m_old and m_new:
                used_table = True
                new_total = meas * m_new / m_old
            else:
                # no table: per-expert -> grouped merges the work and pays one fixed part per pass
                dj = np.array([plan.dur[j] for j in js])  # already token-scaled
                f = float(dj.min())
                n_pass = len(passes[bw])
                if (b0 in PER_EXPERT) and (b1 not in PER_EXPERT):
                    new_total = float((dj - f).sum()) + f * n_pass
                elif (b0 not in PER_EXPERT) and (b1 in PER_EXPERT):
                    new_total = float(dj.sum()) + f * n_pass * (e_local - 1)
                else:
                    new_total = float(dj.sum())
                new_total *= pad  # the worst-case buffer trimmed or computed: linear in rows
                if masked1 and not masked0:
                    new_total *= e_local
                elif masked0 and not masked1:
                    new_total /= e_local
            n_new = (e_local if b1 in PER_EXPERT else 1) * len(passes[bw])
            if (b0 in PER_EXPERT) == (b1 in PER_EXPERT) and len(js) >= 1 and not (masked0 or masked1):
                # same launch structure: rescale in place
                cur = sum(plan.dur[j] for j in js) or 1.0
                for j in js:
                    plan.dur[j] = plan.dur[j] * new_total / cur
                continue
            # different launch structure: the group's launches are replaced
            if b0 in PER_EXPERT and b1 not in PER_EXPERT:
                merged_ns += merge_per_expert(plan, w, pos, ly, bw, e_local, drop)
            first = min(pos[j] for j in js if j in pos)
            stream = plan.stream[js[0]]
            for j in js:
                if j in pos:
                    drop.add(pos[j])
            # new units go where the first of the group was launched
            pending.append((first, n_new, new_total / n_new, stream, host_gap))
        pool = 0.0
        n_old = n_kept = 0
        if pending:
            # the expert stage's host time (its own CPU ops: one set per expert for a per-expert backend, a
            # few per pass for a grouped one) scales with the number of units the stage launches
            pool = float(sum(plan.gap_x))
            for i in range(len(plan.gap)):
                plan.gap[i] -= plan.gap_x[i]
                plan.gap_x[i] = 0.0
            stg = w["moe_stage"].to_numpy()
            in_stage = {int(j) for j in np.flatnonzero(stg == "moe/experts")}
            n_old = sum(1 for kd, j in zip(plan.kind, plan.ref) if kd == 0 and j in in_stage)
            n_kept = sum(1 for i, (kd, j) in enumerate(zip(plan.kind, plan.ref))
                         if kd == 0 and j in in_stage and i not in drop)
        if drop or pending:
            pend = sorted(pending, reverse=True)
            keep_pos = [i for i in range(len(plan.kind)) if i not in drop]
            remap = {old_i: new_i for new_i, old_i in enumerate(keep_pos)}
            plan.drop_items(drop)
            for first, n_new, each, stream, gap in pend:
                at = remap.get(first)
                if at is None:
                    at = next((remap[i] for i in range(first, first + 10**6) if i in remap), len(plan.kind))
                for _ in range(n_new):
                    inserted.append(plan.add_unit(each, stream, "expert GEMMs", 0.0, at))
        if inserted and n_old:
            n_after = n_kept + len(inserted)
            share = pool * n_after / n_old / len(inserted)
            pos_new = unit_positions(plan)
            for j in inserted:
                plan.gap[pos_new[j]] += share
                plan.gap_x[pos_new[j]] += share
            merged_host = pool - share * len(inserted)
        else:
            merged_host = 0.0
        new_ns = float(sum(plan.dur[j] for kd, j in zip(plan.kind, plan.ref) if kd == 0 and plan.comp[j] == "expert GEMMs"))
        what = "kernel-table ratio" if used_table else (
            "merged per-expert work (no kernel table)" if b0 != b1 else "rows, linearly (no kernel table)")
        head = f"grouped_gemm_backend {b0} -> {b1}" if b0 != b1 else f"grouped_gemm_backend {b0}"
        if pad != 1.0:
            lv0, lv1 = old["sync_free_level"], new["sync_free_level"]
            head = (f"sync_free_level {lv0} -> {lv1} at EP {ep}, {head}: the experts compute {rows1:,} rows per "
                    f"micro-batch instead of {rows0:,} ("
                    + ("the worst-case buffer trimmed to the routed rows" if pad < 1 else "the whole worst-case buffer")
                    + f"); the row-shaped kernels they feed {ds * rows_ns[0] / 1e6:.2f} -> {ds * rows_ns[1] / 1e6:.2f} ms"
                    + (" (the token all-to-alls keep their worst-case buffer at levels 2-3)" if min(lv0, lv1) >= 2 else ""))
        # in the prediction's calibrated time (x the device factor), the unit its component table shows
        modeled.append(head + (" (masked reference)" if masked1 else "")
                       + f": expert GEMMs {ds * base_ns / 1e6:.2f} -> {ds * new_ns / 1e6:.2f} ms by {what}"
                       + ("; launches per pass 1 per expert" if b1 in PER_EXPERT else "; one launch per pass")
                       + (f"; the per-expert copies/elementwise kernels merged ({ds * merged_ns / 1e6:.2f} ms less)"
                          if merged_ns else "")
                       + (f"; the expert stage's host time x{(n_kept + len(inserted)) / n_old:.2f} with its launches "
                          f"({merged_host / 1e6:+.2f} ms less, profiled)" if inserted and n_old and pool else ""))
        if b0 not in PER_EXPERT and b1 in PER_EXPERT:
            notes.append(f"{b1}: the per-expert backend's extra copies and elementwise kernels (besides its GEMMs) are "
                         "not in this grouped run's trace: predicted time is a lower bound")
        if not used_table and b0 != b1:
            notes.append("no kernel table for the backend change: run `tracelens kernels tune --config ... --json T.json` "
                         "on the GPU and pass --kernel-table T.json for a measured ratio")
            source = "merge"
        # the GEMM change, the merged kernels and the expert stage's host time moved: each modeled; the padding's
        # change, linear in rows, with its own uncertainty
        changed = abs(new_ns - base_ns) + merged_ns + abs(merged_host)
        var = (self.sigma[source] * changed / max(float(p.step_ns), 1.0)) ** 2
        if pad != 1.0:
            var += (self.sigma["padding"] * (abs(new_ns - base_ns) + abs(rows_ns[1] - rows_ns[0]))
                    / max(float(p.step_ns), 1.0)) ** 2
        return var


def merge_per_expert(plan, w: pd.DataFrame, pos: dict, ly: int, bw: bool, e_local: int, drop: set) -> float:
    """A per-expert backend repeats some copies and elementwise kernels once per local expert (splits,
    concatenation, per-expert gradient buffers). A grouped backend runs each once over all rows: the
    kernels of one name repeated in this MoE layer's expert stage merge into one, whose time keeps the
    summed work above the fastest instance (work on rows adds up, the fixed part is paid once). Returns
    the ns removed."""
    stage = w["moe_stage"].to_numpy()
    sel = np.flatnonzero((stage == "moe/experts") & ~w["expert"].to_numpy() & (w["layer"].to_numpy() == ly)
                         & (w["backward"].to_numpy() == bw))
    if not len(sel):
        return 0.0
    names = w["name"].to_numpy()[sel]
    removed = 0.0
    need = max(2, e_local // 4)
    for nm in set(names):
        js = [int(j) for j in sel[names == nm] if int(j) in pos]
        if len(js) < need:
            continue
        d = np.array([plan.dur[j] for j in js])
        f = float(d.min())
        keep = js[0]
        new = f + float((d - f).sum())
        removed += float(d.sum()) - new
        plan.dur[keep] = new
        for j in js[1:]:
            drop.add(pos[j])
    return removed
