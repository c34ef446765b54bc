"""Auxiliary-loss-free load balancing (DeepSeek-V3, arXiv 2412.19437 section 2.1.2): ``router_bias_update_rate``.

Every MoE layer keeps a per-expert bias ``b`` (a buffer, ``MoE.expert_bias``) that is added to the routing
scores that *choose* the experts (and their groups), never to the weights the chosen experts' outputs are
multiplied by, so the balancing steers where tokens go without changing what the model computes for a
given choice. After every optimizer step each layer's bias moves by the update rate ``u`` against the
step's load::

    load_i  = tokens routed to expert i in this step, summed over every rank that holds the layer
    b_i    += u * sign(mean(load) - load_i)        (overloaded experts down, underloaded up)

Why it matters for speed: under expert parallelism the rank whose experts receive the most rows sets the
pace of every all-to-all (the others wait inside the collective), and a capacity-bounded dispatch drops
the rows past a peer's capacity. A freshly initialised router sends most tokens to a few experts (their
gate rows align with the direction all hidden states share); the bias removes that within a few steps,
while the auxiliary loss (``aux_loss_coef``) would need a gradient large enough to distort the model.

Units: ``b`` is added to the scores, so ``u`` is in score units. DeepSeek-V3 used ``u = 0.001`` on
sigmoid scores (about 0.5 each); softmax scores over E experts average ``1/E``, so a comparable rate is
about ``0.001 * 2 / E`` there (docs/trainer.md). The update is sign-only: a too-large ``u`` makes the
loads oscillate around balance with amplitude ``u`` rather than diverge.

No host sync: the step's loads are the routing log's device counters (trainer/routing_log.py, which does
not count a recomputed forward twice), summed over the replica group with one ``all_reduce`` of a
``[n_moe_layers, E]`` int64 tensor, and the update is two device ops per step. Every rank applies the same
update to the same loads, so the biases stay identical across ranks (tests/trainer/test_balance.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def moe_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The MoE modules of ``model`` in block order (the routing log's row order)."""
    return [block.ffn for block in getattr(model, "layers", None) or [] if getattr(block, "is_moe", False)]


def bias_update(load: torch.Tensor, rate: float) -> torch.Tensor:
    """The bias change for one step's loads ``load`` [..., E]: ``rate * sign(mean - load)`` per row."""
    load = load.float()
    return rate * torch.sign(load.mean(dim=-1, keepdim=True) - load)


class RouterBias:
    """Moves every MoE layer's ``expert_bias`` after each optimizer step (see the module docstring).

    ``layers`` are the MoE modules in the routing log's row order (every one has its ``expert_bias`` when
    the rate is positive); a layer this rank does not run (another pipeline stage's) sees zero loads on every
    rank of its replica group and is left alone."""

    def __init__(self, layers: list[torch.nn.Module], rate: float, group=None):
        self.layers = list(layers) if rate > 0 else []
        missing = [i for i, m in enumerate(self.layers) if not getattr(m, "balance_bias", False)]
        if missing:
            raise ValueError(f"MoE layers {missing} have no expert_bias: build the model with the same "
                             "router_bias_update_rate")
        self.rate, self.group = float(rate), group
        self.updates = 0

    @property
    def active(self) -> bool:
        return self.rate > 0 and bool(self.layers)

    @torch.no_grad()
    def step(self, load: torch.Tensor | None) -> None:
        """Update the biases from this step's per-layer loads ``load`` [n_layers, E] (this rank's counts;
        summed over the replica group here). ``None`` (no MoE forward yet): nothing to do."""
        if not self.active or load is None:
            return
        total = load.clone()
        if self.group is not None and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(total, group=self.group)
        seen = total.sum(dim=-1) > 0  # a layer that routed nothing here (another stage's) keeps its bias
        delta = bias_update(total, self.rate) * seen.unsqueeze(-1)
        for row, moe in enumerate(self.layers):
            moe.expert_bias.add_(delta[row].to(moe.expert_bias.device))
        self.updates += 1

    def summary(self) -> dict:
        """For the run manifest (read once, at the end of the run): per MoE layer (block order) its final
        bias per expert and their spread."""
        out = []
        for moe in self.layers:
            b = moe.expert_bias.detach().float().cpu()
            out.append({"min": b.min().item(), "max": b.max().item(),
                        "std": b.std().item() if b.numel() > 1 else 0.0, "bias": b.tolist()})
        return {"rate": self.rate, "updates": self.updates, "layers": out}
