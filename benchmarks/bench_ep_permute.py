"""The capacity path's own row moves, unfused vs fused (``ep_capacity_fused``), on one GPU at the real shapes.

    python benchmarks/bench_ep_permute.py [--tokens 32768] [--top-k 6] [--experts 64] [--ep 4] [--d-model 2048]
                                          [--factor 1.25] [--skew 1.0] [--iters 20] [--json FILE] [--cpu]

What one rank of ``gpu_proxy_train`` (EP 4, capacity 1.25) does to its rows around the two all-to-alls, per MoE
layer, forward and backward, with the all-to-alls and the experts taken out (the returned buffer is the sent one,
so both paths move exactly what they move in training):

* **unfused** (``ep_capacity_fused: false``): ``kernels.permute`` gathers the rows into expert order, the send
  buffer is ``new_zeros(...).index_copy(slot, x_perm)`` (a fill, the out-of-place op's clone, a scatter), the
  returned rows are gathered back into expert order (``move_rows``), masked by ``torch.where`` for the dropped
  rows and combined by ``kernels.unpermute``;
* **fused** (the default): ``kernels.permutation.route_indices`` (the order only), the send buffer in one gather
  from the tokens (``kernels.gather_rows``), the returned buffer combined into the tokens in one gather-reduce
  (``Dispatcher.combine_tokens``).

Both compute the capacity rule's layout with the trainer's own ``Dispatcher._capacity_layout`` (device ops, no
sync). The router is skewed (``--skew``: expert ``e``'s logit gets ``skew * e / E``) so that the capacity drops
rows as in training. Prints the median ms of forward and forward + backward per path and the ratio, checks that
both give the same output and gradients (bit-equal) and the same drops, and with ``--json`` writes the figures.
Needs a CUDA GPU with Triton (one line, exit 2, otherwise); ``--cpu`` runs the same on the CPU under Triton's
interpreter (for the tests: give small shapes; host timings, meaningless as speed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--ep", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--factor", type=float, default=1.25)
    ap.add_argument("--skew", type=float, default=1.0)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--cpu", action="store_true", help="the CPU under Triton's interpreter (tests)")
    a = ap.parse_args(argv)
    if a.cpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    import torch

    if not a.cpu and not torch.cuda.is_available():
        print("bench_ep_permute: needs a CUDA GPU (none is visible here)", file=sys.stderr)
        return 2
    import kernels

    dev = torch.device("cpu" if a.cpu else "cuda")
    if not kernels.triton_ok(torch.empty(0, device=dev)):
        print(f"bench_ep_permute: needs triton's kernels on {dev.type} (not importable, or kernels was imported "
              "without TRITON_INTERPRET=1 on a CPU)", file=sys.stderr)
        return 2
    if a.experts % a.ep or a.top_k > a.experts:
        print(f"bench_ep_permute: --ep {a.ep} must divide --experts {a.experts}, and --top-k <= --experts",
              file=sys.stderr)
        return 2
    from kernels import gather_rows, permute, unpermute
    from kernels.permutation import route_indices
    from trainer.model.dispatch import Dispatcher, Routed, Trip, move_rows

    T, k, E, P, D = a.tokens, a.top_k, a.experts, a.ep, a.d_model
    g = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(T, E, device=dev, generator=g) + a.skew * torch.arange(E, device=dev) / E
    w, topk_idx = logits.softmax(-1).topk(k, dim=-1)
    x0 = torch.randn(T, D, device=dev, dtype=torch.bfloat16, generator=g)
    gy = torch.randn(T, D, device=dev, dtype=torch.bfloat16, generator=g)
    flat = topk_idx.reshape(-1)

    def unfused(x, wt):
        disp = Dispatcher(path="capacity", level=3, k=k, P=P, El=E // P, group=None, capacity_factor=a.factor,
                          fused=False)
        perm = permute(x, topk_idx, E)
        order = perm.sorted_pos.long()
        t = Trip(Routed(perm.x_perm, perm.counts.long(), order, flat.index_select(0, order), flat, T))
        disp._capacity_layout(t)
        rows = P * t.cap
        buf = perm.x_perm.new_zeros(rows + 1, D).index_copy(0, t.slot, perm.x_perm)[:rows]
        y = move_rows(buf, t.slot.clamp(max=rows - 1), bwd_idx=t.slot)     # the returned buffer: the sent one
        y = torch.where(t.keep.unsqueeze(1), y, y.new_zeros(()))
        return unpermute(y, perm, wt), disp

    def fused(x, wt):
        disp = Dispatcher(path="capacity", level=3, k=k, P=P, El=E // P, group=None, capacity_factor=a.factor)
        sorted_pos, _, counts, _ = route_indices(topk_idx, E)
        order = sorted_pos.long()
        t = Trip(Routed(None, counts.long(), order, flat.index_select(0, order), flat, T, x=x, kernels=True))
        disp._capacity_layout(t)
        buf = gather_rows(x, t.send_src, t.send_row, k)
        return disp.combine_tokens(t, buf, wt), disp

    def once(fn, backward):
        x, wt = x0.clone().requires_grad_(backward), w.clone().requires_grad_(backward)
        y, disp = fn(x, wt)
        if backward:
            y.backward(gy)
        return y, x, wt, disp

    def timed(fn, backward):
        for _ in range(3):
            once(fn, backward)
        ms = []
        for _ in range(a.iters):
            if a.cpu:
                t0 = time.perf_counter()
                once(fn, backward)
                ms.append((time.perf_counter() - t0) * 1e3)
                continue
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            once(fn, backward)
            e.record()
            torch.cuda.synchronize()
            ms.append(s.elapsed_time(e))
        return statistics.median(ms)

    res = {"shape": {"tokens": T, "top_k": k, "experts": E, "ep": P, "d_model": D, "factor": a.factor,
                     "dtype": "bf16", "device": "cpu (interpreter)" if a.cpu else torch.cuda.get_device_name()}}
    (yu, xu, wu, du), (yf, xf, wf, df) = once(unfused, True), once(fused, True)
    res["check"] = {"y_equal": bool(torch.equal(yu, yf)), "x_grad_equal": bool(torch.equal(xu.grad, xf.grad)),
                    "w_grad_max_diff": float((wu.grad - wf.grad).abs().max()),
                    "dropped": int(du.dropped), "dropped_fused": int(df.dropped), "routed_rows": T * k}
    for name, bwd in (("forward", False), ("forward+backward", True)):
        old, new = timed(unfused, bwd), timed(fused, bwd)
        res[name] = {"unfused_ms": round(old, 3), "fused_ms": round(new, 3), "speedup": round(old / new, 2)}
    c = res["check"]
    print(f"capacity path row moves, one MoE layer on one rank: {T} tokens x top-{k}, {E} experts, EP {P} "
          f"({E // P} local), capacity {a.factor}, d_model {D}, bf16, {res['shape']['device']}")
    print(f"dropped rows {c['dropped']} of {T * k} ({100 * c['dropped'] / (T * k):.2f} %), fused {c['dropped_fused']}; "
          f"output equal {c['y_equal']}, x grad equal {c['x_grad_equal']}, weight grad max diff "
          f"{c['w_grad_max_diff']:.3g}")
    for name in ("forward", "forward+backward"):
        r = res[name]
        print(f"{name:17s} unfused {r['unfused_ms']:7.3f} ms   fused {r['fused_ms']:7.3f} ms   {r['speedup']:.2f}x")
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    ok = c["y_equal"] and c["x_grad_equal"] and c["dropped"] == c["dropped_fused"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
