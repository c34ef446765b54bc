"""The routing counts of a run: how many of each rank's tokens every MoE layer sent to each expert.

Every MoE forward already computes ``counts``, an int64 ``[E]`` device tensor of this rank's tokens per
global expert (`trainer.model.moe.MoE.forward`). `record_routing` (the one line ``MoE.forward`` calls) adds
it into a per-step device accumulator: one small ``add_`` kernel per MoE layer and micro-batch, no host
sync. At each step's end (`RoutingLog.end_step`) the step's counts are added to the run's total and, for a
profiled step, kept as they are (still on the device). Nothing reaches the host before the step loop is
over: `RoutingLog.to_host` copies everything once at the end, the ranks' records are gathered with the
other end-of-run figures, and rank 0 writes ``RUN/routing.json`` (`write_routing`, docs/trainer.md
"Routing counts"), which tracelens reads to tie routing to trace time (`tracelens moe`).

A layer's forward run again in the backward (activation checkpointing) routes the same tokens again: it is
not counted twice (the autograd engine is running then: ``torch._C._current_graph_task_id() != -1``).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from trainer import runtime

ROUTING_FILE = "routing.json"
FORMAT = "moe-routing-counts"
SCHEMA_VERSION = 1

_ACTIVE: RoutingLog | None = None  # the log MoE.forward records into (one per training process, any thread)


def record_routing(moe: torch.nn.Module, *counts: torch.Tensor) -> None:
    """Add one MoE forward's tokens per expert to the active log (none active: nothing happens): one tensor,
    or one per chunk of the forward's tokens (``ep_overlap_chunks``). Called by ``MoE.forward``; device work
    only (in-place adds on the device the counts are on)."""
    if _ACTIVE is not None:
        _ACTIVE.add(moe, *counts)


class RoutingLog:
    """Per MoE layer: the current step's counts (device), the run's total (device), the profiled steps'
    counts (device, one tensor per step) and the forwards seen per step (host integers)."""

    def __init__(self, model: torch.nn.Module, profiled: range):
        # the model builder numbers the blocks (Block.layer_id); the MoE module is a block's ffn
        layers = getattr(model, "layers", None) or []
        self.slots: dict[int, int] = {}  # id(MoE module) -> row of the accumulators
        self.layer_ids: list[int] = []
        self.n_experts = 0
        for block in layers:
            if getattr(block, "is_moe", False):
                self.slots[id(block.ffn)] = len(self.layer_ids)
                self.layer_ids.append(int(block.layer_id))
                self.n_experts = int(block.ffn.E)
        self.profiled = profiled
        self.acc: torch.Tensor | None = None  # [n_moe_layers, E] int64, this step
        self.total: torch.Tensor | None = None
        self.kept: dict[int, torch.Tensor] = {}
        self.forwards = [0] * len(self.layer_ids)  # this step, per layer
        self.total_forwards = [0] * len(self.layer_ids)
        self.kept_forwards: dict[int, list[int]] = {}
        self.steps = 0

    def add(self, moe: torch.nn.Module, *counts: torch.Tensor) -> None:
        slot = self.slots.get(id(moe))
        if slot is None or not counts or torch._C._current_graph_task_id() != -1:  # unknown, or a recompute
            return
        if self.acc is None:
            self.acc = torch.zeros(len(self.layer_ids), counts[0].numel(), dtype=torch.int64, device=counts[0].device)
            self.total = torch.zeros_like(self.acc)
        with torch.no_grad():
            for c in counts:
                self.acc[slot].add_(c.detach())
        self.forwards[slot] += 1

    def end_step(self, step: int) -> None:
        """The step is over (called once per step by the loop, after its optimizer step): device work only."""
        self.steps += 1
        self.total_forwards = [t + f for t, f in zip(self.total_forwards, self.forwards)]
        if self.acc is not None:
            with torch.no_grad():
                self.total.add_(self.acc)
                if step in self.profiled:
                    self.kept[step] = self.acc
                    self.acc = torch.zeros_like(self.acc)
                else:
                    self.acc.zero_()
        if step in self.profiled:
            self.kept_forwards[step] = list(self.forwards)
        self.forwards = [0] * len(self.layer_ids)

    def start(self) -> None:
        """MoE forwards record into this log from now on (until `stop`)."""
        global _ACTIVE
        _ACTIVE = self

    def stop(self) -> None:
        global _ACTIVE
        if _ACTIVE is self:
            _ACTIVE = None

    @contextmanager
    def active(self):
        """MoE forwards inside record into this log."""
        self.start()
        try:
            yield self
        finally:
            self.stop()

    def to_host(self, rank: int, ep_rank: int, ep_group: list[int], pp_rank: int) -> dict:
        """This rank's record for the routing file (one device-to-host copy: call it after the step loop)."""
        E = self.n_experts
        zeros = [0] * E
        steps = sorted(self.kept_forwards)
        if self.acc is not None:
            host = torch.stack([self.total, *(self.kept[s] for s in steps if s in self.kept)]).cpu().tolist()
            total, kept = host[0], dict(zip([s for s in steps if s in self.kept], host[1:]))
        else:  # no MoE forward ran on this rank (a pipeline stage without MoE layers, or no step)
            total, kept = [zeros] * len(self.layer_ids), {}
        layers = []
        for i, lid in enumerate(self.layer_ids):
            if not self.total_forwards[i]:
                continue  # a layer of another pipeline stage
            layers.append({"layer": lid, "total_forwards": self.total_forwards[i], "total": total[i],
                           "steps": [{"step": s, "forwards": self.kept_forwards[s][i],
                                      "counts": kept[s][i] if s in kept else zeros} for s in steps]})
        return {"rank": rank, "ep_rank": ep_rank, "ep_group": ep_group, "pp_rank": pp_rank, "layers": layers}


def rank_record(log: RoutingLog | None, d) -> dict | None:
    """This rank's routing record (None without MoE layers); `d` is the trainer's `Dist`."""
    if log is None or not log.layer_ids:
        return None
    group = dist.get_process_group_ranks(d.ep_group) if d.ep_group is not None and dist.is_initialized() else [d.rank]
    return log.to_host(d.rank, d.ep_rank, [int(r) for r in group], d.pp_rank)


def write_routing(out: str | Path, records: list[dict | None], cfg: dict, run: dict, steps: int,
                  placement: dict | None = None) -> Path | None:
    """Rank 0: write ``out/routing.json`` from every rank's record (atomically); None when no rank has an
    MoE layer. ``run``: what ties the file to its manifest (``run_id``, ``name``, ``created_utc``).
    ``placement`` (``ep_placement: balanced``, `moespec.placement.PlacementPlan.record`): the file says which EP
    rank held which expert per layer; the counts stay per logical expert either way."""
    ranks = [r for r in records if r is not None]
    if not ranks:
        return None
    doc = {
        "format": FORMAT, "schema_version": SCHEMA_VERSION,
        "run": {k: run.get(k) for k in ("run_id", "name", "created_utc")},
        "n_routed_experts": int(cfg["n_routed_experts"]), "top_k": int(cfg["top_k"]), "d_model": int(cfg["d_model"]),
        "dtype": cfg["dtype"], "ep": int(cfg["ep"]),
        "tokens_per_microbatch": int(cfg["micro_batch_size"]) * int(cfg["seq_len"]),
        "steps": int(steps),
        "profiled_steps": list(range(cfg["profile_step_start"], min(cfg["profile_step_end"], cfg["steps"]))),
        "ranks": sorted(ranks, key=lambda r: r["rank"]),
    }
    if placement is not None:
        doc["placement"] = {"mode": placement["mode"], "layers": [{"layer": ly["layer"], "ranks": ly["ranks"]}
                                                                  for ly in placement["layers"]]}
    path = Path(out) / ROUTING_FILE
    runtime.write_json_atomic(path, doc, indent=None)  # compact: E counts per layer, step and rank
    return path


__all__ = ["ROUTING_FILE", "RoutingLog", "rank_record", "record_routing", "write_routing"]
