"""Expert-parallel token dispatch: how a rank's routed rows reach the ranks that hold their experts, and
how the expert outputs come back (``ep_dispatch``, ``ep_capacity_factor``; ``ep_overlap`` drives it in
chunks, see :mod:`trainer.model.moe`).

A rank's routed rows arrive sorted by global expert (:class:`Routed`); peer ``p`` of the EP group holds
experts ``[p*El, (p+1)*El)``. Every path does the same four things: exchange the per-expert row counts
(one small all-to-all for all chunks), send the rows (all-to-all), regroup the received rows by local
expert for the grouped GEMM, and after the experts send the outputs back along the same route.

``ep_dispatch`` (the sync-free level decides where host syncs remain, docs/trainer.md):

=========  =========================================================================================
path       what travels and what is computed
=========  =========================================================================================
nccl       levels 0-1: exact splits read on the host (level 0: the received counts' ``tolist()``;
           level 1: one ``tolist()`` of both). Levels 2-3: equal splits of the worst-case buffer
           (each peer gets ``T*min(k, El)`` slots: every token could pick that many of its experts);
           level 2 reads the received total (one ``tolist()`` for all chunks) and trims; level 3 reads
           nothing and sends the whole worst case, but the grouped GEMMs' offsets end at the routed
           rows, so the padded tail is never computed (nor its activation, with the Triton SwiGLU)
           and gets no gradient.
capacity   equal splits of a static per-peer capacity ``ceil(f * T*k / P)`` rows (``f`` =
           ``ep_capacity_factor``): the buffers, the bytes on the wire and the memory saved for the
           backward scale with what is routed, not with the worst case. A token's row beyond its
           peer's capacity (counted in token order, so earlier tokens win) is dropped: its expert
           output is zero (the residual path carries the token), and the dropped rows are counted on
           the device (no sync) and reported in the run manifest. No host sync at level 3.
=========  =========================================================================================

Padding rows are only ever moved by permutations (the send buffer, the receive-side regroup, the
combine), never mixed into a routed row, so whatever a grouped GEMM leaves past its last offset
cannot reach an output or a gradient: the sender reads back only its own routed slots.

Collectives are started asynchronously (:func:`a2a_start` / :func:`a2a_wait`, autograd-aware in both
directions), so the caller can compute while rows are on the wire.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

DISPATCH_PATHS = ("nccl", "capacity")


# ------------------------------------------------------------------------------ async all-to-all
class _InFlight:
    """The collective a start/wait pair shares (forward), and the one the backward pair shares."""

    __slots__ = ("bwd", "fwd", "grad_in")

    def __init__(self):
        self.fwd = self.bwd = self.grad_in = None


class _A2AStart(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, box):
        ctx.box = box
        x = x.contiguous()
        rows = x.shape[0] if out_splits is None else sum(out_splits)
        out = x.new_empty((rows,) + tuple(x.shape[1:]))
        box.fwd = dist.all_to_all_single(out, x, out_splits, in_splits, group=group, async_op=True)
        return out

    @staticmethod
    def backward(ctx, grad):  # _A2AWait.backward started the reverse all-to-all of ``grad``: its output is ours
        box = ctx.box
        box.bwd.wait()
        gin, box.bwd, box.grad_in = box.grad_in, None, None
        return gin, None, None, None, None


class _A2AWait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, out_splits, in_splits, group, box):
        ctx.box, ctx.group, ctx.out_splits, ctx.in_splits = box, group, out_splits, in_splits
        box.fwd.wait()
        box.fwd = None
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        rows = grad.shape[0] if ctx.in_splits is None else sum(ctx.in_splits)
        gin = grad.new_empty((rows,) + tuple(grad.shape[1:]))
        ctx.box.bwd = dist.all_to_all_single(gin, grad, ctx.in_splits, ctx.out_splits, group=ctx.group,
                                             async_op=True)
        ctx.box.grad_in = gin
        return grad, None, None, None, None


# ------------------------------------------------------------------------------ row movement
class _MoveRows(torch.autograd.Function):
    """``out = x[idx]`` whose backward is a gather or a plain scatter, never ``index_add``.

    ``x.index_select(0, idx)``'s backward is ``index_add_`` (atomic adds, one per element: on a padded EP
    buffer of 1e5-1e6 rows x hidden size, a large cost in every backward). Here ``idx`` is known to be
    injective, so the backward is ``grad[inv]`` when ``inv`` (the inverse permutation) is given, else a
    scatter of ``grad`` into zeros at ``bwd_idx`` (``idx`` by default; a row ``rows`` past the end, cut off,
    takes the rows whose forward index was only a placeholder)."""

    @staticmethod
    def forward(ctx, x, idx, inv, bwd_idx):
        ctx.rows, ctx.inv, ctx.extra = x.shape[0], inv, int(bwd_idx is not None)
        ctx.bwd_idx = idx if bwd_idx is None else bwd_idx
        return x.index_select(0, idx)

    @staticmethod
    def backward(ctx, grad):
        if ctx.inv is not None:
            return grad.index_select(0, ctx.inv), None, None, None
        out = grad.new_zeros((ctx.rows + ctx.extra,) + tuple(grad.shape[1:])).index_copy_(0, ctx.bwd_idx, grad)
        return out[:ctx.rows], None, None, None


def move_rows(x: torch.Tensor, idx: torch.Tensor, inv: torch.Tensor | None = None,
              bwd_idx: torch.Tensor | None = None) -> torch.Tensor:
    """``x[idx]`` for an injective ``idx`` (a permutation when ``inv`` is given), without atomics backward."""
    return _MoveRows.apply(x, idx, inv, bwd_idx)


@dataclass
class Transfer:
    """An all-to-all started by :func:`a2a_start`; :func:`a2a_wait` gives its output."""

    out: torch.Tensor
    out_splits: list[int] | None
    in_splits: list[int] | None
    group: object
    box: _InFlight


def a2a_start(x: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None, group) -> Transfer:
    """Start a differentiable all-to-all of ``x`` (``None`` splits: equal chunks). Its backward runs the
    reverse all-to-all, likewise started by the wait's backward and awaited by the start's."""
    box = _InFlight()
    return Transfer(_A2AStart.apply(x, out_splits, in_splits, group, box), out_splits, in_splits, group, box)


def a2a_wait(t: Transfer) -> torch.Tensor:
    """The output of a started all-to-all (on NCCL: the current stream waits for it; nothing blocks the host)."""
    return _A2AWait.apply(t.out, t.out_splits, t.in_splits, t.group, t.box)


def recomputing() -> bool:
    """Whether this forward runs inside a backward pass (activation checkpointing's recompute)."""
    return torch._C._current_graph_task_id() != -1


# --------------------------------------------------------------------------------------- routing
@dataclass
class Routed:
    """One chunk of tokens after routing and the sender-side permutation."""

    x_perm: torch.Tensor      # [n*k, D] rows sorted by global expert (stable: token order inside an expert)
    counts: torch.Tensor      # [E] int64 rows per global expert (device)
    order: torch.Tensor       # [n*k] the (token, slot) index, token-major, of each sorted row
    sorted_exp: torch.Tensor  # [n*k] global expert of each sorted row
    flat_exp: torch.Tensor    # [n*k] global expert of each (token, slot), token-major
    tokens: int


@dataclass
class Trip:
    """One chunk's round trip: the send-side layout, the receive-side regroup, the transfers in flight."""

    routed: Routed
    cap: int = 0                                   # slots per peer (padded paths)
    slot: torch.Tensor | None = None               # [n*k] send-buffer slot of each sorted row
    keep: torch.Tensor | None = None               # capacity: [n*k] bool, sorted row kept
    send_counts: torch.Tensor | None = None        # [E] rows sent per global expert (kept ones)
    recv_counts: torch.Tensor | None = None        # [P, El] rows each peer sends to my experts
    send_splits: list[int] | None = None           # exact path (levels 0-1)
    recv_splits: list[int] | None = None
    local_host: list[int] | None = None            # exact path: received rows per local expert
    recv_total: int | None = None                  # level 2: received routed rows (host)
    fwd: Transfer | None = None
    back: Transfer | None = None
    src: torch.Tensor | None = None                # receive regroup: grouped row i <- received row src[i]
    dest: torch.Tensor | None = None               # received row r -> grouped row dest[r]
    offs: torch.Tensor | None = None               # int32 [El] end offsets, ending at the routed rows
    extra: dict = field(default_factory=dict)


def capacity_per_peer(tokens: int, k: int, P: int, factor: float) -> int:
    """Static rows per peer of the capacity path: ``ceil(factor * tokens * k / P)``, at least 1."""
    return max(1, math.ceil(factor * tokens * k / P - 1e-9))


def worst_case_per_peer(tokens: int, k: int, El: int) -> int:
    """Rows one peer can receive from one rank without a bound: every token picks min(k, El) of its experts."""
    return tokens * min(k, El)


# ---------------------------------------------------------------------------------- the dispatcher
class Dispatcher:
    """Moves routed rows between the ranks of one EP group (``P`` ranks, ``El`` experts each)."""

    def __init__(self, *, path: str, level: int, k: int, P: int, El: int, group, capacity_factor: float = 1.25):
        if path not in DISPATCH_PATHS:
            raise ValueError(f"ep_dispatch must be one of {', '.join(DISPATCH_PATHS)}, got {path!r}")
        self.path, self.level, self.k, self.P, self.El, self.group = path, level, k, P, El, group
        self.capacity_factor = capacity_factor
        self.dropped: torch.Tensor | None = None   # device int64: rows dropped so far (capacity)
        self.routed_rows = 0                        # host: rows routed so far (known without a sync)

    @property
    def exact(self) -> bool:
        """Splits read on the host (levels 0-1 of the NCCL path)."""
        return self.path == "nccl" and self.level <= 1

    # ---- send side
    def plan(self, trips: list[Trip], counts_host: list[list[int]] | None) -> None:
        """Lay out every chunk's send buffer, exchange the counts of all chunks in one all-to-all, and
        read on the host what the level allows. ``counts_host``: the chunks' counts at level 0 (read by
        the caller in its permute stage), else None."""
        P, El = self.P, self.El
        for t in trips:
            r = t.routed
            if self.path == "capacity":
                self._capacity_layout(t)
            else:
                t.send_counts = r.counts
                if not self.exact:
                    t.cap = worst_case_per_peer(r.tokens, self.k, El)
                    dest = r.sorted_exp // El
                    rank_counts = r.counts.view(P, El).sum(1)
                    rank_start = rank_counts.cumsum(0) - rank_counts
                    pos = torch.arange(r.x_perm.shape[0], device=r.x_perm.device) - rank_start.index_select(0, dest)
                    t.slot = dest * t.cap + pos
            if not recomputing():
                self.routed_rows += r.x_perm.shape[0]
        sent = torch.stack([t.send_counts for t in trips])                # [C, E]
        C = len(trips)
        out = torch.empty_like(sent.view(C, P, El).transpose(0, 1).contiguous())   # [P, C, El]
        dist.all_to_all_single(out, sent.view(C, P, El).transpose(0, 1).contiguous(), group=self.group)
        for c, t in enumerate(trips):
            t.recv_counts = out[:, c, :]
        if self.exact:
            if self.level == 0:
                recv_host = out.tolist()
                sent_host = counts_host
            else:
                both = torch.cat([sent.reshape(-1), out.reshape(-1)]).tolist()
                n = C * P * El
                sent_host = [both[c * P * El:(c + 1) * P * El] for c in range(C)]
                flat = both[n:]  # [P, C, El] row-major
                recv_host = [[flat[(p * C + c) * El:(p * C + c + 1) * El] for c in range(C)] for p in range(P)]
            for c, t in enumerate(trips):
                s = sent_host[c]
                rc = [recv_host[p][c] for p in range(P)]
                t.send_splits = [sum(s[p * El:(p + 1) * El]) for p in range(P)]
                t.recv_splits = [sum(row) for row in rc]
                t.local_host = [sum(rc[p][j] for p in range(P)) for j in range(El)]
                t.extra["recv_host"] = rc
        elif self.path == "nccl" and self.level == 2:
            for t in trips:  # read by the first receive(), in the receive-side stage
                t.extra["level2"] = (out, trips)

    def _capacity_layout(self, t: Trip) -> None:
        r, P, El = t.routed, self.P, self.El
        t.cap = capacity_per_peer(r.tokens, self.k, P, self.capacity_factor)
        dest_tok = r.flat_exp // El                                        # token order
        # [P, n] and a scan along the contiguous dim: an outer-dim scan of [n, P] runs P-wide (H100: 14 ms
        # per call at n = 196,608, more than the layer's all-to-all); not F.one_hot: it checks classes on the host
        onehot = torch.zeros(P, dest_tok.numel(), dtype=torch.int32, device=dest_tok.device)
        onehot.scatter_(0, dest_tok.unsqueeze(0), 1)
        pos_tok = onehot.cumsum(1, dtype=torch.int32).gather(0, dest_tok.unsqueeze(0)).squeeze(0) - 1
        keep = (pos_tok < t.cap).index_select(0, r.order)                   # sorted order
        kept_counts = torch.zeros_like(r.counts).scatter_add_(0, r.sorted_exp, keep.long())
        dest = r.sorted_exp // El
        krank = kept_counts.view(P, El).sum(1)
        kstart = krank.cumsum(0) - krank
        pos = keep.long().cumsum(0) - 1 - kstart.index_select(0, dest)
        t.slot = torch.where(keep, dest * t.cap + pos, torch.full_like(pos, P * t.cap))
        t.keep, t.send_counts = keep, kept_counts
        if not recomputing():  # activation checkpointing runs the forward again inside the backward
            n_drop = r.x_perm.shape[0] - keep.sum()
            self.dropped = n_drop if self.dropped is None else self.dropped + n_drop

    def send(self, t: Trip) -> None:
        """Start the chunk's rows on their way."""
        x = t.routed.x_perm
        if self.exact:
            t.fwd = a2a_start(x, t.recv_splits, t.send_splits, self.group)
            return
        rows = self.P * t.cap
        if t.keep is None:
            buf = x.new_zeros(rows, x.shape[1]).index_copy(0, t.slot, x)
        else:  # dropped rows go to one extra row, cut off before sending (its gradient is zero)
            buf = x.new_zeros(rows + 1, x.shape[1]).index_copy(0, t.slot, x)[:rows]
        t.fwd = a2a_start(buf, None, None, self.group)

    # ---- receive side
    def receive(self, t: Trip) -> tuple[torch.Tensor, torch.Tensor | None, list[int] | None]:
        """Wait for the chunk's rows; regroup them by local expert. Returns ``(x2, offs, host_counts)``:
        device end offsets (padded paths; they end at the routed rows) or host counts (exact path)."""
        x_recv = a2a_wait(t.fwd)
        P, El = self.P, self.El
        if self.exact:
            rc = t.recv_counts.reshape(-1)
            R = sum(t.recv_splits)
            seg = torch.repeat_interleave(torch.arange(P * El, device=x_recv.device) % El, rc, output_size=R)
            order2 = torch.argsort(seg, stable=True)
            inv2 = torch.empty_like(order2).scatter_(0, order2, torch.arange(R, device=order2.device))
            t.src, t.dest = order2, inv2
            return move_rows(x_recv, order2, inv2), None, t.local_host
        if "level2" in t.extra and t.recv_total is None:
            out, trips = t.extra["level2"]
            totals = out.sum(dim=(0, 2)).tolist()  # the one sync of level 2: every chunk's received rows
            for c, u in enumerate(trips):
                u.recv_total = int(totals[c])
        dest, offs = regroup_padded(t.recv_counts, t.cap)
        src = torch.empty_like(dest).scatter_(0, dest, torch.arange(dest.numel(), device=dest.device))
        t.dest, t.offs = dest, offs
        if t.recv_total is not None:  # level 2: trimmed to the routed rows (read on the host above)
            t.src = src[:t.recv_total]
            return move_rows(x_recv, t.src), offs, None
        t.src = src
        return move_rows(x_recv, src, dest), offs, None

    def combine_send(self, t: Trip, y2: torch.Tensor) -> None:
        """Start the expert outputs back to the ranks their rows came from."""
        if self.exact:
            t.back = a2a_start(move_rows(y2, t.dest, t.src), t.send_splits, t.recv_splits, self.group)
            return
        if t.recv_total is not None:
            y_recv = y2.new_zeros(self.P * t.cap, y2.shape[1]).index_copy(0, t.src, y2)
        else:
            y_recv = move_rows(y2, t.dest, t.src)
        t.back = a2a_start(y_recv, None, None, self.group)

    def combine_receive(self, t: Trip) -> torch.Tensor:
        """The chunk's expert outputs, in its sorted-row order (dropped rows: zeros)."""
        y_back = a2a_wait(t.back)
        if self.exact:
            return y_back
        if t.keep is None:
            return move_rows(y_back, t.slot)
        # dropped rows read a placeholder row forward (zeroed by the where) and scatter to a cut-off row backward
        y = move_rows(y_back, t.slot.clamp(max=y_back.shape[0] - 1), bwd_idx=t.slot)
        return torch.where(t.keep.unsqueeze(1), y, y.new_zeros(()))


def regroup_padded(recv_counts: torch.Tensor, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Receive-side layout of a padded buffer ``[P * cap]`` (source-major, each source's rows grouped by
    local expert, then padding) -> expert-major (each expert's rows in source order, then all padding).

    Returns ``(dest, offs)``: ``dest[r]`` is the grouped position of received row ``r`` (a permutation of
    ``[0, P*cap)``; padding goes past the routed rows) and ``offs`` [El] int32 the experts' end offsets
    (``offs[-1]`` = routed rows received). Device ops only, no host sync.
    """
    rc = recv_counts.to(torch.int64)
    P, El = rc.shape
    dev = rc.device
    ends = rc.cumsum(1)                                               # [P, El]
    rows_p = ends[:, -1]                                              # [P] routed rows from each source
    j = torch.arange(cap, device=dev).expand(P, cap).contiguous()
    seg = torch.searchsorted(ends.contiguous(), j, right=True)        # [P, cap] local expert; El = padding
    segc = seg.clamp(max=El - 1)
    e_tot = rc.sum(0)
    e_start = e_tot.cumsum(0) - e_tot                                 # [El]
    src_before = rc.cumsum(0) - rc                                    # [P, El] rows of expert e from sources < p
    chunk_start = ends - rc                                           # [P, El] where (p, e) starts in p's chunk
    real = (e_start.index_select(0, segc.reshape(-1)).view(P, cap) + src_before.gather(1, segc)
            + j - chunk_start.gather(1, segc))
    pad_p = cap - rows_p
    pad = e_tot.sum() + (pad_p.cumsum(0) - pad_p).unsqueeze(1) + j - rows_p.unsqueeze(1)
    dest = torch.where(seg < El, real, pad).reshape(-1)
    return dest, e_tot.cumsum(0).to(torch.int32)
