"""The gradient clipping's kernels per step (trainer/train.py's clip_grad_norm), from raw trace JSON only.

Kernels whose launch lies between the end of the last ``FSDP::root_post_backward_callback`` and the start of
``Optimizer.step`` on the CPU, by their launching op: device ms and the op's first input's elements (the local
gradient). Stop 31 (helper/s31shard): 17.1 ms on gpu1_prof (2,255 M elements), 8.7-8.8 on dp2_prof / ep2_cap_prof
(1,127 M), 4.5-4.8 on the dp 4 runs (564 M): sharded by dp, like the optimizer.

    python benchmarks/grad_clip_raw.py tests/fixtures/h100_scaling/gpu1_prof/traces/rank0.json.gz ...
"""
import json, gzip, sys, collections, glob, math
def load(f):
    return json.load(gzip.open(f))["traceEvents"]
def numel(d):
    if not d: return 0
    if isinstance(d[0], list): return sum(numel(x) for x in d)
    return math.prod(d)
def analyse(f):
    ev = load(f)
    ua = [e for e in ev if e.get("cat") == "user_annotation"]
    cb = [e for e in ua if e["name"].startswith("FSDP::root_post_backward_callback")]
    opt = [e for e in ua if e["name"].startswith("Optimizer.step")][0]
    zg = [e for e in ua if e["name"].startswith("Optimizer.zero_grad")][0]
    t0 = max(e["ts"] + e["dur"] for e in cb)  # the last micro-batch's
    t1 = opt["ts"]
    rt = {e["args"]["correlation"]: e for e in ev if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    ops = [e for e in ev if e.get("cat") == "cpu_op"]
    # innermost cpu op containing each runtime launch on the same tid
    by_tid = collections.defaultdict(list)
    for o in ops: by_tid[o["tid"]].append(o)
    def owner(r):
        best = None
        for o in by_tid[r["tid"]]:
            if o["ts"] <= r["ts"] <= o["ts"] + o["dur"] and (best is None or o["dur"] < best["dur"]): best = o
        return best
    out = collections.defaultdict(lambda: [0, 0.0, 0])  # op -> n, us, numel
    optk = collections.defaultdict(float)
    for k in ev:
        if k.get("cat") != "kernel": continue
        r = rt.get(k["args"].get("correlation"))
        if r is None: continue
        if t0 <= r["ts"] < t1:
            o = owner(r); name = o["name"] if o else "?"
            dims = (o or {}).get("args", {}).get("Input Dims", [[]])
            ne = numel(dims[0]) if dims else 0
            v = out[name]; v[0] += 1; v[1] += k["dur"]; v[2] += ne
        elif opt["ts"] <= r["ts"] <= zg["ts"] + zg["dur"]:
            optk["step" if r["ts"] < opt["ts"] + opt["dur"] else "zero_grad"] += k["dur"]
    return out, optk
for f in sys.argv[1:]:
    out, optk = analyse(f)
    tot = sum(v[1] for v in out.values())
    print(f"{f}: clip window kernels {tot/1e3:.2f} ms; optimizer {optk['step']/1e3:.2f} ms, zero_grad {optk['zero_grad']/1e3:.2f}")
    for k, v in sorted(out.items(), key=lambda x: -x[1][1])[:8]:
        print(f"   {k:28s} n={v[0]:4d} {v[1]/1e3:7.3f} ms  numel {v[2]/1e6:8.2f} M")
