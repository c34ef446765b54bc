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
symm       the capacity path's rule (the same per-peer capacity, clamped to the worst case, and the
           same drops, counted the same way), but only the kept routed rows travel, over NVSHMEM
           symmetric memory, with the splits on the device: ``torch.ops.symm_mem.all_to_all_vdev_2d``
           sends rank-major rows (peer, local expert) and lands them expert-major (local expert,
           source), and writes the receive layout on the device; ``all_to_all_vdev_2d_offset`` brings
           the expert outputs back (the DeepEP-like path; no counts all-to-all, no receive-side
           regroup, no padding on the wire). CUDA with NVSHMEM only. No host sync at any level.
=========  =========================================================================================

**The symm path in detail.** The ops' contract (PyTorch's ``nvshmem_extension.cu``): every tensor passed
is symmetric (``symm_mem.empty`` + ``rendezvous``), contiguous; splits and offsets are int64 counts of rows.
``all_to_all_vdev_2d(input, out, in_splits [P*El], out_splits_offsets [2, P*El], group, major_align)``
reads ``input`` packed in (peer, local expert) order (a rank's rows sorted by global expert ``p*El + e``
are exactly that) and writes ``out`` expert-major: row 0 of ``out_splits_offsets`` holds the rows
received for (expert ``e``, source ``s``) at index ``e*P + s``, row 1 where they start in ``out``; an
expert's block starts aligned to ``major_align`` and takes at least ``major_align`` rows, also when empty
(we pass 1: every empty local expert leaves one padding row; the experts' own ``grouped_gemm_align``
applies afterwards, as on every path). ``all_to_all_vdev_2d_offset(input, out, in_splits_offsets,
out_splits_offsets, group)`` is its reverse: it takes that expert-major layout as input splits and offsets
and writes the rows back packed in (peer, local expert) order. Each op is a collective: a kernel that
exchanges the splits with puts into the peers' ``out_splits_offsets`` and ends in a barrier of the group,
then a kernel in which every rank pulls its rows from the peers' ``input``.

* **Bounds, drops.** ``out`` has no bound check in the op, so what a rank can receive must be bounded
  statically: each sender keeps at most ``cap = min(ceil(f * n*k / P), n*min(k, El))`` rows per peer
  (``f`` = ``ep_capacity_factor``; the capacity path's rule, earlier tokens win; dropped rows are counted
  on the device and reported in the manifest). A rank then receives at most ``P*cap`` rows, plus one
  padding row per empty local expert.
* **Buffers.** Symmetric buffers are allocated once per EP group, dtype and row width (allocation is a
  collective rendezvous) and shared by every MoE layer, chunk, forward and backward: a send-side buffer
  of ``min(n*k, P*cap) + 1`` rows (the last row takes the dropped rows' writes) and an expert-side buffer
  of ``P*cap + El`` rows, per set, and four ``[2, P*El]`` int64 split tensors; ``n`` is a chunk's
  tokens. With ``f = 1.25`` that is about ``2.25 * n*k`` rows of the hidden size: memory sized by what is
  routed, not by the worst case. Nothing autograd saves lives in them: every op copies its output to a
  regular tensor on the way out (the receive side's copy zeroes the padding rows, the send side's gathers
  the rows back into the sorted order, zeros for dropped rows), so a later layer reusing a buffer cannot
  touch what a backward reads.
* **Reuse without a host sync.** Peers pull from a rank's ``input`` and put into its
  ``out_splits_offsets`` while the rank may already be preparing its next op. Every op ends its split
  exchange in a barrier of the group, so a buffer that a peer touched in op ``m`` is free again once the
  rank has passed op ``m+1``'s barrier. Serial runs alternate dispatch and combine (forward, backward and
  recomputation alike), so one set of row buffers suffices; the split tensors come in two sets used
  alternately. With ``ep_overlap`` the chunks' dispatches follow each other: the row buffers come in two
  sets too (the op count's parity picks the set). A sequence that would still reuse a buffer in the
  next op gets a device barrier of the group (a one-element NCCL all-reduce, no host sync) first.
* **Streams.** On CUDA the ops run on a communication stream of their own (the compute stream waits on
  an event only where the rows are needed), started and awaited in both directions like the NCCL path's
  all-to-alls, so ``ep_overlap`` hides them behind the other chunk's experts and the shared expert.
* **GEMM offsets.** The experts get ``offs[e]`` = where expert ``e``'s routed rows end in the expert-major
  layout (row 1 at ``e*P`` plus the expert's rows, from the op's output on the device): rows past
  ``offs[-1]`` are never computed; the one padding row of an empty expert lies inside the next expert's
  group and is zeroed, so it adds nothing to any weight gradient and its output goes nowhere.

**The fused capacity path** (``ep_capacity_fused``, on by default). The capacity path's rows move as few times
as the layout allows. Unfused, a chunk's rows were gathered into expert order (``x_perm``), copied into a
zeroed send buffer (``index_copy`` into a fresh ``new_zeros`` buffer, which the out-of-place op first clones:
a fill, a device copy and a scatter of the whole buffer), and on the way back gathered into expert order
again, masked by ``torch.where`` for the dropped rows and only then combined into the tokens; each step's
backward moved the rows once more. Fused, :meth:`Dispatcher.plan` turns the capacity rule's positions into
two int32 maps on the device (``send_src``: the assignment ``t*k + s`` each send-buffer row copies, -1 for
padding; ``send_row``: the send-buffer row of each assignment, -1 when dropped; one scatter each, no row
moves), and

* the send buffer is **one gather from the tokens** (``kernels.gather_rows``: padding rows written as zeros,
  no ``x_perm``); its backward is one gather-reduce per token over ``send_row`` (no atomics);
* the returned buffer is combined into the tokens by **one gather-reduce** (``kernels.unpermute`` with
  ``row_map = send_row``: dropped assignments contribute nothing, so no mask pass); its backward writes the
  buffer's gradient in one gather over ``send_src`` (padding rows zero) with the routing weights' gradient
  as row dot products.

Both are the Triton kernels of ``kernels.permutation`` where ``use_triton_kernels`` applies, else their
PyTorch references. The receive-side regroup and the return trip's regroup are one gather each, as before.
Numerics equal the unfused path: the same products summed in the same order on the kernels (bit-equal), fp32
rounding on the references (the backward's scatter of the reference gather sums in another order).
``ep_capacity_fused: false`` keeps the unfused path for comparison.

Padding rows are only ever moved by permutations (the send buffer, the receive-side regroup, the
combine), never mixed into a routed row, so whatever a grouped GEMM leaves past its last offset
cannot reach an output or a gradient: the sender reads back only its own routed slots.

Collectives are started asynchronously (:func:`a2a_start` / :func:`a2a_wait`, autograd-aware in both
directions), so the caller can compute while rows are on the wire.
"""

from __future__ import annotations

import math
import os
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moespec.config import SYMM_MAX_EP, SYMM_MAX_LOCAL_EXPERTS

DISPATCH_PATHS = ("nccl", "capacity", "symm")


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

    x_perm: torch.Tensor | None  # [n*k, D] rows sorted by global expert (stable: token order inside an
                                 # expert); None on the fused capacity path, which sends from ``x``
    counts: torch.Tensor      # [E] int64 rows per global expert (device)
    order: torch.Tensor       # [n*k] the (token, slot) index, token-major, of each sorted row
    sorted_exp: torch.Tensor  # [n*k] global expert of each sorted row
    flat_exp: torch.Tensor    # [n*k] global expert of each (token, slot), token-major
    tokens: int
    x: torch.Tensor | None = None  # fused capacity path: the chunk's tokens [n, D]
    kernels: bool = False     # fused capacity path: kernels' Triton gathers (else their PyTorch references)

    @property
    def rows(self) -> int:
        """Routed rows of the chunk (n*k)."""
        return self.order.numel()


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
    send_src: torch.Tensor | None = None           # fused capacity: int32 [P*cap] assignment t*k+s of each
                                                   # send-buffer row (-1: padding)
    send_row: torch.Tensor | None = None           # fused capacity: int32 [n*k] send-buffer row of each
                                                   # assignment, token-major (-1: dropped)
    route: SymmRoute | None = None                 # symm: the chunk's layout on both sides
    extra: dict = field(default_factory=dict)


def capacity_per_peer(tokens: int, k: int, P: int, factor: float) -> int:
    """Static rows per peer of the capacity path: ``ceil(factor * tokens * k / P)``, at least 1."""
    return max(1, math.ceil(factor * tokens * k / P - 1e-9))


def worst_case_per_peer(tokens: int, k: int, El: int) -> int:
    """Rows one peer can receive from one rank without a bound: every token picks min(k, El) of its experts."""
    return tokens * min(k, El)


def capacity_keep(routed: Routed, P: int, El: int, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The capacity rule: ``(keep, kept_counts)``. ``keep`` [n*k] bool, in sorted-row order: the row is among
    the first ``cap`` of its (token, slot) pairs, in token order, that go to its peer. ``kept_counts`` [E]
    int64: kept rows per global expert. Device ops only."""
    r = routed
    dest_tok = r.flat_exp // El                                        # token order
    # [P, n] and a scan along the contiguous dim: an outer-dim scan of [n, P] runs P-wide (H100: 14 ms
    # per call at n = 196,608, more than the layer's all-to-all); not F.one_hot: it checks classes on the host
    onehot = torch.zeros(P, dest_tok.numel(), dtype=torch.int32, device=dest_tok.device)
    onehot.scatter_(0, dest_tok.unsqueeze(0), 1)
    pos_tok = onehot.cumsum(1, dtype=torch.int32).gather(0, dest_tok.unsqueeze(0)).squeeze(0) - 1
    keep = (pos_tok < cap).index_select(0, r.order)                     # sorted order
    kept_counts = torch.zeros_like(r.counts).scatter_add_(0, r.sorted_exp, keep.long())
    return keep, kept_counts


def symm_bounds(tokens: int, k: int, P: int, El: int, factor: float) -> tuple[int, int, int]:
    """Static sizes of the symm path for a chunk of ``tokens``: ``(cap, send_rows, recv_rows)``: rows a rank
    keeps per peer (the capacity rule, clamped to the worst case), rows it can send in all, and rows it can
    receive (``P*cap`` plus one padding row per local expert, the ops' minimum block)."""
    cap = min(capacity_per_peer(tokens, k, P, factor), worst_case_per_peer(tokens, k, El))
    return cap, min(tokens * k, P * cap), P * cap + El


def packed_slots(keep: torch.Tensor, dummy: int) -> torch.Tensor:
    """Send-buffer row of every sorted row: kept rows packed in order (rank-major by construction: rows are
    sorted by global expert ``p*El + e``), dropped rows to ``dummy`` (a row no kept row uses)."""
    pos = keep.long().cumsum(0) - 1
    return torch.where(keep, pos, torch.full_like(pos, dummy))


def layout_gemm_offsets(layout: torch.Tensor, P: int, El: int) -> torch.Tensor:
    """int32 [El] end offsets for the grouped GEMM from the expert-major layout ``[2, El*P]`` that
    ``all_to_all_vdev_2d`` writes (row 0: rows of (expert ``e``, source ``s``) at ``e*P + s``; row 1: their
    start): expert ``e``'s routed rows end at its first block's start plus its rows."""
    splits, starts = layout[0].view(El, P), layout[1].view(El, P)
    return (starts[:, 0] + splits.sum(1)).to(torch.int32)


def layout_row_mask(layout: torch.Tensor, P: int, El: int, rows: int) -> torch.Tensor:
    """bool [rows]: which rows of the expert-major buffer hold a routed row (not alignment padding or tail)."""
    splits, starts = layout[0].view(El, P), layout[1].view(El, P)
    first = starts[:, 0].contiguous()
    end = first + splits.sum(1)
    r = torch.arange(rows, device=layout.device)
    e = (torch.searchsorted(first, r, right=True) - 1).clamp(min=0)
    return (r >= first.index_select(0, e)) & (r < end.index_select(0, e))


# ---------------------------------------------------------------------------------- the dispatcher
class Dispatcher:
    """Moves routed rows between the ranks of one EP group (``P`` ranks, ``El`` experts each)."""

    def __init__(self, *, path: str, level: int, k: int, P: int, El: int, group, capacity_factor: float = 1.25,
                 fused: bool = True):
        if path not in DISPATCH_PATHS:
            raise ValueError(f"ep_dispatch must be one of {', '.join(DISPATCH_PATHS)}, got {path!r}")
        self.path, self.level, self.k, self.P, self.El, self.group = path, level, k, P, El, group
        if path == "symm" and (P > SYMM_MAX_EP or El > SYMM_MAX_LOCAL_EXPERTS):
            raise ValueError(f"ep_dispatch=symm: the NVSHMEM ops take at most {SYMM_MAX_EP} ranks and "
                             f"{SYMM_MAX_LOCAL_EXPERTS} experts per rank, got ep={P} with {El} experts per rank")
        self.capacity_factor = capacity_factor
        # ep_capacity_fused: the capacity path builds its send buffer from the tokens in one gather and combines
        # the returned rows into the tokens in one gather-reduce (module docstring, "The fused capacity path")
        self.fused = fused and path == "capacity"
        self.dropped: torch.Tensor | None = None   # device int64: rows dropped so far (capacity, symm)
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
        if self.path == "symm":  # no counts all-to-all: the ops exchange the splits on the device
            for t in trips:
                self._symm_layout(t, len(trips))
            return
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
                    pos = torch.arange(r.rows, device=r.order.device) - rank_start.index_select(0, dest)
                    t.slot = dest * t.cap + pos
            if not recomputing():
                self.routed_rows += r.rows
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
        keep, kept_counts = capacity_keep(r, P, El, t.cap)
        dest = r.sorted_exp // El
        krank = kept_counts.view(P, El).sum(1)
        kstart = krank.cumsum(0) - krank
        pos = keep.long().cumsum(0) - 1 - kstart.index_select(0, dest)
        if r.x is not None:  # fused: the two maps of the send buffer, on the device (a scatter each; no row moves)
            kept_slot = torch.where(keep, dest * t.cap + pos, -1).to(torch.int32)          # sorted order
            t.send_row = torch.empty_like(kept_slot).scatter_(0, r.order, kept_slot)         # token-major
            t.send_src = torch.full((P * t.cap + 1,), -1, dtype=torch.int32, device=keep.device).scatter_(
                0, torch.where(keep, dest * t.cap + pos, P * t.cap), r.order.to(torch.int32))[:P * t.cap]
        else:
            t.slot = torch.where(keep, dest * t.cap + pos, torch.full_like(pos, P * t.cap))
        t.keep, t.send_counts = keep, kept_counts
        self._count_drops(r, keep)

    def _count_drops(self, r: Routed, keep: torch.Tensor) -> None:
        if not recomputing():  # activation checkpointing runs the forward again inside the backward
            n_drop = r.rows - keep.sum()
            self.dropped = n_drop if self.dropped is None else self.dropped + n_drop

    def _symm_layout(self, t: Trip, chunks: int) -> None:
        r, P, El = t.routed, self.P, self.El
        t.cap, send_rows, recv_rows = symm_bounds(r.tokens, self.k, P, El, self.capacity_factor)
        keep, kept_counts = capacity_keep(r, P, El, t.cap)
        t.keep, t.send_counts = keep, kept_counts
        bufs = symm_buffers(self.group, r.x_perm.device, P, El, sets=2 if chunks > 1 else 1)
        t.route = SymmRoute(bufs, keep, packed_slots(keep, send_rows), kept_counts, send_rows, recv_rows)
        self._count_drops(r, keep)
        if not recomputing():
            self.routed_rows += r.rows

    def send(self, t: Trip) -> None:
        """Start the chunk's rows on their way."""
        if t.send_src is not None:  # fused capacity path: the send buffer in one gather from the tokens
            r = t.routed
            if r.kernels:
                from kernels import gather_rows

                buf = gather_rows(r.x, t.send_src, t.send_row, self.k)
            else:
                from kernels.reference import gather_rows_ref

                buf = gather_rows_ref(r.x, t.send_src, self.k)
            t.fwd = a2a_start(buf, None, None, self.group)
            return
        x = t.routed.x_perm
        if self.path == "symm":
            t.fwd = symm_start(x, t.route, "dispatch")
            return
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
        if self.path == "symm":
            x2 = symm_wait(t.fwd)
            t.offs = layout_gemm_offsets(t.route.layout, self.P, self.El)
            return x2, t.offs, None
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
        if self.path == "symm":
            t.back = symm_start(y2, t.route, "combine")
            return
        if self.exact:
            t.back = a2a_start(move_rows(y2, t.dest, t.src), t.send_splits, t.recv_splits, self.group)
            return
        if t.recv_total is not None:
            y_recv = y2.new_zeros(self.P * t.cap, y2.shape[1]).index_copy(0, t.src, y2)
        else:
            y_recv = move_rows(y2, t.dest, t.src)
        t.back = a2a_start(y_recv, None, None, self.group)

    def combine_receive(self, t: Trip) -> torch.Tensor:
        """The chunk's expert outputs, in its sorted-row order (dropped rows: zeros); on the fused capacity path
        the returned send-buffer layout itself, for :meth:`combine_tokens`."""
        if self.path == "symm":
            return symm_wait(t.back)
        y_back = a2a_wait(t.back)
        if self.exact or t.send_src is not None:
            return y_back
        if t.keep is None:
            return move_rows(y_back, t.slot)
        # dropped rows read a placeholder row forward (zeroed by the where) and scatter to a cut-off row backward
        y = move_rows(y_back, t.slot.clamp(max=y_back.shape[0] - 1), bwd_idx=t.slot)
        return torch.where(t.keep.unsqueeze(1), y, y.new_zeros(()))


    def combine_tokens(self, t: Trip, y_back: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        """Fused capacity path: the chunk's tokens ``[n, D]`` = the routing-weighted sum of each token's rows in
        the returned buffer (``y_back``, the send-buffer layout), dropped assignments contributing nothing. One
        gather-reduce; its backward writes the buffer's gradient in one gather (padding rows zero) and the
        weights' gradient as row dot products."""
        if t.routed.kernels:
            from kernels import unpermute

            return unpermute(y_back, t.send_row, topk_w, sorted_pos=t.send_src)
        from kernels.reference import unpermute_ref

        return unpermute_ref(y_back, t.send_row, topk_w)


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


# ------------------------------------------------------------------------------- symm: the NVSHMEM path
def symm_problem(device: torch.device) -> str | None:
    """Why ``ep_dispatch=symm`` cannot run on ``device`` (None: it can)."""
    if device.type != "cuda":
        return f"needs CUDA GPUs with NVSHMEM, and this run is on {device.type}"
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return f"needs torch.distributed._symmetric_memory, which torch {torch.__version__} does not have"
    if not all(hasattr(torch.ops.symm_mem, op) for op in ("all_to_all_vdev_2d", "all_to_all_vdev_2d_offset")):
        return f"needs torch.ops.symm_mem.all_to_all_vdev_2d(_offset), which torch {torch.__version__} does not have"
    if not symm_mem.is_nvshmem_available():
        return "needs NVSHMEM, and torch.distributed._symmetric_memory.is_nvshmem_available() is False here"
    return None


class NvshmemOps:
    """The two PyTorch ops and the symmetric allocation (the CPU tests swap in an emulation of the same
    contract written with gloo all-to-alls, see :func:`set_symm_ops`)."""

    def __init__(self):
        self.started = False

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, group, heap_hint: int) -> torch.Tensor:
        import torch.distributed._symmetric_memory as symm_mem

        if not self.started:  # NVSHMEM starts at the first allocation: the heap size and the backend go first
            why = symm_problem(device)
            if why:
                raise RuntimeError(f"ep_dispatch=symm {why}")
            if "NVSHMEM_SYMMETRIC_SIZE" not in os.environ:  # the default heap (1 GiB) is too small for real shapes
                os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(max(1 << 30, heap_hint))
            if symm_mem.get_backend(device) != "NVSHMEM":
                symm_mem.set_backend("NVSHMEM")
            self.started = True
        try:
            t = symm_mem.empty(shape, dtype=dtype, device=device)
        except RuntimeError as err:
            raise RuntimeError(f"ep_dispatch=symm: cannot allocate {math.prod(shape) * dtype.itemsize / 2**20:.0f} MiB "
                               f"of symmetric memory (NVSHMEM_SYMMETRIC_SIZE="
                               f"{os.environ.get('NVSHMEM_SYMMETRIC_SIZE')}): {' '.join(str(err).split())[:200]}") from None
        symm_mem.rendezvous(t, group.group_name)
        return t

    def dispatch(self, inp, out, in_splits, out_splits_offsets, group) -> None:
        torch.ops.symm_mem.all_to_all_vdev_2d(inp, out, in_splits, out_splits_offsets, group.group_name, major_align=1)

    def combine(self, inp, out, in_splits_offsets, out_splits_offsets, group) -> None:
        torch.ops.symm_mem.all_to_all_vdev_2d_offset(inp, out, in_splits_offsets, out_splits_offsets, group.group_name)


_SYMM_OPS = NvshmemOps()
_SYMM_BUFFERS: dict = {}


def set_symm_ops(ops) -> None:
    """Replace the symm path's ops (``alloc``, ``dispatch``, ``combine`` with :class:`NvshmemOps`'s contract);
    the CPU tests install an emulation. Drops the buffers made by the previous ops."""
    global _SYMM_OPS
    _SYMM_OPS = ops
    _SYMM_BUFFERS.clear()


class SymmBuffers:
    """The symmetric buffers of one EP group on one device, shared by every layer, chunk and pass, with the
    op count that decides which set an op uses (module docstring: "Reuse without a host sync")."""

    def __init__(self, group, device: torch.device, P: int, El: int):
        self.group, self.device, self.P, self.El = group, device, P, El
        self.sets = 1
        self.ops_run = 0
        self.last: tuple[str, int] | None = None   # (direction, set) of the previous op
        self.rows: dict = {}      # (side, dtype, width, set) -> 2-D buffer
        self.splits: dict = {}    # (name, set) -> int64 buffer
        self.retired: list = []   # outgrown buffers: kept, never freed mid-run (a free is no collective)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.barriers = 0

    def _row_buffer(self, side: str, dtype, width: int, s: int, rows: int) -> torch.Tensor:
        key = (side, dtype, width, s)
        buf = self.rows.get(key)
        if buf is None or buf.shape[0] < rows:
            if buf is not None:
                self.retired.append(buf)
            # the heap hint (first allocation only): both sides, two sets, two dtypes of this size
            hint = 10 * rows * width * dtype.itemsize + (64 << 20)
            buf = self.rows[key] = _SYMM_OPS.alloc((rows, width), dtype, self.device, self.group, hint)
        return buf

    def _split_buffer(self, name: str, s: int) -> torch.Tensor:
        key = (name, s)
        if key not in self.splits:
            shape = (self.P * self.El,) if name == "in_splits" else (2, self.P * self.El)
            self.splits[key] = _SYMM_OPS.alloc(shape, torch.int64, self.device, self.group, 1 << 30)
        return self.splits[key]

    def _barrier(self) -> None:
        """Every rank of the group reaches this point of its stream before any goes on (no host sync on NCCL)."""
        dist.all_reduce(torch.zeros(1, device=self.device), group=self.group)
        self.barriers += 1

    def move(self, direction: str, x: torch.Tensor, route: SymmRoute):
        """Run one op: ``dispatch`` takes the sender's sorted rows [n*k, D] to the expert-major rows
        [recv_rows, D] (padding zeroed), ``combine`` the expert-major rows back to the sorted rows (dropped
        rows zero). Returns ``(out, event)``: on CUDA the op runs on this group's stream, ``out`` is ready
        once the compute stream waits on ``event``."""
        x = x.contiguous()
        compute = torch.cuda.current_stream(self.device) if self.stream is not None else None
        if compute is not None:
            self.stream.wait_stream(compute)
            for t in (x, route.slot, route.keep, route.in_splits):
                t.record_stream(self.stream)  # read on the stream: not reused by the compute stream before that
            if route.layout is not None:
                route.layout.record_stream(self.stream)
        with torch.cuda.stream(self.stream) if compute is not None else nullcontext():
            s, par = self.ops_run % self.sets, self.ops_run % 2
            if self.last == (direction, s):
                self._barrier()  # the same input buffer as the previous op, which peers may still read
            self.ops_run += 1
            self.last = (direction, s)
            D = x.shape[1]
            send = self._row_buffer("send", x.dtype, D, s, route.send_rows + 1)
            recv = self._row_buffer("expert", x.dtype, D, s, route.recv_rows)
            oso = self._split_buffer("out_splits_offsets", par)
            if direction == "dispatch":
                send.index_copy_(0, route.slot, x)    # dropped rows: to row send_rows, never sent
                ins = self._split_buffer("in_splits", par)
                ins.copy_(route.in_splits)
                _SYMM_OPS.dispatch(send, recv, ins, oso, self.group)
                layout = oso.clone()
                if route.layout is None:  # the forward's; a backward dispatch lays the rows out the same way
                    route.layout = layout
                    if compute is not None:
                        layout.record_stream(compute)
                mask = layout_row_mask(layout, self.P, self.El, route.recv_rows)
                out = torch.where(mask.unsqueeze(1), recv[:route.recv_rows], recv.new_zeros(()))
            else:
                recv[:route.recv_rows].copy_(x)
                iso = self._split_buffer("in_splits_offsets", par)
                iso.copy_(route.layout)
                _SYMM_OPS.combine(recv, send, iso, oso, self.group)
                rows = send.index_select(0, route.slot)  # a dropped row reads row send_rows, never sent
                out = torch.where(route.keep.unsqueeze(1), rows, rows.new_zeros(()))
            event = None
            if compute is not None:
                out.record_stream(compute)
                event = torch.cuda.Event()
                event.record(self.stream)
        return out, event

    def wait(self, event) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)


def symm_buffers(group, device: torch.device, P: int, El: int, sets: int) -> SymmBuffers:
    """The shared :class:`SymmBuffers` of ``group`` on ``device`` (made on first use), with at least ``sets``
    sets of row buffers (2 when chunks' dispatches follow each other)."""
    key = (id(group), str(device))
    bufs = _SYMM_BUFFERS.get(key)
    if bufs is None:
        bufs = _SYMM_BUFFERS[key] = SymmBuffers(group, device, P, El)
    bufs.sets = max(bufs.sets, sets)
    return bufs


@dataclass
class SymmRoute:
    """One chunk's symm layout: the sender side (sorted rows -> packed send rows) and, once the forward
    dispatch ran, the expert side (the op's ``[2, P*El]`` layout, on the device)."""

    bufs: SymmBuffers
    keep: torch.Tensor        # [n*k] bool, sorted order
    slot: torch.Tensor        # [n*k] int64 packed send row (dropped: send_rows)
    in_splits: torch.Tensor   # [P*El] int64 kept rows per (peer, local expert) = per global expert
    send_rows: int
    recv_rows: int
    layout: torch.Tensor | None = None


class _SymmBox:
    __slots__ = ("bwd", "fwd", "grad_in")

    def __init__(self):
        self.fwd = self.bwd = self.grad_in = None


_REVERSE = {"dispatch": "combine", "combine": "dispatch"}


class _SymmStart(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, route, direction, box):
        ctx.route, ctx.box = route, box
        out, box.fwd = route.bufs.move(direction, x, route)
        return out

    @staticmethod
    def backward(ctx, grad):  # _SymmWait.backward started the reverse op on ``grad``: its output is ours
        box = ctx.box
        ctx.route.bufs.wait(box.bwd)
        gin, box.bwd, box.grad_in = box.grad_in, None, None
        return gin, None, None, None


class _SymmWait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, route, direction, box):
        ctx.route, ctx.direction, ctx.box = route, direction, box
        route.bufs.wait(box.fwd)
        box.fwd = None
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        box = ctx.box
        box.grad_in, box.bwd = ctx.route.bufs.move(_REVERSE[ctx.direction], grad, ctx.route)
        return grad, None, None, None


@dataclass
class SymmTransfer:
    out: torch.Tensor
    route: SymmRoute
    direction: str
    box: _SymmBox


def symm_start(x: torch.Tensor, route: SymmRoute, direction: str) -> SymmTransfer:
    """Start a differentiable symm op (``dispatch`` or ``combine``); its backward runs the other one on the
    gradient, likewise started by the wait's backward and awaited by the start's."""
    box = _SymmBox()
    return SymmTransfer(_SymmStart.apply(x, route, direction, box), route, direction, box)


def symm_wait(t: SymmTransfer) -> torch.Tensor:
    """The started op's output (on CUDA: the compute stream waits for it; nothing blocks the host)."""
    return _SymmWait.apply(t.out, t.route, t.direction, t.box)
