"""``recompute_layer_ids``: activation recomputation of whole layers.

A newly recomputed layer's forward units (its ``layer/<i>`` range; the trainer marks each block) run
again before its backward; an un-recomputed layer's recomputation is removed. On a CPU trace the layer's
forward costs its whole span (its ops' own time and the Python between them). A trace without layer
ranges gets one layer's share of the forward's token work. Peak memory comes from the projection.
"""

from __future__ import annotations

import numpy as np

from .base import Change, Mechanism, register, unit_positions


def _layers(cfg: dict) -> set:
    return set(cfg.get("recompute_layer_ids") or [])


@register
class Recompute(Mechanism):
    name = "recompute"
    keys = ("recompute_layer_ids",)
    sigma = {"recompute": 0.15}
    order = 60.0
    summary = "a recomputed layer's forward runs again before its backward (or its recomputation goes)"

    def applies(self, change: Change) -> bool:
        return _layers(change.old) != _layers(change.new)

    def edit(self, plan, p, change: Change) -> float:
        r0, r1 = _layers(change.old), _layers(change.new)
        modeled, notes = change.modeled, change.notes
        w = p.work
        layer = w["layer"].to_numpy()
        back = w["backward"].to_numpy()
        rec = w["recompute"].to_numpy()
        pos = unit_positions(plan)
        added_ns = 0.0
        removed = set()
        for ly in sorted(r0 - r1):
            for j in np.flatnonzero(rec & (layer == ly)):
                if int(j) in pos:
                    removed.add(pos[int(j)])
                    added_ns -= plan.dur[int(j)]
        inserts = []
        pending_share: list[tuple] = []
        for ly in sorted(r1 - r0):
            fwd = [int(j) for j in np.flatnonzero((layer == ly) & ~back & ~rec) if int(j) in pos]
            bwd = [pos[int(j)] for j in np.flatnonzero((layer == ly) & back) if int(j) in pos]
            if not fwd:
                # no "layer/<i>" ranges (a trace from before the trainer marked them): one layer's share of
                # the forward's device work, run once before the backward starts
                fw = np.flatnonzero(~back & ~rec & (w["scale"].to_numpy() == "tokens"))
                n_layers = int(change.old.get("n_layers") or 1)
                first_b = [pos[int(j)] for j in np.flatnonzero(back) if int(j) in pos]
                if not len(fw) or not first_b:
                    notes.append(f"recompute layer {ly}: no forward work found in the trace: not modeled")
                    continue
                share = float(sum(plan.dur[int(j)] for j in fw)) / n_layers
                pending_share.append((min(first_b), share, int(plan.stream[int(fw[0])])))
                notes.append(f"recompute layer {ly}: the trace has no 'layer/{ly}' range: modeled as 1/{n_layers} of "
                             "the forward's token work")
                continue
            at = min(bwd) if bwd else len(plan.kind)
            inserts.append((at, fwd))
        if removed:
            plan.drop_items(removed)
            # positions after drops: recompute them for the inserts
            pos = unit_positions(plan)
            inserts = [(min((pos[j] for j in np.flatnonzero((layer == ly) & back) if int(j) in pos),
                            default=len(plan.kind)), fwd) for (_at, fwd), ly in zip(inserts, sorted(r1 - r0))]
        orig_pos = unit_positions(plan)
        for at, fwd in sorted(inserts, key=lambda x: -x[0]):
            if plan.cpu:
                # on a CPU the host is the device: the layer's forward costs its whole span (its ops' own
                # time and the Python between them), run again
                st = w["start"].to_numpy()[fwd]
                en = st + w["dur"].to_numpy()[fwd]
                span = float(en.max() - st.min()) if len(fwd) else 0.0
                plan.add_unit(span, 0, "other", 0.0, at)
                added_ns += span
                continue
            for j in reversed(fwd):
                gap = plan.gap[orig_pos[j]] if j in orig_pos else 0.0
                plan.add_unit(plan.dur[j], plan.stream[j], plan.comp[j], gap, at)
                added_ns += plan.dur[j]
        for at, share, stream in sorted(pending_share, key=lambda x: -x[0]):
            at = min(at, len(plan.kind))
            plan.add_unit(share, stream, "other", 0.0, at)
            added_ns += share
        if r1 - r0 or r0 - r1:
            modeled.append(f"recompute_layer_ids {sorted(r0)} -> {sorted(r1)}: forward of the recomputed layers runs "
                           f"again in the backward ({added_ns / 1e6:+.2f} ms of device work)")
        return (self.sigma["recompute"] * abs(added_ns) / max(float(p.step_ns), 1.0)) ** 2
