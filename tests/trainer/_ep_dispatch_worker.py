"""Run on 4 gloo ranks by test_ep_dispatch.py (forked by tests/trainer/_workers.py; on GPUs under torchrun, by
benchmarks/bench_ep.sh); rank 0 writes the results as JSON.

For EP 4 (one group of 4) and EP 2 (two groups of 2), every dispatch path (``ep_dispatch`` nccl at
every sync-free level; capacity with a factor that drops nothing and with one that drops), overlap
off and on: one MoE layer's output and gradients against a reference computed on every rank of the
group's tokens with the full expert set:

* without drops, the reference is the EP=1 layer (trainer.model.moe.MoE, ep_size 1);
* with drops, it is written out here from the weights: for each (token, slot) in token order, the
  row is kept while fewer than ``ceil(f * n * k / P)`` earlier rows of the same chunk of the same
  rank went to the same peer; a token's output is its shared expert plus its kept experts' weighted
  SwiGLU outputs. The dropped-row count is checked against the same rule.

``ep_dispatch: symm`` runs the capacity rule too (its reference is the same), serial and overlapped,
without and with drops, and with a skewed router (``skew``: a large feature pushes most rows to the first
experts and none to the last peer's, so that peer receives nothing and several local experts are empty).
On a CPU the NVSHMEM ops cannot run: :class:`EmulatedSymmOps` writes their contract (nvshmem_extension.cu:
the expert-major layout with one padding row per empty expert, the reverse op) with gloo all-to-alls, and
fills fresh symmetric buffers with NaN, so a padding or dropped row that leaked into an output or a
gradient would show. On GPUs the real ops run.

Host syncs in the MoE path are counted per path and level (forward + backward; the emulation's own reads
are hidden from the counter, as the real ops have none).

The capacity path runs fused (``ep_capacity_fused``, the default: the send buffer gathered from the tokens,
the returned rows combined into them in one gather-reduce) and every capacity case is also run unfused on the
same inputs (``vs_unfused``: outputs, every gradient and the dropped rows against the fused run), with the
kernels' PyTorch references and (``kernels`` cases, ``use_triton_kernels``) with their Triton kernels, under
the interpreter on a CPU (there on a model of d_model 16: the interpreter's time grows with the column blocks).

``EP_WORKER_DEVICE=cuda`` (benchmarks/bench_ep.sh, on GPUs): NCCL instead of gloo, the same cases on the
GPU, plus bf16 cases through ``torch._grouped_mm`` (whose rows past the last offset are left unwritten:
the outputs and gradients must still match and be finite). Rank 0 prints one PASS/FAIL line per case
(tolerances in :func:`tolerance`; a failing case names each quantity over it with its shape and first
mismatch) and the worker exits 1 if any case failed.
"""

from __future__ import annotations

import json
import math
import os
import sys

from tests.trainer._workers import interpreter_or_stop

if __name__ == "__main__":
    interpreter_or_stop()
if __name__ == "__main__" and os.environ.get("EP_WORKER_DEVICE") != "cuda":
    # the kernels cases run the Triton kernels interpreted on a CPU (set before anything imports triton;
    # only when run as the worker: a test that imports this module's helpers must not hand the variable
    # to the trainer subprocesses it starts later)
    os.environ.setdefault("TRITON_INTERPRET", "1")
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes

from moespec.config import load_config
from trainer.model import dispatch
from trainer.model.moe import MoE, route
from trainer.syncs import HostSyncCounter


def _init(m: MoE, skew_P: int = 0) -> None:
    torch.manual_seed(7)
    m.gate.weight.data.normal_(0, 0.5)
    for lin in (m.shared.w1, m.shared.w2, m.shared.w3):
        lin.weight.data.normal_(0, 0.1)
    m.init_weights(0.1, torch.Generator().manual_seed(11))
    if skew_P:  # feature 0 (made large in _inputs) favours experts 0-2 and rules out the last peer's experts
        E = m.gate.weight.shape[0]
        col = torch.zeros(E)
        col[:3] = 4.0
        col[E - E // skew_P:] = -4.0
        m.gate.weight.data[:, 0] = col.to(m.gate.weight.device, m.gate.weight.dtype)


DEV = torch.device("cpu")


def _inputs(ranks, B, S, D, dtype, skew=False):
    xs = [torch.randn(B, S, D, generator=torch.Generator().manual_seed(100 + r)) for r in ranks]
    if skew:
        for x in xs:
            x[..., 0] = 3.0
    xs = [x.to(DEV, dtype) for x in xs]
    gs = [torch.randn(B, S, D, generator=torch.Generator().manual_seed(200 + r)).to(DEV, dtype) for r in ranks]
    return xs, gs


def _host(t: torch.Tensor) -> list[int]:
    """Host ints through ``int()`` (``aten::_local_scalar_dense``, hidden with the dispatch modes), not the
    counter's patched ``Tensor.tolist``."""
    return [int(v) for v in t]


class EmulatedSymmOps:
    """``torch.ops.symm_mem.all_to_all_vdev_2d`` (with ``major_align=1``) and ``all_to_all_vdev_2d_offset``
    as PyTorch 2.11's nvshmem_extension.cu defines them, written with gloo all-to-alls for the CPU tests of
    the symm path; "symmetric" buffers are plain tensors filled with NaN (int64: -1)."""

    def alloc(self, shape, dtype, device, group, heap_hint):
        return torch.full(shape, -1 if dtype == torch.int64 else float("nan"), dtype=dtype, device=device)

    @staticmethod
    def expert_major(recv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows received [P src, El] -> (splits, offsets) [El*P], index e*P + src: each expert's block starts
        where the previous one ends, and takes at least one row (major_align = 1)."""
        P, El = recv.shape
        splits = recv.t().reshape(-1)
        offsets, start = [], 0
        for e in range(El):
            pos = start
            for s in range(P):
                offsets.append(pos)
                pos += int(recv[s, e])
            start += max(int(recv[:, e].sum()), 1)
        return splits, torch.tensor(offsets, dtype=torch.int64)

    def dispatch(self, inp, out, in_splits, oso, group):
        with _disable_current_modes():  # the real op reads nothing on the host: keep the sync counter blind
            P = dist.get_world_size(group)
            El = in_splits.numel() // P
            recv = torch.empty_like(in_splits)
            dist.all_to_all_single(recv, in_splits.clone(), group=group)
            recv = recv.view(P, El)
            send_sizes = _host(in_splits.view(P, El).sum(1))
            recv_sizes = _host(recv.sum(1))
            rows = inp.new_empty((sum(recv_sizes), inp.shape[1]))
            dist.all_to_all_single(rows, inp[:sum(send_sizes)].contiguous(), recv_sizes, send_sizes, group=group)
            splits, offsets = self.expert_major(recv)
            pos = 0
            for s in range(P):  # received source-major, each source's rows by local expert
                for e in range(El):
                    n = int(recv[s, e])
                    o = int(offsets[e * P + s])
                    out[o:o + n] = rows[pos:pos + n]
                    pos += n
            oso[0].copy_(splits)
            oso[1].copy_(offsets)

    def combine(self, inp, out, iso, oso, group):
        with _disable_current_modes():
            P = dist.get_world_size(group)
            El = iso.shape[1] // P
            splits, offsets = iso[0].view(El, P), iso[1].view(El, P)
            chunks = [inp[int(offsets[e, p]):int(offsets[e, p]) + int(splits[e, p])] for p in range(P) for e in range(El)]
            send = torch.cat(chunks) if chunks else inp[:0]
            send_sizes = _host(splits.sum(0))
            back = torch.empty(P * El, dtype=torch.int64)
            dist.all_to_all_single(back, splits.t().contiguous().reshape(-1), group=group)   # [src, e]
            recv_sizes = _host(back.view(P, El).sum(1))
            rows = inp.new_empty((sum(recv_sizes), inp.shape[1]))
            dist.all_to_all_single(rows, send.contiguous(), recv_sizes, send_sizes, group=group)
            out[:rows.shape[0]] = rows
            oso[0].copy_(back)
            oso[1].copy_(back.cumsum(0) - back)


def tolerance(dtype) -> float:
    """Largest error accepted: fp32 differs only by summation order (CPU measured <= 7e-6; GPU kernels
    differ more); bf16 relative to the reference's scale (every product rounds)."""
    if dtype != torch.float32:
        return 2e-2
    return 1e-4 if DEV.type == "cuda" else 1e-5


def _first_mismatch(got: torch.Tensor, want: torch.Tensor, tol: float) -> str:
    diff = (got.float() - want.float()).abs()
    bad = (diff > tol) | ~got.isfinite()
    if not bool(bad.any()):
        return f"shape {tuple(got.shape)}"
    idx = tuple(int(i) for i in bad.nonzero()[0])
    return (f"shape {tuple(got.shape)}, {int(bad.sum())} elements off, first at {idx}: got {float(got[idx]):.6g}, "
            f"want {float(want[idx]):.6g}")


def _dropping_reference(ref: MoE, cfg, xs, P, chunks, factor, slot: list[int] | None = None):
    """Output of every rank's tokens under the capacity rule, from ``ref``'s weights (EP=1 layer). ``slot``
    (``ep_placement``): logical expert -> physical slot, whose rank is the peer (default: the expert id's)."""
    k, E = cfg["top_k"], cfg["n_routed_experts"]
    El = E // P
    ys, dropped = [], 0
    w13, w2 = ref.experts.w13, ref.experts.w2
    for x in xs:
        xf = x.reshape(-1, x.shape[-1])
        T = xf.shape[0]
        logits = F.linear(xf.float(), ref.gate.weight.float())
        idx, w, _ = route(logits, top_k=k, score_func=cfg["score_func"], n_group=cfg["n_group"],
                          topk_group=cfg["topk_group"], norm_topk_prob=cfg["norm_topk_prob"],
                          routed_scaling_factor=cfg["routed_scaling_factor"])
        ids = idx.tolist()  # host ints once: the rule below walks every (token, slot) in order
        kept: list[tuple[int, int, int]] = []  # (token, slot, expert), in token order then slot order
        for c in range(chunks):
            lo, hi = T * c // chunks, T * (c + 1) // chunks
            cap = max(1, math.ceil(factor * (hi - lo) * k / P - 1e-9))
            used = [0] * P
            for t in range(lo, hi):
                for s in range(k):
                    e = ids[t][s]
                    p = (e if slot is None else slot[e]) // El
                    if used[p] < cap:
                        kept.append((t, s, e))
                        used[p] += 1
        dropped += T * k - len(kept)
        y = ref.shared(xf)
        if kept:
            # each kept row's weighted SwiGLU output, all rows at once (a batched matmul per weight), then added to
            # its token in the order the rule walked them (index_add adds them in index order on a CPU)
            tk, sk, ek = (torch.tensor(v, device=y.device) for v in zip(*kept, strict=True))
            h = torch.bmm(w13[ek], xf[tk].unsqueeze(-1)).squeeze(-1)
            g, u = h.chunk(2, dim=-1)
            out = torch.bmm(w2[ek], (F.silu(g) * u).unsqueeze(-1)).squeeze(-1)
            y = y.index_add(0, tk, w[tk, sk].to(y.dtype).unsqueeze(-1) * out)
        ys.append(y.view_as(x))
    return ys, dropped


def _run_ep(cfg, group, P, me, x_in, g, skew, dtype, record=False):
    """One forward + backward of the EP layer under ``cfg`` -> (the layer, its output, the input's gradient, and
    with ``record`` the order of its shared-expert calls and token all-to-all starts, forward and backward)."""
    ep = MoE(cfg, group, P, me)
    _init(ep, P if skew else 0)
    ep.to(DEV, dtype)
    x = x_in.clone().requires_grad_(True)
    with _recording(ep) if record else nullcontext([]) as order:
        y, _ = ep(x)
        (y * g).sum().backward()
    return ep, y, x.grad, order


@contextmanager
def _recording(ep: MoE):
    """Log, in order: each shared-expert forward and backward (with its rows) and each token all-to-all started
    (``async_op``; the counts exchange is not one), forward or backward (inside the backward's graph task)."""
    order: list[str] = []
    hooks = [ep.shared.register_forward_pre_hook(lambda m, a: order.append(f"shared fwd {a[0].shape[0]}")),
             ep.shared.register_full_backward_hook(lambda m, gi, go: order.append(f"shared bwd {go[0].shape[0]}"))]
    a2a = dist.all_to_all_single

    def logged(*args, **kwargs):
        if kwargs.get("async_op"):
            order.append("a2a bwd" if torch._C._current_graph_task_id() != -1 else "a2a fwd")
        return a2a(*args, **kwargs)

    dist.all_to_all_single = logged
    try:
        yield order
    finally:
        dist.all_to_all_single = a2a
        for h in hooks:
            h.remove()


def check(cfg, group, P, me, ranks, *, path, level, overlap, factor, backend="torch", dtype=torch.float32,
          skew=False, schedule="chunked", kernels=False):
    cfg = dict(cfg, sync_free_level=level, grouped_gemm_backend=backend, ep=P, ep_dispatch=path,
               ep_capacity_factor=factor, ep_overlap=overlap, ep_overlap_chunks=2, ep_overlap_schedule=schedule,
               use_triton_kernels=kernels)
    ep = MoE(cfg, group, P, me)
    ref = MoE(dict(cfg, ep=1, ep_dispatch="nccl", ep_overlap=False), None, 1, 0)
    _init(ep, P if skew else 0)
    _init(ref, P if skew else 0)
    ep.to(DEV, dtype)
    ref.to(DEV, dtype)
    B, S, D = 2, 16, cfg["d_model"]
    xs, gs = _inputs(ranks, B, S, D, dtype, skew)
    x = xs[me].clone().requires_grad_(True)
    with HostSyncCounter() as counter:
        y, _ = ep(x)
        (y * gs[me]).sum().backward()
    chunks = 2 if overlap else 1
    if path in ("capacity", "symm"):
        xr = [t.clone().requires_grad_(True) for t in xs]
        yr, want_dropped = _dropping_reference(ref, cfg, xr, P, chunks, factor)
        sum((a * b).sum() for a, b in zip(yr, gs, strict=True)).backward()
        y_ref, xg_ref = yr[me], xr[me].grad
        got_dropped = int(ep.dispatcher.dropped)
        total = torch.tensor([got_dropped], device=DEV)
        dist.all_reduce(total, group=group)
        got_dropped = int(total)
    else:
        xr = torch.cat(xs).requires_grad_(True)
        yr, _ = ref(xr)
        (yr * torch.cat(gs)).sum().backward()
        y_ref, xg_ref = yr[me * B:(me + 1) * B], xr.grad[me * B:(me + 1) * B]
        want_dropped = got_dropped = 0
    lo, hi = me * ep.E_local, (me + 1) * ep.E_local
    ref_scale = {"y": y_ref.abs().max(), "x_grad": xg_ref.abs().max(), "w13_grad": ref.experts.w13.grad.abs().max(),
                 "w2_grad": ref.experts.w2.grad.abs().max(), "gate_grad": ref.gate.weight.grad.abs().max(),
                 "shared_grad": ref.shared.w1.weight.grad.abs().max()}
    # the gate's gradient of the EP layer covers my tokens only: sum over the group
    gate_grad = ep.gate.weight.grad.clone()
    dist.all_reduce(gate_grad, group=group)
    shared_grad = ep.shared.w1.weight.grad.clone()
    dist.all_reduce(shared_grad, group=group)
    finite = all(bool(t.isfinite().all()) for t in (y, x.grad, ep.experts.w13.grad, ep.experts.w2.grad))
    pairs = {"y": (y, y_ref), "x_grad": (x.grad, xg_ref), "w13_grad": (ep.experts.w13.grad * P, ref.experts.w13.grad[lo:hi]),
             "w2_grad": (ep.experts.w2.grad * P, ref.experts.w2.grad[lo:hi]), "gate_grad": (gate_grad, ref.gate.weight.grad),
             "shared_grad": (shared_grad, ref.shared.w1.weight.grad)}
    err = {
        "y": (y - y_ref).abs().max().item(),
        "x_grad": (x.grad - xg_ref).abs().max().item(),
        # expert grads are pre-scaled by 1/ep for the DP reduction (see trainer.parallel.dist)
        "w13_grad": (ep.experts.w13.grad * P - ref.experts.w13.grad[lo:hi]).abs().max().item(),
        "w2_grad": (ep.experts.w2.grad * P - ref.experts.w2.grad[lo:hi]).abs().max().item(),
        "gate_grad": (gate_grad - ref.gate.weight.grad).abs().max().item(),
        "shared_grad": (shared_grad - ref.shared.w1.weight.grad).abs().max().item(),
    }
    tol = tolerance(dtype)
    scale = {k: 1.0 for k in err}
    if dtype != torch.float32:  # relative to the reference's scale: bf16 rounds every product
        scale = {k: max(1e-6, float(ref_scale[k])) for k in err}
        err = {k: v / scale[k] for k, v in err.items()}
    where = {k: _first_mismatch(pairs[k][0], pairs[k][1], tol * scale[k]) for k, v in err.items() if v >= tol or not finite}
    # rows each global expert gets from the group's tokens (the routing the case exercises: skew empties the
    # last peer and some experts)
    per_expert = torch.zeros(cfg["n_routed_experts"], dtype=torch.int64)
    for xr_ in xs:
        logits = F.linear(xr_.reshape(-1, D).float(), ref.gate.weight.float())
        idx, _, _ = route(logits, top_k=cfg["top_k"], score_func=cfg["score_func"], n_group=cfg["n_group"],
                          topk_group=cfg["topk_group"], norm_topk_prob=cfg["norm_topk_prob"],
                          routed_scaling_factor=cfg["routed_scaling_factor"])
        per_expert += torch.bincount(idx.reshape(-1).cpu(), minlength=cfg["n_routed_experts"])
    res = {"err": err, "tol": tol, "finite": finite, "where": where, "syncs": dict(counter.by_stage),
           "moe_syncs": counter.moe_total, "dropped": got_dropped, "want_dropped": want_dropped,
           "routed_rows": ep.dispatcher.routed_rows, "rows_per_expert": per_expert.tolist()}
    if path == "capacity":  # the fused path against the unfused one, same inputs: the same function and drops
        other, y_o, xg_o, _ = _run_ep(dict(cfg, ep_capacity_fused=False), group, P, me, xs[me], gs[me], skew, dtype)
        res["vs_unfused"] = {
            "y": (y - y_o).abs().max().item(), "x_grad": (x.grad - xg_o).abs().max().item(),
            **{n: (a.grad - b.grad).abs().max().item()
               for (n, a), b in zip(ep.named_parameters(), other.parameters(), strict=True)},
            "dropped": int(other.dispatcher.dropped), "own_dropped": int(ep.dispatcher.dropped)}
    if schedule == "pipelined":  # against the serial path (no overlap) and the chunked schedule, on the same inputs
        res["vs"] = {}
        for name, over in (("serial", {"ep_overlap": False, "ep_overlap_schedule": "chunked"}),
                           ("chunked", {"ep_overlap_schedule": "chunked"})):
            other, y_o, xg_o, _ = _run_ep(dict(cfg, **over), group, P, me, xs[me], gs[me], skew, dtype)
            res["vs"][name] = {
                "y": (y - y_o).abs().max().item(), "x_grad": (x.grad - xg_o).abs().max().item(),
                **{n: (a.grad - b.grad).abs().max().item()
                   for (n, a), b in zip(ep.named_parameters(), other.parameters(), strict=True)},
                "dropped": int(other.dispatcher.dropped) if other.dispatcher.dropped is not None else 0,
                "own_dropped": int(ep.dispatcher.dropped) if ep.dispatcher.dropped is not None else 0}
        res["order"] = _run_ep(cfg, group, P, me, xs[me], gs[me], skew, dtype, record=True)[3]
    return res


def dispatch_kernels_run() -> bool:
    """Whether kernels' Triton kernels run here (CUDA, or a CPU under the interpreter set above)."""
    import kernels

    return kernels.triton_ok(torch.empty(0, device=DEV))


def main(out_dir: str) -> None:
    global DEV
    cuda = os.environ.get("EP_WORKER_DEVICE") == "cuda"
    if cuda:
        DEV = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(DEV)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world in (2, 4), f"the worker runs on 2 or 4 ranks, not {world}"
    cfg = load_config("tiny", {"ep": 1})
    # the kernels cases on a CPU run each Triton program in Triton's interpreter (Python, a fraction of a second per
    # program and op): d_model 16 there, one column block per row block of the gathers and combines instead of four
    # (their column loop and its mask are checked at several blocks in tests/kernels/test_permute.py), which halves
    # the worker's time; on GPUs the compiled kernels run on the model's own width
    kernels_cfg = cfg if cuda else load_config("tiny", {"ep": 1, "d_model": 16})
    if world == 4:  # EP 4 over the world and EP 2 inside it (two groups)
        ep2_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        layouts = {4: (dist.group.WORLD, rank, [0, 1, 2, 3]),
                   2: (ep2_groups[rank // 2], rank % 2, [2 * (rank // 2), 2 * (rank // 2) + 1])}
    else:  # a 2-GPU machine (benchmarks/bench_ep.sh CHECK_NPROC=2): EP 2 over the world
        layouts = {2: (dist.group.WORLD, rank, [0, 1])}
    cases = []
    for level in range(4):
        for overlap in (False, True):
            cases.append({"path": "nccl", "level": level, "overlap": overlap, "factor": 1.25})
    for overlap in (False, True):
        cases.append({"path": "capacity", "level": 3, "overlap": overlap, "factor": 8.0})   # >= the worst case: no drop
        cases.append({"path": "capacity", "level": 3, "overlap": overlap, "factor": 0.6})   # drops
    cases.append({"path": "capacity", "level": 3, "overlap": True, "factor": 0.6, "backend": "loop"})
    if dispatch_kernels_run():  # the fused capacity path on kernels' Triton gathers (interpreted on a CPU)
        # no drop at factor 4: a peer's buffer holds ceil(4 n k / P) >= n k rows (P <= 4), every row the rank sends;
        # the interpreter's time grows with the buffers' rows, so not 8 (the worst case twice over) here
        for overlap in (False, True):
            for factor in (4.0, 0.6):
                cases.append({"path": "capacity", "level": 3, "overlap": overlap, "factor": factor, "kernels": True})
    for overlap in (False, True):  # symm: no drop, drops, a skewed router (one peer receives nothing) with and without
        cases.append({"path": "symm", "level": 3, "overlap": overlap, "factor": 8.0})
        cases.append({"path": "symm", "level": 3, "overlap": overlap, "factor": 0.6})
        cases.append({"path": "symm", "level": 3, "overlap": overlap, "factor": 8.0, "skew": True})
        cases.append({"path": "symm", "level": 3, "overlap": overlap, "factor": 1.0, "skew": True})
    cases.append({"path": "symm", "level": 0, "overlap": True, "factor": 1.25})  # symm ignores the level: no sync
    # ep_overlap_schedule=pipelined: the exact and the padded nccl path, capacity without and with drops
    for path, level, factor, backend in (("nccl", 0, 1.25, "torch"), ("nccl", 3, 1.25, "torch"),
                                         ("capacity", 3, 8.0, "torch"), ("capacity", 3, 0.6, "torch"),
                                         ("capacity", 3, 0.6, "loop")):
        cases.append({"path": path, "level": level, "overlap": True, "factor": factor, "backend": backend,
                      "schedule": "pipelined"})
    if cuda:
        for path, factor in (("nccl", 1.25), ("capacity", 8.0), ("capacity", 0.6), ("symm", 8.0), ("symm", 0.6)):
            for backend in ("torch", "triton"):
                cases.append({"path": path, "level": 3, "overlap": True, "factor": factor, "backend": backend,
                                  "dtype": torch.bfloat16})
        for factor in (8.0, 0.6):
            cases.append({"path": "capacity", "level": 3, "overlap": True, "factor": factor, "backend": "torch",
                          "dtype": torch.bfloat16, "schedule": "pipelined"})
        cases.append({"path": "symm", "level": 3, "overlap": False, "factor": 1.0, "skew": True, "dtype": torch.bfloat16})
    else:  # the NVSHMEM ops' contract, emulated on gloo
        dispatch.set_symm_ops(EmulatedSymmOps())
    results, failed = {}, 0
    for P, (group, me, ranks) in layouts.items():
        for c in cases:
            mode = ("pipelined" if c.get("schedule") == "pipelined" else "overlap") if c["overlap"] else "serial"
            key = f"ep{P}/{c['path']}/L{c['level']}/{mode}/f{c['factor']}" \
                  f"/{c.get('backend', 'torch')}" + ("/bf16" if c.get("dtype") == torch.bfloat16 else "") \
                  + ("/skew" if c.get("skew") else "") + ("/kernels" if c.get("kernels") else "")
            if any(s and s in key for s in os.environ.get("EP_WORKER_SKIP", "").split(",")):  # e.g. "symm/L3/overlap"
                if rank == 0:
                    print(f"SKIP {key} (EP_WORKER_SKIP)", flush=True)
                continue
            try:
                res = check(kernels_cfg if c.get("kernels") else cfg, group, P, me, ranks, **c)
            except Exception as err:  # noqa: BLE001 - one FAIL line per case; every rank fails alike on a bad op call
                res = {"error": f"{type(err).__name__}: {' '.join(str(err).split())[:400]}"}
            results[key] = res
            failed += _report(key, res, rank, cuda)
    if rank == 0:
        (Path(out_dir) / "results.json").write_text(json.dumps(results, indent=1))
        print(f"{len(results) - failed} of {len(results)} cases PASS on {DEV.type}"
              + (f", {failed} FAIL" if failed else ""), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if failed and cuda:
        sys.exit(1)


def _report(key: str, res: dict, rank: int, cuda: bool) -> int:
    """Print the case's PASS/FAIL line on rank 0 (GPU runs; the CPU test judges the JSON). 1 if it failed."""
    if "error" in res:
        why = res["error"]
    else:
        bad = {k: v for k, v in res["err"].items() if not v < res["tol"]}
        level = key.split("/")[2]
        want_syncs = {"L0": {"permute": 1, "dispatch": 1}, "L1": {"dispatch": 1}, "L2": {"permute": 1}, "L3": {}}[level]
        if "/nccl/" not in key:
            want_syncs = {}
        why = "; ".join([f"{k} err {v:.3g} > tol {res['tol']:g} ({res['where'].get(k, '')})" for k, v in bad.items()]
                        + ([] if res["finite"] else ["non-finite output or gradient"])
                        + ([] if res["dropped"] == res["want_dropped"] else
                           [f"dropped {res['dropped']} rows, the rule drops {res['want_dropped']}"])
                        + ([] if res["syncs"] == want_syncs else [f"host syncs {res['syncs']}, want {want_syncs}"]))
    if cuda and rank == 0:
        worst = "" if "error" in res else f" (max err {max(res['err'].values()):.2g}, dropped {res['dropped']})"
        print(f"{'FAIL' if why else 'PASS'} {key}{worst}{': ' + why if why else ''}", flush=True)
    return int(bool(why))


if __name__ == "__main__":
    main(sys.argv[1])
