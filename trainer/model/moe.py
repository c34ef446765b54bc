"""Mixture-of-Experts FFN: router, permutation, EP dispatch/combine, grouped experts, sync-free levels.

Stages (each a ``record_function`` range ``moe/<stage>``): router -> permute -> dispatch ->
(permute, the receive-side regroup under EP) -> experts -> combine -> unpermute. Under EP the dispatch
and combine are trainer/model/dispatch.py's (``ep_dispatch``), and with ``ep_overlap`` the tokens go in
chunks whose all-to-alls run while another chunk's experts (or the shared expert) compute.

Host syncs by ``sync_free_level`` (per MoE layer, forward; see docs/trainer.md):

=====  ====================================================  ==================================
level  EP = 1                                                EP > 1 (``ep_dispatch: nccl``)
=====  ====================================================  ==================================
0      permute: ``counts.tolist()``                          + dispatch: ``recv_counts.tolist()``
1      experts: ``counts.tolist()`` (router/permute on dev)  dispatch: one ``tolist()`` of both
2      none (grouped MLP on device offsets)                  permute (receive side): one ``tolist()``
                                                             of the received totals, to trim the
                                                             worst-case padded buffer
3      none                                                  none: the worst-case buffer travels;
                                                             the grouped GEMMs stop at the routed
                                                             rows (device offsets)
=====  ====================================================  ==================================

``ep_dispatch: capacity`` and ``symm`` never sync (a static per-peer capacity; rows beyond it dropped and counted).
With chunks, each level's reads are made once for all chunks.

``ep_placement: balanced`` (moespec/placement.py): which rank holds which expert, per layer. The router, its
aux loss, its bias and the routing log work on LOGICAL expert ids; under EP one ``index_select`` maps the
top-k ids to PHYSICAL slots (``expert_slot``: slot ``p*El + i`` is rank ``p``'s local expert ``i``) before the
permutation, and the dispatch, the grouped GEMMs and the capacity rule work on slots. Each rank's expert
weights are the global init's rows of the experts it holds, so the model computes the same function as
with the contiguous placement; only where the experts live (and so which rows a capacity drops) changes.

``use_triton_kernels``: where ``kernels`` can run (CUDA, or CPU under the Triton interpreter) the
router is ``kernels.fused_router`` (scores, group-limited top-k, weights and aux-loss statistics in
one kernel), the permutation is ``kernels.permute`` (a sync-free counting sort plus a row gather)
and the unpermute is ``kernels.unpermute`` (a deterministic gather-reduce). They compute what the
PyTorch path below computes and keep its host syncs per level. Where they do not apply (no
Triton here; sigmoid routing with group limiting, whose group score is a top-2 sum the fused
router does not implement; more than 1024 experts) the PyTorch path runs, noted once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainer.model.dispatch import Dispatcher, Routed, Trip
from trainer.model.ep import scale_grad
from trainer.model.experts import _note, expert_swiglu, kernels_can_run, record_use
from trainer.model.layers import SwiGLU
from trainer.routing_log import record_routing
from trainer.syncs import moe_stage


def route(logits: torch.Tensor, *, top_k: int, score_func: str, n_group: int = 1, topk_group: int = 1,
          norm_topk_prob: bool = False, routed_scaling_factor: float = 1.0, bias: torch.Tensor | None = None):
    """Top-k routing on fp32 logits [T, E] -> (topk_idx [T,k] int64, topk_w [T,k] fp32, scores [T,E]).

    Group-limited top-k (DeepSeek): experts form ``n_group`` groups; a group's score is its best
    expert (softmax, V2) or the sum of its top-2 (sigmoid, V3); each token keeps ``topk_group`` groups.
    ``bias`` [E] (DeepSeek-V3's auxiliary-loss-free balancing, trainer/model/balance.py) is added to the
    scores that choose the groups and experts, never to the weights. Sync-free: topk / scatter / gather only.
    """
    logits = logits.float()
    scores = logits.softmax(dim=-1) if score_func == "softmax" else logits.sigmoid()
    T, E = scores.shape
    sel = scores if bias is None else scores + bias.detach().float()
    if n_group > 1:
        grouped = sel.view(T, n_group, E // n_group)
        if score_func == "sigmoid" and E // n_group >= 2:
            gscore = grouped.topk(2, dim=-1).values.sum(-1)
        else:
            gscore = grouped.amax(dim=-1)
        gidx = gscore.topk(topk_group, dim=-1).indices
        gmask = torch.zeros_like(gscore, dtype=torch.bool).scatter_(1, gidx, True)
        emask = gmask.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
        sel = sel.masked_fill(~emask, float("-inf"))
    topk_idx = sel.topk(top_k, dim=-1).indices
    topk_w = scores.gather(1, topk_idx)
    if score_func == "sigmoid" or norm_topk_prob:
        topk_w = topk_w / (topk_w.sum(-1, keepdim=True) + 1e-20)
    return topk_idx, topk_w * routed_scaling_factor, scores


def expert_counts(topk_idx: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Tokens per expert [E] (int64) on device; scatter_add, not bincount (which syncs on CUDA)."""
    flat = topk_idx.reshape(-1)
    return torch.zeros(n_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def load_balance_loss(scores: torch.Tensor, counts: torch.Tensor, top_k: int, score_func: str) -> torch.Tensor:
    """Switch/DeepSeek aux loss ``E * sum_i f_i * P_i``; f_i = fraction of routed slots to expert i
    (scaled so uniform = 1), P_i = mean router probability of expert i."""
    T, E = scores.shape
    probs = scores if score_func == "softmax" else scores / (scores.sum(-1, keepdim=True) + 1e-20)
    f = counts.to(probs.dtype) * (E / (T * top_k))
    return (f * probs.mean(0)).sum()


def permutation(topk_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, inverse, sorted_expert): ``order`` sorts the T*k (token, slot) pairs by expert (stable)."""
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return order, inverse, flat.index_select(0, order)


class GroupedExperts(nn.Module):
    """The routed experts that live on this EP rank: ``w13[E_local, 2F, D]``, ``w2[E_local, D, F]``."""

    def __init__(self, n_local: int, d: int, ff: int, backend: str, n_streams: int = 4, grad_scale: float = 1.0,
                 align: int = 0, swiglu: str = "torch"):
        super().__init__()
        self.align, self.swiglu = align, swiglu
        self.w13 = nn.Parameter(torch.empty(n_local, 2 * ff, d))
        self.w2 = nn.Parameter(torch.empty(n_local, d, ff))
        self.backend, self.n_streams, self.grad_scale = backend, n_streams, grad_scale

    def forward(self, x, counts=None, offs=None):
        w13, w2 = scale_grad(self.w13, self.grad_scale), scale_grad(self.w2, self.grad_scale)
        if torch.is_autocast_enabled(x.device.type):
            dt = torch.get_autocast_dtype(x.device.type)
            x, w13, w2 = x.to(dt), w13.to(dt), w2.to(dt)
        else:
            x = x.to(w13.dtype)
        return expert_swiglu(x, w13, w2, backend=self.backend, counts=counts, offs=offs, n_streams=self.n_streams,
                             align=self.align, swiglu=self.swiglu)


class MoE(nn.Module):
    def __init__(self, cfg: dict, ep_group=None, ep_size: int = 1, ep_rank: int = 0, placement: list[int] | None = None):
        """``placement``: logical expert -> physical slot (`moespec.placement.slot_map`; None or the identity:
        the contiguous placement)."""
        super().__init__()
        d, ff = cfg["d_model"], cfg["moe_d_ff"]
        self.E, self.k = cfg["n_routed_experts"], cfg["top_k"]
        self.ep_group, self.ep_size, self.ep_rank = ep_group, ep_size, ep_rank
        self.E_local = self.E // ep_size
        self.level = cfg["sync_free_level"]
        self.cfg = cfg
        self.gate = nn.Linear(d, self.E, bias=False)
        # the experts this rank holds (logical ids, in local order) and the logical -> slot map on the device;
        # None: the contiguous placement (rank p holds [p*El, (p+1)*El), slot = logical id)
        self.local_experts: list[int] | None = None
        if placement is not None and list(placement) != list(range(self.E)) and ep_size > 1:
            if sorted(placement) != list(range(self.E)):
                raise ValueError(f"placement must map the {self.E} experts one-to-one onto the {self.E} slots")
            lo = ep_rank * self.E_local
            self.local_experts = sorted((e for e, s in enumerate(placement) if lo <= s < lo + self.E_local),
                                        key=lambda e: placement[e])
            self.register_buffer("expert_slot", torch.tensor(list(placement), dtype=torch.int64), persistent=False)
        # DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias on the selection scores, moved after
        # every optimizer step towards balance (trainer/model/balance.py); a buffer, not a parameter
        self.balance_bias = cfg.get("router_bias_update_rate", 0.0) > 0
        if self.balance_bias:
            self.register_buffer("expert_bias", torch.zeros(self.E, dtype=torch.float32))
        self.experts = GroupedExperts(self.E_local, d, ff, cfg["grouped_gemm_backend"],
                                      cfg["multistream_num_streams"], grad_scale=1.0 / ep_size,
                                      align=cfg["grouped_gemm_align"], swiglu=cfg["expert_swiglu"])
        ns = cfg["n_shared_experts"]
        self.shared = SwiGLU(d, ff * ns) if ns else None
        self.chunks = cfg.get("ep_overlap_chunks", 2) if cfg.get("ep_overlap", False) and ep_size > 1 else 1
        # ep_overlap_schedule: where the shared expert runs beside the chunks' all-to-alls (_ep_forward)
        self.schedule = cfg.get("ep_overlap_schedule", "chunked") if self.chunks > 1 else "chunked"
        self.dispatcher = Dispatcher(path=cfg.get("ep_dispatch", "nccl"), level=self.level, k=self.k, P=ep_size,
                                     El=self.E_local, group=ep_group,
                                     capacity_factor=cfg.get("ep_capacity_factor", 1.25),
                                     fused=cfg.get("ep_capacity_fused", True)) if ep_size > 1 else None

    def init_weights(self, std: float, generator: torch.Generator | None = None):
        """Initialise this rank's slice of the *global* expert weights (same result for any EP size)."""
        E, (two_ff, d), ff = self.E, self.experts.w13.shape[1:], self.experts.w2.shape[2]
        dev = generator.device if generator is not None else "cpu"
        w13 = torch.empty(E, two_ff, d, device=dev).normal_(0, std, generator=generator)
        w2 = torch.empty(E, d, ff, device=dev).normal_(0, std, generator=generator)
        if self.local_experts is not None:  # ep_placement=balanced: the rows of the experts this rank holds
            idx = torch.tensor(self.local_experts, dtype=torch.int64, device=dev)
            w13, w2 = w13.index_select(0, idx), w2.index_select(0, idx)
        else:
            lo, hi = self.ep_rank * self.E_local, (self.ep_rank + 1) * self.E_local
            w13, w2 = w13[lo:hi], w2[lo:hi]
        with torch.no_grad():
            self.experts.w13.copy_(w13)
            self.experts.w2.copy_(w2)
            if self.balance_bias:
                self.expert_bias.zero_()

    def _kernel_ops(self, xf: torch.Tensor) -> tuple[bool, bool]:
        """(fused router, kernels permute/unpermute) for this forward; notes why not when asked for."""
        c = self.cfg
        if not c["use_triton_kernels"]:
            return False, False
        if not kernels_can_run(xf):
            _note(("use_triton_kernels", xf.device.type), f"use_triton_kernels: Triton cannot run on {xf.device.type} "
                  "tensors here (CUDA, or CPU with TRITON_INTERPRET=1); using the PyTorch router and permutation")
            return False, False
        router = True
        if c["score_func"] == "sigmoid" and c["n_group"] > 1 and self.E // c["n_group"] >= 2:
            _note(("use_triton_kernels", "router", "sigmoid-groups"), "use_triton_kernels: the fused router scores a "
                  "group by its best expert; sigmoid routing with groups uses the top-2 sum, so the PyTorch router runs")
            router = False
        elif self.E > 1024:
            _note(("use_triton_kernels", "router", "E"), f"use_triton_kernels: the fused router holds at most 1024 "
                  f"experts per row, not {self.E}; the PyTorch router runs")
            router = False
        record_use("router", "kernels.fused_router" if router else "trainer.model.moe.route")
        record_use("permute", "kernels.permute / kernels.unpermute")
        return router, True

    def _fused_route(self, logits: torch.Tensor):
        """kernels.fused_router -> (topk_idx int64, topk_w fp32, aux), the same values as :func:`route` and
        :func:`load_balance_loss` (aux = E * sum(frac * P); for sigmoid, P is the mean normalised score)."""
        from kernels import fused_router  # noqa: PLC0415

        c, k = self.cfg, self.k
        w, ids, frac, mean_prob = fused_router(
            logits, top_k=k, score_func=c["score_func"], n_groups=c["n_group"], topk_groups=c["topk_group"],
            norm_topk=c["score_func"] == "sigmoid" or c["norm_topk_prob"], scaling=c["routed_scaling_factor"],
            bias=self.expert_bias if self.balance_bias else None)
        if c["aux_loss_coef"] <= 0:
            aux = logits.new_zeros(())
        else:
            if c["score_func"] == "sigmoid":  # the balance loss uses per-token normalised sigmoid scores
                s = logits.sigmoid()
                mean_prob = (s / (s.sum(-1, keepdim=True) + 1e-20)).mean(0)
            aux = self.E * (frac * mean_prob).sum()
        return ids.long(), w, aux

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, S, D = x.shape
        T, k, E, level = B * S, self.k, self.E, self.level
        xf = x.reshape(T, D)
        c = self.cfg
        fused_router, kernel_perm = self._kernel_ops(xf)
        with moe_stage("router"):
            logits = F.linear(xf.float(), self.gate.weight.float())
            if fused_router:  # implies kernel_perm, whose permute below yields the counts
                topk_idx, topk_w, aux = self._fused_route(logits)
            else:
                topk_idx, topk_w, scores = route(logits, top_k=k, score_func=c["score_func"], n_group=c["n_group"],
                                                 topk_group=c["topk_group"], norm_topk_prob=c["norm_topk_prob"],
                                                 routed_scaling_factor=c["routed_scaling_factor"],
                                                 bias=self.expert_bias if self.balance_bias else None)
                counts = expert_counts(topk_idx, E)
                aux = load_balance_loss(scores, counts, k, c["score_func"]) if c["aux_loss_coef"] > 0 else logits.new_zeros(())
        if self.ep_size > 1:
            if self.local_experts is not None:  # logical expert -> the slot that holds it (ep_placement)
                topk_idx = self.expert_slot.index_select(0, topk_idx.reshape(-1)).view_as(topk_idx)
            y = self._ep_forward(xf, topk_idx, topk_w, kernel_perm)
            return y.view(B, S, D).to(x.dtype), aux
        with moe_stage("permute"):
            if kernel_perm:
                from kernels import permute  # noqa: PLC0415

                perm = permute(xf, topk_idx, E)
                x_perm, counts = perm.x_perm, perm.counts.long()
            else:
                order, inverse, _ = permutation(topk_idx)
                x_perm = xf.index_select(0, order // k)  # [T*k, D] sorted by global expert
            counts_host = counts.tolist() if level == 0 else None
        record_routing(self, counts)  # tokens per expert into the run's routing log (device only; trainer/routing_log.py)
        y_perm = self._local_experts(x_perm, counts, counts_host)
        with moe_stage("unpermute"):
            if kernel_perm:
                from kernels import unpermute  # noqa: PLC0415

                y = unpermute(y_perm, perm, topk_w)
            else:
                y = y_perm.index_select(0, inverse).view(T, k, D)
                y = (y * topk_w.to(y.dtype).unsqueeze(-1)).sum(1)
        if self.shared is not None:
            y = y + self.shared(xf).to(y.dtype)
        return y.view(B, S, D).to(x.dtype), aux

    def _permute(self, xf: torch.Tensor, topk_idx: torch.Tensor, kernel_perm: bool) -> tuple[Routed, object]:
        """Sender-side permutation of one chunk -> (Routed, what its unpermute needs). On the fused capacity path
        only the expert order and counts: the dispatcher gathers the send buffer straight from ``xf``."""
        k, E = self.k, self.E
        if self.dispatcher is not None and self.dispatcher.fused:
            flat = topk_idx.reshape(-1)
            if kernel_perm:
                from kernels.permutation import route_indices

                sorted_pos, _, counts, _ = route_indices(topk_idx, E)
                order, counts = sorted_pos.long(), counts.long()
                sorted_exp = flat.index_select(0, order)
            else:
                order, _, sorted_exp = permutation(topk_idx)
                counts = expert_counts(topk_idx, E)
            return Routed(None, counts, order, sorted_exp, flat, xf.shape[0], x=xf, kernels=kernel_perm), None
        if kernel_perm:
            from kernels import permute  # noqa: PLC0415

            perm = permute(xf, topk_idx, E)
            order = perm.sorted_pos.long()
            flat = topk_idx.reshape(-1)
            return Routed(perm.x_perm, perm.counts.long(), order, flat.index_select(0, order), flat, xf.shape[0]), perm
        order, inverse, sorted_exp = permutation(topk_idx)
        counts = expert_counts(topk_idx, E)
        return Routed(xf.index_select(0, order // k), counts, order, sorted_exp, topk_idx.reshape(-1),
                      xf.shape[0]), inverse

    def _unpermute(self, y_perm, how, topk_w, kernel_perm: bool) -> torch.Tensor:
        if kernel_perm:
            from kernels import unpermute  # noqa: PLC0415

            return unpermute(y_perm, how, topk_w)
        n = topk_w.shape[0]
        y = y_perm.index_select(0, how).view(n, self.k, y_perm.shape[1])
        return (y * topk_w.to(y.dtype).unsqueeze(-1)).sum(1)

    def _ep_forward(self, xf, topk_idx, topk_w, kernel_perm: bool) -> torch.Tensor:
        """The routed experts under EP, in ``ep_overlap_chunks`` chunks of tokens when ``ep_overlap`` is on.

        Every chunk's rows are sent before any expert runs (NCCL runs them in order on its stream); chunk ``c``'s
        outputs travel back while chunk ``c+1``'s experts compute. That hides every all-to-all but the ends of the
        chain: the first chunk's rows (nothing to compute before they arrive) and the last chunk's outputs (nothing
        left to compute while they travel back), which also collect the wait for the slowest rank of the group.
        ``ep_overlap_schedule`` decides what covers the ends:

        * ``chunked``: the shared expert, on every token, while the rows go out. The last return trip is exposed.
        * ``pipelined``: the shared expert in two halves of the tokens, one while the first chunk's rows go out,
          one after the last chunk's outputs were sent (before any return trip is awaited). The backward mirrors
          it without a line of its own: autograd runs the ready node created last first, so the second half's
          backward runs right after the last chunk's output gradient is sent (the backward's first all-to-all),
          and the first half's after the first chunk's row gradient is sent (its last).

        Both schedules compute the same function; only the order of the shared expert's rows differs (its weight
        gradient is summed over two halves: equal within fp32 rounding)."""
        T = xf.shape[0]
        C = min(self.chunks, T)
        bounds = [(T * c // C, T * (c + 1) // C) for c in range(C)]
        trips, hows = [], []
        with moe_stage("permute"):
            for lo, hi in bounds:
                routed, how = self._permute(xf[lo:hi], topk_idx[lo:hi], kernel_perm)
                trips.append(Trip(routed))
                hows.append(how)
            counts_host = None
            if self.level == 0 and self.dispatcher.exact:  # the level-0 sync of the permute stage, once for all chunks
                counts_host = torch.stack([t.routed.counts for t in trips]).tolist()
        # one forward's chunks (trainer/routing_log.py), per logical expert: counts[slot[e]]
        record_routing(self, *(t.routed.counts if self.local_experts is None
                               else t.routed.counts.index_select(0, self.expert_slot) for t in trips))
        with moe_stage("dispatch"):
            self.dispatcher.plan(trips, counts_host)
            for t in trips:
                self.dispatcher.send(t)
        split = self.shared is not None and self.schedule == "pipelined" and T > 1
        half = T // 2
        # computes while the rows travel: every token (chunked), the first half (pipelined)
        shared = [] if self.shared is None else [self.shared(xf[:half] if split else xf)]
        for t in trips:
            with moe_stage("permute"):  # receive side: regroup rows (source, expert) -> (expert, source)
                x2, offs, host = self.dispatcher.receive(t)
            with moe_stage("experts"):
                y2 = self.experts(x2, counts=host) if host is not None else self.experts(x2, offs=offs)
            with moe_stage("combine"):
                self.dispatcher.combine_send(t, y2)
        if split:  # computes while the last chunk's outputs travel back (backward: while the first gradient does)
            shared.append(self.shared(xf[half:]))
        ys = []
        for t, how, (lo, hi) in zip(trips, hows, bounds, strict=True):
            with moe_stage("combine"):
                y_perm = self.dispatcher.combine_receive(t)
            with moe_stage("unpermute"):
                if t.send_src is not None:  # fused capacity path: straight from the returned buffer
                    ys.append(self.dispatcher.combine_tokens(t, y_perm, topk_w[lo:hi]))
                else:
                    ys.append(self._unpermute(y_perm, how, topk_w[lo:hi], kernel_perm))
        y = ys[0] if C == 1 else torch.cat(ys)
        if shared:
            y = y + (shared[0] if len(shared) == 1 else torch.cat(shared)).to(y.dtype)
        return y

    def _local_experts(self, x_perm, counts, counts_host):
        with moe_stage("experts"):
            if self.level <= 1:
                if counts_host is None:
                    counts_host = counts.tolist()
                return self.experts(x_perm, counts=counts_host)
            return self.experts(x_perm, offs=counts.cumsum(0).to(torch.int32))
