"""Trainer efficiency knobs (issue 19), one at a time, from a baseline, on the single-GPU proxy.

    python benchmarks/bench_trainer_knobs.py [--out runs/bench_trainer_knobs] [--steps 12]
                                             [--check-loss] [--diff] [--cpu] [--set key=value ...]
                                             [--nproc N [--only knobs|ep]]

Rows, each adding one knob to the row before (cumulative):

    baseline        gpu_proxy, sync_free_level 3, grouped_gemm_backend torch, micro_batch_size 16
    + optimizer     optimizer=adamw_fused
    + step_timing   step_timing=events
    + compile       compile=dense
    + triton_kernels use_triton_kernels=true (the Triton router, permutation / unpermutation gathers and
                    fused loss of kernels/)
    + expert_swiglu expert_swiglu=triton (the routed experts' silu(gate)*up as one fused Triton kernel
                    each way, kernels/activation.py; benchmarks/bench_swiglu.py times it on its own)
    + micro_batch_24 micro_batch_size=24 (the memory the rows above freed)
    + cuda_graphs   cuda_graphs=on (last: on the H100 it halved tokens/s, see docs/performance.md)

Each row is one ``python -m trainer.launch`` run (a fresh process) of ``--steps`` steps (12; warm-up
steps 0-2 and the profiled step 8 with the export step 9 untimed, so 7 timed steps) writing its own
run dir with one profiled step, so ``tracelens diff ROW_BEFORE ROW`` names what each knob changed
(``--diff`` runs those diffs after the table). The table reads the manifests: tokens/s/GPU, MFU (the
trainer's: model FLOPs per token x tokens/s against the device's bf16 dense peak, moespec/devices.py),
mean step time, peak memory, and each row's loss against the eager baseline's (``judge_loss``).

``--check-loss``: the same rows (but the micro-batch one, which changes the batches) at 50 steps,
unprofiled, for the loss comparison alone (issue 19: compiled / fused / graphed runs match eager within
bf16 tolerance over 50 steps). The baseline runs ``--eager-runs`` times (3): two eager runs of the same
config, seed and batches agree to ~1e-4 for a dozen steps, then drift apart (on the H100 by up to 4.7e-2
at step 50: the bf16 atomics of the permutation's backward flip discrete routing decisions, which
compound), so a per-step bound over 50 steps fails eager against itself. Each row is judged in two parts
(``judge_loss``): its numerics over the steps the eager runs agree on (per-step, within ``--loss-rtol``,
bf16: 1e-2) and its training over the whole run (finite, and the last 10 steps' mean inside the eager
runs' 99 % prediction interval). A last row, the baseline with the learning rate x1.25, is the control:
it must fail, or the check could not tell a change of that size apart (the run then exits 1). Exit 1
when a row fails or is out of tolerance. ``--check-loss --diff``: every row also profiles one step (step 8; the
last two steps of a shorter run), which leaves its loss as it is, and the knob rows' traces are diffed in turn
(the repeated eager runs and the control left out): the loss check and the diffs from one set of runs.

Budget: the table (8 rows) is meant to fit in 9 minutes on one H100 (a 12-step eager row is ~40 s,
compile adds its compilation); ``--budget-s`` (default 540) skips the rows that would start after it,
saying so. Progress goes to stderr as the runs go (the trainer's step lines included).

**Expert-parallel rows** (issue 33; ``--nproc N`` with N > 1, each one ``python -m trainer.launch --nproc N``: N
GPUs, or N gloo processes with ``--cpu``), cumulative from data parallelism over the same N ranks:

    baseline ep=1   gpu_proxy_train (trainer/configs: 16 x 2048 tokens per rank, level 3, the efficiency knobs
                    on) on N ranks, data parallel (FSDP over N); tiny on a CPU
    + ep            ep=N (today's all-to-all: ep_dispatch=nccl, the worst-case buffer at level 3)
    + ep_dispatch   ep_dispatch=capacity (ep_capacity_factor 1.25: static per-peer buffers, rows beyond dropped)
    + ep_overlap    ep_overlap=true (2 chunks: the all-to-alls behind the shared expert and the next chunk)
    + ep_overlap_chunks  ep_overlap_chunks=4
    + ep_overlap_schedule  ep_overlap_schedule=pipelined (the shared expert split over both ends of the chunk chain,
                    where the chunked schedule leaves the first dispatch or the last return trip exposed)

Every layout trains on the same global batch (trainer/data.py), so each EP row's loss is judged against the
``baseline ep=1`` runs (their own eager ensemble, and their own control with ``--check-loss``) exactly as a knob
row is against the single-process baseline; the dropped-row share of the manifest's ``ep_dispatch`` is printed
beside each row (a capacity row that drops enough rows to leave the eager window fails like any other row).
``--only ep`` runs these rows alone (``--only knobs`` the single-process ones alone; default: both with
``--nproc`` > 1); ``--set ep_capacity_factor=1.1`` changes the capacity of every capacity row. Traces are diffed
within a section, never across (the first EP row against the last knob row would compare two batch sizes).
On GPUs, NVLink multicast is left off (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``,
``NVSHMEM_DISABLE_NVLS=1`` unless already set), as benchmarks/bench_ep.sh does.

``--cpu``: the tiny config on the CPU with the knobs that exist there (adamw_fused falls back to the
default AdamW, events to wall-clock timing, compile=dense runs inductor's C++ code); the cuda_graphs row
shows the trainer's one-line refusal, and so do the expert_swiglu row and the rows after it (cumulative:
expert_swiglu=triton is refused on a CPU without Triton's interpreter). About 1-2 minutes on 2 cores: a test of this script, not a
measurement. ``--cpu --nproc 2 --only ep`` runs the EP rows on 2 gloo processes (tiny has 8 experts: N in 2, 4, 8).

``--rows A,B``: run only these knob rows (by name, with or without the ``+ ``: ``--rows ep,ep_overlap_schedule``),
e.g. to measure again the ones a change touched. Rows stay cumulative (a row left out still adds its knobs to
the rows after it, so ``+ ep_overlap_schedule`` is the same run with or without the rows before it); the
baseline (its eager runs) and, with ``--check-loss``, the control always run: they are what a row is judged
against. ``--diff`` then diffs the rows that ran in turn. An unknown name: one line naming the rows, exit 2.

Writes ``OUT/bench_trainer_knobs.json`` and ``.md`` (``check_loss.json`` / ``.md`` with
``--check-loss``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# (row name, the knob this row adds); cumulative
KNOBS = [
    ("baseline", {}),
    ("+ optimizer", {"optimizer": "adamw_fused"}),
    ("+ step_timing", {"step_timing": "events"}),
    ("+ compile", {"compile": "dense"}),
    ("+ triton_kernels", {"use_triton_kernels": True}),
    ("+ expert_swiglu", {"expert_swiglu": "triton"}),
    ("+ micro_batch_24", {"micro_batch_size": 24}),
    ("+ cuda_graphs", {"cuda_graphs": "on"}),
]
GPU_BASE = {"config": "gpu_proxy", "set": {"sync_free_level": 3, "grouped_gemm_backend": "torch",
                                           "micro_batch_size": 16, "timing_warmup_steps": 3}}
CPU_BASE = {"config": "tiny", "set": {"sync_free_level": 3, "grouped_gemm_backend": "torch", "timing_warmup_steps": 3,
                                      "log_every": 4}}

# the expert-parallel rows (--nproc N > 1), cumulative from data parallelism on the same N ranks; "+ ep" sets ep=N
EP_KNOBS = [
    ("baseline ep=1", {"ep": 1}),
    ("+ ep", {"ep": "nproc"}),
    ("+ ep_dispatch", {"ep_dispatch": "capacity"}),
    ("+ ep_overlap", {"ep_overlap": True}),
    ("+ ep_overlap_chunks", {"ep_overlap_chunks": 4}),
    ("+ ep_overlap_schedule", {"ep_overlap_schedule": "pipelined"}),
]
EP_GPU_BASE = {"config": "gpu_proxy_train", "set": {"timing_warmup_steps": 3}}
EP_CPU_BASE = CPU_BASE
# NVLink multicast off for multi-GPU rows (the machines' NVSwitch multicast is not usable: see bench_ep.sh)
MULTI_GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
SECTIONS = ("knobs", "ep")


# --check-loss's last row, from the baseline (not cumulative): the learning rate x1.25, a change the check must
# catch; a run of it that passes means the check is too loose for its purpose
CONTROL = ("control: lr x1.25", 1.25)


def _base_lr(base: dict) -> float:
    if str(REPO) not in sys.path:  # run as a script: sys.path[0] is benchmarks/
        sys.path.insert(0, str(REPO))
    from moespec.config import load_config

    return float(load_config(base["config"], {**base["set"], "device": "cpu"})["lr"])


def _fmt(v, spec: str, none: str = "n/a") -> str:
    return none if v is None else format(v, spec)


def loss_diff(base: list[float], new: list[float]) -> float | None:
    """Largest relative per-step difference of ``new`` from ``base`` over their common steps (None if
    either is empty; inf if a loss is not finite)."""
    n = min(len(base), len(new))
    if n == 0:
        return None
    worst = 0.0
    for a, b in zip(base[:n], new[:n]):
        if not (math.isfinite(a) and math.isfinite(b)):
            return math.inf
        worst = max(worst, abs(b - a) / max(abs(a), 1e-12))
    return worst


LATE_STEPS = 10  # the last steps whose mean loss the ensemble comparison uses
# Student's t, two-sided 99 % (0.995 quantile), by degrees of freedom 1..10; df > 10 uses df 10's (wider
# than the exact value, so never a tighter interval than the sample supports)
T995 = (63.657, 9.925, 5.841, 4.604, 4.032, 3.707, 3.499, 3.355, 3.250, 3.169)


def agreed_steps(eager: list[list[float]], rtol: float) -> int:
    """How many leading steps the eager runs agree on: their relative spread (max - min) / |mean| stays
    within ``rtol / 10`` (all common steps with one run). Past them the runs have drifted apart (bf16
    atomics flip discrete routing decisions, which then compound), so a per-step comparison means nothing."""
    n = min(len(e) for e in eager)
    for i in range(n):
        vals = [e[i] for e in eager]
        if not all(math.isfinite(v) for v in vals):
            return i
        mean = sum(vals) / len(vals)
        if (max(vals) - min(vals)) / max(abs(mean), 1e-12) > rtol / 10:
            return i
    return n


def judge_loss(eager: list[list[float]], new: list[float], rtol: float, late: int = LATE_STEPS,
               window: int | None = None) -> dict:
    """Whether ``new`` trains like the eager runs ``eager`` (same config, same seed, same batches), in two parts:

    * **numerics** (the steps the eager runs agree on, see ``agreed_steps``): the largest per-step relative
      difference from the eager runs' mean is within ``rtol`` (bf16: 1e-2);
    * **training** (the whole run): every loss is finite and the mean of the last ``late`` steps lies in the
      99 % prediction interval of one more eager run, ``t(n-1) x sd x sqrt(1 + 1/n)`` around the n eager
      runs' mean of theirs (sd: the spread of those means), or within ``rtol x mean`` when that is wider
      (``rtol x mean`` alone with one run). Past the agreed steps the runs drift apart, so this part only
      catches a run that trains differently by more than eager's own drift (a divergence, a blow-up).

    ``window``: the number of agreed steps when the caller knows it from more eager runs than ``eager`` holds
    (judging one eager run against the others: two runs can track each other past the point where a third
    has already drifted, so the window comes from all of them). Returns the figures and ``ok``. An empty
    ``eager`` or ``new`` gives ``ok`` False."""
    out = {"ok": False}
    if not eager or not new or any(not e for e in eager):
        return out
    n = min(min(len(e) for e in eager), len(new))
    eager = [e[:n] for e in eager]
    new = new[:n]
    finite = all(math.isfinite(v) for v in new) and all(math.isfinite(v) for e in eager for v in e)
    k = max(min(window if window is not None else agreed_steps(eager, rtol), n), 1)
    mean = [sum(e[i] for e in eager) / len(eager) for i in range(n)]
    early = loss_diff(mean[:k], new[:k])
    w = min(late, n)
    means = [sum(e[-w:]) / w for e in eager]
    m_eager = sum(means) / len(means)
    r = len(means)
    sd = math.sqrt(sum((x - m_eager) ** 2 for x in means) / (r - 1)) if r > 1 else 0.0
    spread = T995[min(r - 1, len(T995)) - 1] * sd * math.sqrt(1 + 1 / r) if r > 1 else 0.0
    bound = max(spread, rtol * abs(m_eager))
    m_new = sum(new[-w:]) / w
    out.update(agreed_steps=k, early_rel_diff=early, early_ok=early is not None and early <= rtol,
               late_steps=w, late_mean=m_new, eager_late_mean=m_eager, late_bound=bound,
               late_ok=finite and abs(m_new - m_eager) <= bound, finite=finite)
    out["ok"] = bool(out["early_ok"] and out["late_ok"])
    return out


def judge_rows(rows: list[dict], rtol: float) -> None:
    """Judge every row with a loss against the eager runs of its section (the rows named ``baseline...``; a row
    without a ``section`` is in ``knobs``), in place: ``loss_check`` (``judge_loss``'s figures), ``loss_rel_diff``
    and ``loss_ok``. The agreed steps come from all of the section's eager runs; an eager run is judged against
    the others (with one eager run it is not judged)."""
    for sec in dict.fromkeys(r.get("section", "knobs") for r in rows):
        _judge_section([r for r in rows if r.get("section", "knobs") == sec], rtol)


def _judge_section(rows: list[dict], rtol: float) -> None:
    eager = [r["loss"] for r in rows if r["name"].startswith("baseline") and r.get("loss")]
    window = agreed_steps(eager, rtol) if eager else None  # from every eager run
    for r in rows:
        if "loss" not in r or not eager:
            continue
        if r["name"].startswith("baseline"):  # an eager run against the other eager runs (with two or more)
            others = [e for e in eager if e is not r["loss"]]
            if not others:
                continue
            r["loss_check"] = judge_loss(others, r["loss"], rtol, window=window)
        else:
            r["loss_check"] = judge_loss(eager, r["loss"], rtol, window=window)
        r["loss_rel_diff"] = r["loss_check"].get("early_rel_diff")
        r["loss_ok"] = r["loss_check"]["ok"]


def run_dir_name(i: int, name: str) -> str:
    """``3_compile``, ``9_baseline_ep-1_run_2``: the row's index and name, file-name safe."""
    return f"{i}_" + re.sub(r"[^A-Za-z0-9_.-]+", "_", name.replace("+ ", "").replace("=", "-")).strip("_")


def run_row(i: int, n: int, name: str, over: dict, args, base: dict, out: Path, steps: int, profile: bool,
            nproc: int = 1) -> dict:
    run = out / run_dir_name(i, name)
    sets = {**base["set"], "steps": steps, **over}
    if profile:  # step 8 (9 exports the trace); the last two steps of a shorter run
        start = min(8, max(steps - 2, 0))
        sets.update(profile_step_start=start, profile_step_end=start + 1)
    else:
        sets.update(profile_step_start=0, profile_step_end=0)
    cmd = [sys.executable, "-m", "trainer.launch", "--config", base["config"], "--nproc", str(nproc), "-o", str(run)]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={json.dumps(v) if not isinstance(v, str) else v}"]
    for o in args.overrides:
        cmd += ["--set", o]
    print(f"[bench] {i + 1}/{n} {name}: {' '.join(f'{k}={v}' for k, v in over.items()) or 'baseline'} "
          f"({steps} steps) ...", file=sys.stderr, flush=True)
    t0 = time.time()
    tail: list[str] = []
    try:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if nproc > 1 and not args.cpu:
            env = {**MULTI_GPU_ENV, **env}
        p = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        deadline = t0 + args.timeout
        for line in p.stdout:  # progress: the trainer's own lines, as they come
            line = line.rstrip()
            tail = (tail + [line])[-20:]
            if line.startswith(("[trainer] step", "[trainer] wrote", "[trainer] note", "config error", "[trainer] error",
                                "[launch]")):
                print(f"[bench]    {line[:200]}", file=sys.stderr, flush=True)
            if time.time() > deadline:
                p.kill()
                break
        rc = p.wait()
        if time.time() > deadline:
            rc = "timeout"
    except OSError as e:
        rc, tail = "error", [str(e)]
    row = {"name": name, "adds": over, "overrides": sets, "nproc": nproc, "rc": rc,
           "wall_s": round(time.time() - t0, 1), "run_dir": str(run)}
    man = run / "manifest.json"
    doc = json.loads(man.read_text()) if rc == 0 and man.exists() else None
    if doc and doc.get("status") == "complete":
        m = doc["metrics"]
        row.update(tokens_per_s_per_gpu=m["tokens_per_s_per_gpu"], mfu=m["mfu"],
                   step_ms=m["mean_step_time_s"] * 1e3 if m["mean_step_time_s"] else None,
                   step_timing=m.get("step_timing"), timed_steps=m["timed_steps"],
                   peak_gib=max(m["peak_memory_bytes"]) / 2**30, loss=m["loss"], notes=doc.get("notes", []),
                   device=doc["device"]["name"], ep_dispatch=doc.get("ep_dispatch"))
    else:
        errs = [ln for ln in tail if ln.startswith(("config error", "[trainer] error", "[launch]"))]
        row["error"] = (errs or tail or [str(rc)])[-1][:300]
    mfu = "n/a" if row.get("mfu") is None else f"{100 * row['mfu']:.1f} %"
    done = (f"{_fmt(row.get('tokens_per_s_per_gpu'), ',.0f')} tokens/s/GPU, MFU {mfu}"
            + (f", {dropped_text(row['ep_dispatch'])}" if row.get("ep_dispatch") else "") if "loss" in row
            else f"{'refused' if rc == 2 else 'failed'}: {row['error']}")
    print(f"[bench] {i + 1}/{n} {name}: {done} ({row['wall_s']:.0f} s)", file=sys.stderr, flush=True)
    return row


def dropped_text(rec: dict | None) -> str:
    """The manifest's ``ep_dispatch`` in a few words: the path, and for the capacity path the share of the routed
    rows it dropped, over every rank and step ("—" without EP)."""
    if not rec:
        return "—"
    if rec.get("path") != "capacity":  # exact or worst-case buffers: every routed row travels
        return f"{rec.get('path')}: none dropped"
    share = rec.get("dropped_share") or 0.0
    return (f"capacity {rec.get('capacity_factor')}: {100 * share:.2f} % dropped "
            f"({rec.get('dropped_rows', 0):,} of {rec.get('routed_rows', 0):,} rows)")


def table(rows: list[dict], rtol: float, title: str, ep: bool = False) -> str:
    """The markdown table of one section; ``ep``: with the dropped-rows column (the manifest's ``ep_dispatch``)."""
    head = "| row | adds | tokens/s/GPU | MFU | step ms | vs previous | peak GiB |"
    rule = "|---|---|---:|---:|---:|---:|---:|"
    if ep:
        head, rule = head + " EP dispatch: dropped rows |", rule + "---|"
    lines = [title, "", head + " loss vs eager: numerics; training | run |", rule + "---:|---|"]
    prev = None
    for r in rows:
        adds = ", ".join(f"`{k}={v}`" for k, v in r["adds"].items()) or "—"
        if "loss" not in r:
            what = "skipped" if r.get("skipped") else ("refused (exit 2)" if r.get("rc") == 2 else f"failed (rc={r.get('rc')})")
            lines.append(f"| {r['name']} | {adds} | {what}: "
                         f"{r.get('error', '').replace('|', '/')} | | | | |{' |' if ep else ''} | `{r.get('run_dir', '')}` |")
            continue
        tps = r["tokens_per_s_per_gpu"]
        gain = (f"{100 * (tps / prev - 1):+.1f} %" if prev and tps else "")
        c = r.get("loss_check")
        if c is None:
            dtxt = "—"
        elif "early_rel_diff" not in c:
            dtxt = "n/a (no loss to compare)"
        else:
            dtxt = (f"first {c['agreed_steps']} steps {c['early_rel_diff']:.2e} "
                    f"({'ok' if c['early_ok'] else 'OUT'}); last {c['late_steps']} mean {c['late_mean']:.3f} vs "
                    f"{c['eager_late_mean']:.3f} +/- {c['late_bound']:.3f} ({'ok' if c['late_ok'] else 'OUT'})"
                    + ("" if c["finite"] else ", non-finite loss"))
        drop = f" {dropped_text(r.get('ep_dispatch'))} |" if ep else ""
        lines.append(f"| {r['name']} | {adds} | {_fmt(tps, ',.0f')} | {_fmt(r['mfu'] and 100 * r['mfu'], '.1f')}"
                     f"{'' if r['mfu'] is None else ' %'} | {_fmt(r['step_ms'], '.1f')} | {gain} | "
                     f"{r['peak_gib']:.2f} |{drop} {dtxt} | `{r['run_dir']}` |")
        prev = tps or prev
    lines += ["", f"Loss vs eager (`judge_loss`): numerics = the largest per-step |loss - eager mean| / eager mean "
              f"over the first steps, those the eager runs agree on within {rtol / 10:g}, <= {rtol:g}; training = "
              "every loss finite and the last steps' mean inside the eager runs' 99 % prediction interval (or "
              f"{rtol:g} of it, when wider). An eager run is judged against the other eager runs."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="output dir (default runs/bench_trainer_knobs[_cpu])")
    p.add_argument("--steps", type=int, default=None, help="steps per row (12; 50 with --check-loss)")
    p.add_argument("--check-loss", action="store_true", help="50 unprofiled steps per row: the loss comparison")
    p.add_argument("--diff", action="store_true",
                   help="run `tracelens diff` between consecutive rows afterwards (with --check-loss: profile a step "
                        "of each row too)")
    p.add_argument("--cpu", action="store_true", help="tiny config on the CPU (tests this script)")
    p.add_argument("--nproc", type=int, default=1,
                   help="ranks of the expert-parallel rows (EP = N; N > 1 adds them: N GPUs, or gloo with --cpu)")
    p.add_argument("--only", choices=SECTIONS, default=None,
                   help="run one section: the single-process knob rows or the EP rows (default: both with --nproc > 1)")
    p.add_argument("--loss-rtol", type=float, default=1e-2, help="relative loss tolerance vs the baseline (bf16)")
    p.add_argument("--eager-runs", type=int, default=3,
                   help="with --check-loss: runs of the eager baseline, the ensemble each row is judged against")
    p.add_argument("--budget-s", type=float, default=540, help="start no row after this many seconds")
    p.add_argument("--timeout", type=int, default=300, help="seconds per row")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="extra trainer overrides for every row")
    p.add_argument("--rows", default=None, metavar="A,B",
                   help="run only these knob rows (names, '+ ' optional; still cumulative); the baseline and the "
                        "control always run")
    args = p.parse_args(argv)
    if args.eager_runs < 1 or (args.check_loss and args.eager_runs < 2):
        p.error("--eager-runs must be at least 1, and at least 2 with --check-loss (one eager run cannot show "
                "where eager runs drift apart)")
    if args.nproc < 1:
        p.error(f"--nproc must be at least 1, got {args.nproc}")
    if args.only == "ep" and args.nproc == 1:
        p.error("--only ep needs --nproc N > 1 (the EP rows run ep=N on N ranks)")
    sections = [args.only] if args.only else (["knobs", "ep"] if args.nproc > 1 else ["knobs"])
    steps = args.steps or (50 if args.check_loss else 12)
    base, ep_base = (CPU_BASE, EP_CPU_BASE) if args.cpu else (GPU_BASE, EP_GPU_BASE)
    if "ep" in sections and (why := ep_world_error(ep_base, args.nproc, args.overrides)):
        p.error(why)
    if args.cpu:
        device = "cpu"
    else:
        try:
            import torch
        except ImportError:
            print("bench_trainer_knobs: torch is not installed; this benchmark needs a CUDA GPU (or --cpu).",
                  file=sys.stderr)
            return 1
        if not torch.cuda.is_available():
            print("bench_trainer_knobs: no CUDA device visible; run with --cpu to test the script on the tiny "
                  "config.", file=sys.stderr)
            return 1
        if "ep" in sections and torch.cuda.device_count() < args.nproc:
            print(f"bench_trainer_knobs: --nproc {args.nproc} needs {args.nproc} GPUs, {torch.cuda.device_count()} "
                  "visible.", file=sys.stderr)
            return 1
        device = torch.cuda.get_device_name(0)
    out = Path(args.out or f"runs/bench_trainer_knobs{'_cpu' if args.cpu else ''}")
    if args.check_loss:
        out = out / "check_loss"
    out.mkdir(parents=True, exist_ok=True)
    plan = [(sec, name, knob) for sec in sections
            for name, knob in section_rows(sec, args.nproc, args.check_loss, args.eager_runs,
                                           base if sec == "knobs" else ep_base)]
    wanted = None
    if args.rows is not None:
        knob_rows = [name for sec, name, _ in plan if not _reference_row(name, plan, sec)]
        wanted = {w.strip().removeprefix("+ ").strip() for w in args.rows.split(",") if w.strip()}
        if unknown := sorted(wanted - {n.removeprefix("+ ") for n in knob_rows}):
            p.error(f"--rows: no row named {', '.join(unknown)} in the rows of {' and '.join(sections)} "
                    f"({', '.join(n.removeprefix('+ ') for n in knob_rows)})")
    rows: list[dict] = []
    acc: dict = {}
    t_start = time.time()
    for i, (sec, name, knob) in enumerate(plan):
        if i == 0 or plan[i - 1][0] != sec:
            acc = {}  # every section starts from its own baseline
        acc = {**acc, **knob} if name != CONTROL[0] else {**knob}
        if wanted is not None and not _reference_row(name, plan, sec) and name.removeprefix("+ ") not in wanted:
            continue  # left out by --rows (its knobs stay in `acc`: the rows after it are the same runs)
        if time.time() - t_start > args.budget_s:
            rows.append({"name": name, "section": sec, "adds": knob, "skipped": True, "rc": None,
                         "error": f"budget of {args.budget_s:.0f} s spent before this row"})
            print(f"[bench] {i + 1}/{len(plan)} {name}: skipped (budget {args.budget_s:.0f} s spent)",
                  file=sys.stderr, flush=True)
            continue
        row = run_row(i, len(plan), name, dict(acc), args, base if sec == "knobs" else ep_base, out, steps,
                      profile=args.diff or not args.check_loss, nproc=1 if sec == "knobs" else args.nproc)
        row.update(adds=knob, section=sec)
        rows.append(row)
    judge_rows(rows, args.loss_rtol)
    kind = "check_loss" if args.check_loss else "bench_trainer_knobs"
    md = ""
    for sec in sections:
        srows = [r for r in rows if r["section"] == sec]
        b = base if sec == "knobs" else ep_base
        what = ("Trainer knobs, one at a time" if sec == "knobs" else
                f"Expert parallelism, one knob at a time ({args.nproc} ranks, EP {args.nproc} from data parallelism)")
        title = (f"## {what} ({'loss check, ' if args.check_loss else ''}config "
                 f"{b['config']} + {', '.join(f'{k}={v}' for k, v in b['set'].items())}, {steps} steps, "
                 f"device {device})")
        md += ("\n" if md else "") + table(srows, args.loss_rtol, title, ep=sec == "ep")
        if args.diff:  # the knob rows in turn: not the repeated eager runs nor the control (--check-loss)
            md += "\n" + diffs([r for r in srows if not _repeat_or_control(r["name"])], out)
        else:
            done = [r for r in srows if "loss" in r]
            md += "\nWhat each knob changed: " + "; ".join(
                f"`tracelens diff {a['run_dir']} {b['run_dir']}`" for a, b in zip(done, done[1:])) + "\n"
    doc = {"device": device, "config": base["config"] if "knobs" in sections else ep_base["config"],
           "base_overrides": base["set"], "sections": sections, "nproc": args.nproc,
           "ep_config": ep_base["config"] if "ep" in sections else None,
           "ep_base_overrides": ep_base["set"] if "ep" in sections else None, "steps": steps,
           "loss_rtol": args.loss_rtol, "wall_s": round(time.time() - t_start, 1), "rows": rows}
    (out / f"{kind}.json").write_text(json.dumps(doc, indent=1, default=str))
    (out / f"{kind}.md").write_text(md)
    print(md)
    print(f"[bench] wrote {out / (kind + '.json')} and {kind}.md ({doc['wall_s']:.0f} s)", file=sys.stderr)
    return 0 if verdict(rows, args.cpu) else 1


def section_rows(section: str, nproc: int, check_loss: bool, eager_runs: int, base: dict) -> list[tuple[str, dict]]:
    """The rows of one section, in order: (name, the knobs the row adds). With ``check_loss``: the baseline
    ``eager_runs`` times (the runs' own drift is what a row is judged against: bf16 atomics, routing), no
    micro-batch row (it changes the data, not the numerics), and a last control that must fail (the learning
    rate x1.25, from the baseline), or the check could not tell a change of that size apart."""
    if section == "knobs":
        rows = [(n, k) for n, k in KNOBS if not (check_loss and "micro_batch_size" in k)]
    else:
        rows = [(n, {key: nproc if v == "nproc" else v for key, v in k.items()}) for n, k in EP_KNOBS]
    if check_loss:
        first = rows[0][0]
        rows[1:1] = [(f"{first} (run {r})", dict(rows[0][1])) for r in range(2, eager_runs + 1)]
        rows.append((CONTROL[0], {**rows[0][1], "lr": _base_lr(base) * CONTROL[1]}))
    return rows


def ep_world_error(base: dict, nproc: int, overrides: list[str]) -> str | None:
    """Why the EP rows cannot run on ``nproc`` ranks (the trainer's own one line), or None."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from moespec.config import ConfigError, load_config, resolve_world
    from moespec.yaml_bounded import safe_load

    sets = {**base["set"], "device": "cpu"}
    for o in overrides:
        k, _, v = o.partition("=")
        try:
            sets[k] = safe_load(v)
        except Exception:  # noqa: BLE001 - the trainer's own --set parsing reports it when the row runs
            sets[k] = v
    try:
        for over in ({"ep": 1}, {"ep": nproc, "ep_dispatch": "capacity", "ep_overlap": True, "ep_overlap_chunks": 4,
                                   "ep_overlap_schedule": "pipelined"}):
            resolve_world(load_config(base["config"], {**sets, **over}), nproc)
    except ConfigError as e:
        return f"--nproc {nproc}: the EP rows (ep={nproc} on {base['config']}) cannot run: {e}"
    return None


def verdict(rows: list[dict], cpu: bool) -> bool:
    """Every row ran (on a CPU the expert_swiglu row is refused, exit 2, one line: no Triton there; so are the
    knob rows after it, which carry it), every row but the controls within the loss check, and every control
    out of it (a control that passes means the check cannot tell a change of that size from eager's drift)."""
    refusable = ("+ expert_swiglu", "+ micro_batch_24", "+ cuda_graphs") if cpu else ()
    ok = all(r.get("rc") == 0 or (r.get("section", "knobs") == "knobs" and r["name"] in refusable and r.get("rc") == 2)
             for r in rows if not r.get("skipped"))
    ok = ok and all(r.get("loss_ok", True) for r in rows if r["name"] != CONTROL[0])
    for control in (r for r in rows if r["name"] == CONTROL[0]):
        if control.get("loss_ok"):
            print(f"[bench] the control ({CONTROL[0]}, {control.get('section', 'knobs')} rows) passed the loss check: "
                  "it cannot tell a change of that size apart from eager's own drift", file=sys.stderr)
            ok = False
    return ok


def _reference_row(name: str, plan: list, sec: str) -> bool:
    """The section's baseline (its first row and the repeated eager runs) or the control: what the knob rows are
    judged against, run whatever ``--rows`` selects."""
    first = next(n for s_, n, _ in plan if s_ == sec)
    return name == first or _repeat_or_control(name)


def _repeat_or_control(name: str) -> bool:
    """A row that adds no knob to the row before: a repeated eager run (``baseline (run 2)``) or the control."""
    return name == CONTROL[0] or re.search(r" \(run \d+\)$", name) is not None


def diffs(rows: list[dict], out: Path) -> str:
    """``tracelens diff`` between consecutive completed rows; the headline lines of each."""
    done = [r for r in rows if "loss" in r]
    text = []
    for a, b in zip(done, done[1:]):
        d = out / f"diff_{Path(a['run_dir']).name}__{Path(b['run_dir']).name}"
        print(f"[bench] tracelens diff {a['name']} -> {b['name']} ...", file=sys.stderr, flush=True)
        r = subprocess.run([sys.executable, "-m", "tracelens", "diff", a["run_dir"], b["run_dir"], "-o", str(d), "-q"],
                           cwd=REPO, capture_output=True, text=True)
        text.append(f"### {a['name']} -> {b['name']}: `tracelens diff {a['run_dir']} {b['run_dir']}` "
                    f"({'see ' + str(d / 'diff.md') if r.returncode == 0 else 'failed: ' + (r.stderr.strip().splitlines() or ['?'])[-1]})")
    return "\n".join(text) + "\n"


if __name__ == "__main__":
    sys.exit(main())
