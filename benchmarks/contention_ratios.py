"""How much slower a compute kernel runs beside NCCL (or FSDP2's copy-in) than alone, per kernel family.

Issue 35, stop 31's open point: the replay gives every kernel its profiled duration whatever runs beside it,
but a kernel that runs beside an NCCL kernel (or beside FSDP2's all-gather copy-in, `_foreach_copy_` on its
own stream) is slower. This measures it from the raw trace JSON of committed multi-GPU runs, with nothing of
tracelens: per rank, every kernel on a compute stream (one that runs neither NCCL nor the copy-in) gets

* its signature: kernel name, grid, block and the launching op's name and input dims (linked by
  correlation -> the runtime call's `External id` -> the cpu_op);
* the share of its duration that an NCCL kernel on another stream covers (by the collective's kind:
  AllGather, ReduceScatter, AllReduce, SendRecv = all-to-all / p2p), that the copy-in covers, and that any
  other kernel on another stream covers.

A kernel is *alone* when nothing on another stream covers more than 2 % of it; *beside* when NCCL and the
copy-in together cover at least `--min-frac` of it and other compute streams cover under 2 %. A signature's
ratio is each beside kernel's duration over the median of the same signature's alone kernels in the same
trace. Per run and family the table gives the beside kernels' total time over their alone medians' total
(a time-weighted ratio), the number of signatures and kernels matched, the spread of the per-signature
ratios and the matched kernels' time over their alone medians per rank (``excess``: a lower bound of what contention
cost the traced step's device, as only kernels covered at least ``--min-frac`` with an uncovered twin count); `--by-frac` and `--by-kind` split the beside kernels by covered share and by collective kind.

    .venv/bin/python benchmarks/contention_ratios.py [--runs DIR ...] [--by-frac] [--by-kind] [--json OUT]
"""
from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import re
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures"
DEFAULT_RUNS = [
    "h100_4gpu/ep4_L0_loop", "h100_4gpu/ep4_L2_torch", "h100_4gpu/ep4_L3_torch", "h100_4gpu/ep4_cap_ovl",
    "h100_4gpu/pp4_1f1b", "h100_4gpu/pp4_vpp2",
    "h100_4gpu_accum/dp4_mbs8_prof", "h100_4gpu_accum/dp4_mbs8_m3_prof",
    "h100_4gpu_layouts/dp4_mbs16", "h100_4gpu_layouts/ep4_cap_mbs16",
    "h100_4gpu_overlap_fsdp/ep2_cap_mbs8", "h100_4gpu_overlap_fsdp/ep2_cap_eo_mbs8",
    "h100_4gpu_routing/ep4_L0_loop", "h100_4gpu_routing/ep4_L3_torch",
    "h100_scaling/dp2_prof", "h100_scaling/ep2_cap_prof",
    "h200_2gpu_ep/ep2_cap_ovl", "h200_ep2_run/L0_loop", "h200_ep2_run/L3_torch",
    "h200_pp2_run/1f1b", "h200_pp2_run/vpp2", "h200_pp2_run/zb1p",
]
NCCL = re.compile(r"nccl", re.IGNORECASE)
COPY_IN = re.compile(r"multi_tensor_apply_kernel")
FAMILIES = ("grouped GEMM", "dense GEMM", "gather/index", "elementwise", "attention", "reduction", "other")
ALONE_MAX = 0.02


def family(kernel: str, op: str) -> str:
    k = kernel.lower()
    if "grouped" in op or "_grouped_mm" in op or ("cutlass" in k and "group" in k and "prepare" not in k):
        return "grouped GEMM"
    if re.search(r"nvjet|gemm|cublas|cutlass|splitkreduce", k) and "prepare_grouped" not in k:
        return "dense GEMM"
    if re.search(r"flash|fmha|sdpa|attention|dot_do_o|convert_dq", k):
        return "attention"
    if re.search(r"gather|scatter|index|_combine_kernel", k):
        return "gather/index"
    if re.search(r"reduce_kernel|norm|softmax|_ce_chunk|triton_per|triton_red", k):
        return "reduction"
    if re.search(r"elementwise|vectorized|unrolled|triton_poi|multi_tensor_apply|swiglu", k):
        return "elementwise"
    return "other"


def coll_kind(name: str) -> str:
    for kind in ("AllGather", "ReduceScatter", "AllReduce", "SendRecv", "Broadcast"):
        if kind in name:
            return kind
    return "nccl-other"


def _union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(iv):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _covered(s: float, e: float, union: list[tuple[float, float]], starts: list[float]) -> float:
    i = max(bisect.bisect_right(starts, s) - 1, 0)
    tot = 0.0
    while i < len(union) and union[i][0] < e:
        a, b = union[i]
        if b > s:
            tot += min(b, e) - max(a, s)
        i += 1
    return tot


def kernels_of(path: Path) -> list[dict]:
    """One rank's kernels with signature, family, stream role and covered shares (raw JSON only)."""
    raw = path.read_bytes()
    doc = json.loads(gzip.decompress(raw) if path.suffix == ".gz" else raw)
    ev = doc["traceEvents"] if isinstance(doc, dict) else doc
    ops = {}
    ext_of_corr = {}
    kern = []
    for e in ev:
        cat = e.get("cat")
        if e.get("ph") != "X":
            continue
        a = e.get("args") or {}
        if cat == "cpu_op" and "External id" in a:
            ops[a["External id"]] = (e["name"], json.dumps(a.get("Input Dims")))
        elif cat in ("cuda_runtime", "cuda_driver") and "correlation" in a:
            ext_of_corr[a["correlation"]] = a.get("External id")
        elif cat == "kernel":
            kern.append(e)
    by_stream: dict[int, list[dict]] = collections.defaultdict(list)
    for e in kern:
        by_stream[e["args"].get("stream")].append(e)
    role = {}
    for s, ks in by_stream.items():
        if all(NCCL.search(k["name"]) for k in ks):
            role[s] = "nccl"
        elif sum(bool(COPY_IN.search(k["name"])) for k in ks) >= 0.9 * len(ks) and len(ks) < max(map(len, by_stream.values())):
            role[s] = "copy-in"
        else:
            role[s] = "compute"
    iv = collections.defaultdict(list)  # (stream, kind) -> intervals
    for e in kern:
        s = e["args"].get("stream")
        kind = coll_kind(e["name"]) if role[s] == "nccl" else role[s]
        iv[(s, kind)].append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    out = []
    for e in kern:
        s = e["args"].get("stream")
        if role[s] != "compute" or NCCL.search(e["name"]) or float(e["dur"]) <= 0:
            continue
        t0, dur = float(e["ts"]), float(e["dur"])
        rec = {"kernel": e["name"], "dur": dur, "stream": s}
        op, dims = ops.get(ext_of_corr.get(e["args"].get("correlation")), ("", ""))
        rec["sig"] = (e["name"], str(e["args"].get("grid")), str(e["args"].get("block")), op, dims)
        rec["family"] = family(e["name"], op)
        out.append(rec)
        rec["_t"] = (t0, t0 + dur)
    # covered shares, computed per interferer class with unions built once per stream
    classes = {"nccl": lambda kd: kd not in ("compute", "copy-in"), "copy-in": lambda kd: kd == "copy-in",
               "other-compute": lambda kd: kd == "compute"}
    kinds = sorted({kd for (_, kd) in iv if kd not in ("compute", "copy-in")})
    for s in {r["stream"] for r in out}:
        unions = {}
        for name, pred in classes.items():
            unions[name] = _union([x for (st, kd), ivs in iv.items() if st != s and pred(kd) for x in ivs])
        for kd in kinds:
            unions["k:" + kd] = _union([x for (st, k2), ivs in iv.items() if st != s and k2 == kd for x in ivs])
        unions["comm+copy"] = _union(unions["nccl"] + unions["copy-in"])
        starts = {n: [a for a, _ in u] for n, u in unions.items()}
        for r in out:
            if r["stream"] != s:
                continue
            a, b = r["_t"]
            r["cov"] = {n: _covered(a, b, u, starts[n]) / r["dur"] for n, u in unions.items()}
    return out


def trace_files(run: Path) -> list[Path]:
    d = run / "traces" if (run / "traces").is_dir() else run
    return sorted(p for p in d.iterdir() if p.name.endswith((".json", ".json.gz")))


def measure(run: Path, min_frac: float) -> dict:
    """Per family: beside time, alone-median time, kernels, signatures, per-signature ratios, samples."""
    fam = {f: {"beside": 0.0, "alone": 0.0, "n": 0, "sigs": 0, "sig_ratios": [], "samples": []} for f in FAMILIES}
    comm_beside = collections.Counter()
    files = trace_files(run)
    for path in files:
        ks = kernels_of(path)
        alone = collections.defaultdict(list)
        beside = collections.defaultdict(list)
        for r in ks:
            c = r["cov"]
            if c["nccl"] + c["copy-in"] + c["other-compute"] <= ALONE_MAX:
                alone[r["sig"]].append(r["dur"])
            elif c["comm+copy"] >= min_frac and c["other-compute"] <= ALONE_MAX:
                beside[r["sig"]].append(r)
            if c["comm+copy"] > 0:
                comm_beside[r["family"]] += r["dur"] * c["comm+copy"]
        for sig, rs in beside.items():
            if sig not in alone:
                continue
            base = statistics.median(alone[sig])
            f = fam[rs[0]["family"]]
            f["beside"] += sum(r["dur"] for r in rs)
            f["alone"] += base * len(rs)
            f["n"] += len(rs)
            f["sigs"] += 1
            f["sig_ratios"].append(statistics.median(r["dur"] for r in rs) / base)
            for r in rs:
                kinds = {k[2:]: v for k, v in r["cov"].items() if k.startswith("k:") and v > 0}
                if r["cov"]["copy-in"] > 0:
                    kinds["copy-in"] = r["cov"]["copy-in"]
                f["samples"].append({"ratio": r["dur"] / base, "frac": r["cov"]["comm+copy"],
                                     "kind": max(kinds, key=kinds.get), "alone_us": base})
    return {"families": fam, "beside_us": dict(comm_beside), "ranks": len(files)}


def kinds_table(runs: list[str]) -> None:
    """Per (family, collective kind): each run's time-weighted ratio over its kernels that kind covers at least half
    of (the kind covering most of each; runs with 3 or more such kernels), and the median and range over runs."""
    tab: dict = collections.defaultdict(dict)
    for r in runs:
        run = Path(r) if Path(r).is_absolute() else FIX / r
        res = measure(run, 0.5)
        for fam in FAMILIES[:4]:
            s = res["families"][fam]["samples"]
            for kind in ("AllGather", "ReduceScatter", "SendRecv", "AllReduce", "copy-in"):
                x = [v for v in s if v["kind"] == kind]
                if len(x) >= 3:
                    tab[(fam, kind)][r] = (sum(v["ratio"] * v["alone_us"] for v in x) / sum(v["alone_us"] for v in x),
                                           len(x))
    for (fam, kind), d in sorted(tab.items()):
        vals = sorted(v for v, _ in d.values())
        print(f"{fam:13s} beside {kind:13s} runs {len(d):2d} median {statistics.median(vals):.2f} "
              f"range {vals[0]:.2f}-{vals[-1]:.2f}")
        for r, (v, n) in d.items():
            print(f"    {r:40s} {v:.2f} ({n} kernels)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", nargs="*", default=DEFAULT_RUNS, help="run dirs, relative to tests/fixtures or absolute")
    ap.add_argument("--min-frac", type=float, default=0.5)
    ap.add_argument("--by-frac", action="store_true")
    ap.add_argument("--by-kind", action="store_true")
    ap.add_argument("--kinds", action="store_true",
                    help="instead: per family and collective kind, each run's ratio and the spread over runs")
    ap.add_argument("--json", dest="json_out")
    a = ap.parse_args()
    if a.kinds:
        kinds_table(a.runs)
        return
    results = {}
    print(f"{'run':40s} {'family':13s} {'ratio':>6s} {'sigs':>5s} {'n':>5s} {'beside ms':>9s} {'sig ratios p10-p90':>20s}"
          f" {'excess ms/rank':>14s}")
    for r in a.runs:
        run = Path(r) if Path(r).is_absolute() else FIX / r
        res = measure(run, a.min_frac)
        results[r] = res
        for fname in FAMILIES[:4]:
            f = res["families"][fname]
            if not f["n"]:
                print(f"{r:40s} {fname:13s} {'-':>6s}")
                continue
            q = sorted(f["sig_ratios"])
            lo, hi = q[int(0.1 * (len(q) - 1))], q[round(0.9 * (len(q) - 1))]
            print(f"{r:40s} {fname:13s} {f['beside'] / f['alone']:6.2f} {f['sigs']:5d} {f['n']:5d} "
                  f"{f['beside'] / 1e3:9.2f} {lo:9.2f}-{hi:.2f} {(f['beside'] - f['alone']) / 1e3 / res['ranks']:14.2f}")
            if a.by_frac:
                for lo_f, hi_f in ((0.5, 0.75), (0.75, 0.95), (0.95, 1.01)):
                    s = [x for x in f["samples"] if lo_f <= x["frac"] < hi_f]
                    if s:
                        print(f"{'':40s}   frac {lo_f:.2f}-{min(hi_f, 1):.2f}: median {statistics.median(x['ratio'] for x in s):.2f} n {len(s)}")
            if a.by_kind:
                for kind in sorted({x["kind"] for x in f["samples"]}):
                    s = [x for x in f["samples"] if x["kind"] == kind]
                    print(f"{'':40s}   beside {kind:13s}: median {statistics.median(x['ratio'] for x in s):.2f} n {len(s)}")
    if a.json_out:
        for res in results.values():
            for f in res["families"].values():
                f.pop("samples")
        Path(a.json_out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
