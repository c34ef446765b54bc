#!/usr/bin/env bash
# Expert parallelism against data parallelism on the GPU proxy in its training regime (gpu_proxy_train:
# 16 x 2048 = 32,768 tokens per rank and step, sync-free level 3, torch grouped GEMM), issue 33. Every row is
# a real NCCL run through trainer.launch; the summary (tokens/s/GPU, MFU, peak memory per rank, dropped rows,
# losses) goes to $OUT/bench_ep.json and .md, the run logs and each profiled row's `tracelens comm` next to it.
#
#   on a 4-GPU machine, from the checkout (carry: [".whl"]):
#     bash benchmarks/bench_ep.sh                         # the 4-GPU rows
#     ROWS="check dp4 ep4_cap" bash benchmarks/bench_ep.sh
#   check:  the dispatch paths' numerics on NCCL and NVSHMEM (tests/trainer/_ep_dispatch_worker.py on the GPUs, fp32 +
#           bf16, symm included): one PASS/FAIL line per case, the count at the end, exit 1 if any case failed
#     ROWS=check bash benchmarks/bench_ep.sh          # 4 GPUs; the lines in $OUT/check.log
#     CHECK_NPROC=2 ROWS=check bash benchmarks/bench_ep.sh   # a 2-GPU machine: EP 2 over the world only
#   1-/2-GPU rows (the scaling table): gpu1, dp2, ep2_*; NPROC is taken from the row's name.
#   expert placement by load (ep_placement: balanced): ep4_loads first (a short profiled run: its routing.json
#   holds the loads), then the *_place rows, which read $WORK/ep4_loads/routing.json; the same rows without
#   placement (ep4_cap, ep4_cap_ovl, ep4_nccl) are the comparison:
#     ROWS="ep4_loads ep4_cap ep4_cap_place ep4_cap_ovl ep4_cap_ovl_place ep4_nccl ep4_nccl_place ep4_cap_place_prof" \
#       bash benchmarks/bench_ep.sh
#   the overlap schedules (ep_overlap_schedule: chunked, pipelined), 2 and 4 chunks, each profiled (step 8): the
#   tokens/s of each and, from its trace, `tracelens comm`'s "exposed all-to-all" line (issue 33: <= 25 % of the
#   all-to-all kernel time on every rank) printed after the row:
#     ROWS="check dp4 ep4_cap_ovl ep4_cap_pipe_prof ep4_cap_ovl4_prof ep4_cap_pipe4_prof" bash benchmarks/bench_ep.sh
#   the capacity path fused (the default) against unfused (ep_capacity_fused=false), one call:
#     ROWS="dp4 ep4_cap ep4_cap_ovl ep4_cap_unfused ep4_cap_ovl_unfused" bash benchmarks/bench_ep.sh
set -u
source "$(dirname "$0")/gpu_env.sh"
OUTDIR=${OUT:-/tmp/tracelens-bench-ep}
WORK=${WORK:-/tmp/tracelens-bench-ep-runs}
mkdir -p "$OUTDIR" "$WORK"
STEPS="--set steps=10 --set timing_warmup_steps=3 --set log_every=5 --set profile_step_end=0"
PROF="--set steps=10 --set timing_warmup_steps=3 --set log_every=5 --set profile_step_start=8 --set profile_step_end=9"
CAP="--set ep_dispatch=capacity --set ep_capacity_factor=${CAPF:-1.25}"
LONG="--set steps=30 --set timing_warmup_steps=18 --set log_every=10 --set profile_step_end=0"
BAL="--set router_bias_update_rate=0.001 $LONG"
SYMM="--set ep_dispatch=symm --set ep_capacity_factor=${CAPF:-1.25}"
PLACE="--set ep_placement=balanced --set ep_placement_loads=$WORK/ep4_loads/routing.json"
declare -A RUNS=(
  [gpu1]="1 $STEPS"
  # profiled 1- and 2-GPU rows: the scale-out projection's inputs (issue 35: 1 and 2 GPUs -> 4)
  [gpu1_prof]="1 $PROF"
  [dp2_prof]="2 $PROF"
  [ep2_cap_prof]="2 --set ep=2 $CAP $PROF"
  [dp2]="2 $STEPS"
  [dp4]="4 $STEPS"
  [ep2_nccl]="2 --set ep=2 $STEPS"
  [ep2_cap]="2 --set ep=2 $CAP $STEPS"
  [ep2_cap_ovl]="2 --set ep=2 $CAP --set ep_overlap=true $STEPS"
  # the 2-GPU counterparts of the 4-GPU rows below (where only 2-GPU machines are lent)
  [ep2_cap_unfused]="2 --set ep=2 $CAP --set ep_capacity_fused=false $STEPS"
  [ep2_cap_pipe]="2 --set ep=2 $CAP --set ep_overlap=true --set ep_overlap_schedule=pipelined $STEPS"
  [ep2_cap_ovl_prof]="2 --set ep=2 $CAP --set ep_overlap=true $PROF"
  [ep2_cap_pipe_prof]="2 --set ep=2 $CAP --set ep_overlap=true --set ep_overlap_schedule=pipelined $PROF"
  [ep4_nccl]="4 --set ep=4 $STEPS"
  [ep4_nccl_L1_ovl]="4 --set ep=4 --sync-free-level 1 --set ep_overlap=true $STEPS"
  [ep4_cap]="4 --set ep=4 $CAP $PROF"
  [ep4_cap_ovl]="4 --set ep=4 $CAP --set ep_overlap=true $PROF"
  # the capacity path's row moves unfused (ep_capacity_fused=false): the comparison for the fused default
  [ep4_cap_unfused]="4 --set ep=4 $CAP --set ep_capacity_fused=false $PROF"
  [ep4_cap_ovl_unfused]="4 --set ep=4 $CAP --set ep_capacity_fused=false --set ep_overlap=true $PROF"
  [ep4_symm]="4 --set ep=4 $SYMM $PROF"
  # (no symm row with ep_overlap: the trainer refuses it, the chunked NVSHMEM exchange hung on 4 x H100; none at
  # ep 2: the NVSHMEM op takes at most 16 experts per rank, gpu_proxy_train has 32 there. tests/trainer/
  # test_bench_ep_rows.py loads every row's config on its world size)
  [ep4_cap_ovl4]="4 --set ep=4 $CAP --set ep_overlap=true --set ep_overlap_chunks=4 $STEPS"
  # ep_overlap_schedule=pipelined: the shared expert in two halves at both ends of the chunk chain
  [ep4_cap_pipe]="4 --set ep=4 $CAP --set ep_overlap=true --set ep_overlap_schedule=pipelined $STEPS"
  [ep4_cap_pipe4]="4 --set ep=4 $CAP --set ep_overlap=true --set ep_overlap_chunks=4 --set ep_overlap_schedule=pipelined $STEPS"
  [ep4_cap_pipe_prof]="4 --set ep=4 $CAP --set ep_overlap=true --set ep_overlap_schedule=pipelined $PROF"
  [ep4_cap_ovl4_prof]="4 --set ep=4 $CAP --set ep_overlap=true --set ep_overlap_chunks=4 $PROF"
  [ep4_cap_pipe4_prof]="4 --set ep=4 $CAP --set ep_overlap=true --set ep_overlap_chunks=4 --set ep_overlap_schedule=pipelined $PROF"
  [ep4_cap110]="4 --set ep=4 --set ep_dispatch=capacity --set ep_capacity_factor=1.1 $STEPS"
  [ep4_cap110_ovl4]="4 --set ep=4 --set ep_dispatch=capacity --set ep_capacity_factor=1.1 --set ep_overlap=true --set ep_overlap_chunks=4 $STEPS"
  # auxiliary-loss-free balancing (router_bias_update_rate, DeepSeek-V3's 0.001): 30 steps, the last 12 timed,
  # so the router has settled; the *_b30 rows without it are the same length for the comparison
  [dp4_bal]="4 $BAL"
  [dp4_b30]="4 $LONG"
  [ep4_cap_bal]="4 --set ep=4 $CAP $BAL"
  [ep4_cap_b30]="4 --set ep=4 $CAP $LONG"
  [ep4_cap_ovl_bal]="4 --set ep=4 $CAP --set ep_overlap=true $BAL"
  [ep4_cap100_bal]="4 --set ep=4 --set ep_dispatch=capacity --set ep_capacity_factor=1.0 $BAL"
  [ep4_nccl_bal]="4 --set ep=4 $BAL"
  [ep4_cap_bal_prof]="4 --set ep=4 $CAP --set router_bias_update_rate=0.001 --set steps=30 --set timing_warmup_steps=18 --set log_every=10 --set profile_step_start=26 --set profile_step_end=28"
  [ep4_cap_ovl_bal_prof]="4 --set ep=4 $CAP --set ep_overlap=true --set router_bias_update_rate=0.001 --set steps=30 --set timing_warmup_steps=18 --set log_every=10 --set profile_step_start=26 --set profile_step_end=28"
  [ep2_cap_bal]="2 --set ep=2 $CAP $BAL"
  # faster-settling rates (the router of this 30-step run is far from balanced at 0.001)
  [dp4_r3]="4 --set router_bias_update_rate=0.003 $LONG"
  [ep4_cap_r3]="4 --set ep=4 $CAP --set router_bias_update_rate=0.003 $LONG"
  [ep4_cap_r10]="4 --set ep=4 $CAP --set router_bias_update_rate=0.01 $LONG"
  [ep4_cap_ovl_r3]="4 --set ep=4 $CAP --set ep_overlap=true --set router_bias_update_rate=0.003 $LONG"
  [ep4_symm_r3]="4 --set ep=4 $SYMM --set router_bias_update_rate=0.003 $LONG"
  [ep4_cap_r3_prof]="4 --set ep=4 $CAP --set router_bias_update_rate=0.003 --set steps=30 --set timing_warmup_steps=18 --set log_every=10 --set profile_step_start=26 --set profile_step_end=28"
  [dp2_bal]="2 $BAL"
  # expert placement by load: ep4_loads writes the routing counts the *_place rows balance on (run it first)
  [ep4_loads]="4 --set ep=4 $CAP $PROF"
  [ep4_cap_place]="4 --set ep=4 $CAP $PLACE $STEPS"
  [ep4_cap_ovl_place]="4 --set ep=4 $CAP --set ep_overlap=true $PLACE $STEPS"
  [ep4_nccl_place]="4 --set ep=4 $PLACE $STEPS"
  [ep4_cap_place_prof]="4 --set ep=4 $CAP $PLACE $PROF"
  [ep4_cap_place_b30]="4 --set ep=4 $CAP $PLACE $LONG"
  # pipeline layouts on 4 GPUs (issue 35: the what-if's pp predictions from the layout grid's baselines)
  [pp2_mbs4]="4 --set pp=2 --set microbatches=4 --set micro_batch_size=4 $STEPS"
  [pp2_ep2_cap_mbs4]="4 --set pp=2 --set ep=2 $CAP --set microbatches=4 --set micro_batch_size=4 $STEPS"
  [pp4_mbs2]="4 --set pp=4 --set microbatches=8 --set micro_batch_size=2 $STEPS"
  # the sharding planner's layouts for 4 GPUs at a global batch of 96 (issue 35: `tracelens plan gpu_proxy_train
  # --gpus 4 --global-batch 96 --from tests/fixtures/h100_scaling/gpu1_prof --mbs 8,24`), beside the grid's best
  [dp4_mbs8_m3]="4 --set micro_batch_size=8 --set microbatches=3 $STEPS"
  [dp4_mbs24]="4 --set micro_batch_size=24 $STEPS"
  [pp2_mbs8_m6]="4 --set pp=2 --set microbatches=6 --set micro_batch_size=8 $STEPS"
  # profiled (step 8): gradient accumulation under FSDP against one micro-batch of the same size (the what-if's
  # microbatches mechanism)
  [dp4_mbs8_m3_prof]="4 --set micro_batch_size=8 --set microbatches=3 $PROF"
  [dp4_mbs8_prof]="4 --set micro_batch_size=8 $PROF"
  # held out from issue 35's scale-out (predicted before measured: benchmarks/results/issue35_heldout_predictions.json):
  # micro-batches and accumulation the 4-GPU grid never ran, FSDP over 4 and over the experts' dp 2 groups
  #   ROWS="dp4_mbs4 dp4_mbs12 dp4_mbs8_m2 dp4_mbs16_m2 ep2x2_cap_mbs12 ep4_cap_mbs12" bash benchmarks/bench_ep.sh
  [dp4_mbs4]="4 --set micro_batch_size=4 $STEPS"
  [dp4_mbs12]="4 --set micro_batch_size=12 $STEPS"
  [dp4_mbs8_m2]="4 --set micro_batch_size=8 --set microbatches=2 $STEPS"
  [dp4_mbs16_m2]="4 --set microbatches=2 $STEPS"
  [ep2x2_cap_mbs12]="4 --set ep=2 $CAP --set micro_batch_size=12 $STEPS"
  [ep4_cap_mbs12]="4 --set ep=4 $CAP --set micro_batch_size=12 $STEPS"
  # the same trainer's micro-batch 16 beside them (the grid's EP points ran before issue 33's fused capacity path)
  [ep2x2_cap_mbs16]="4 --set ep=2 $CAP $STEPS"
  [ep4_cap_mbs16]="4 --set ep=4 $CAP $STEPS"
  # eight GPUs (issue 38; an 8-GPU kind is lent only at times): EP 8 against FSDP over 8, every dispatch path and
  # the overlap, and PP 4 x EP 2 over 16 layers on the interleaved schedule
  #   ROWS="dp8 ep8_nccl ep8_cap ep8_cap_ovl ep8_cap_pipe ep8_symm ep8_cap_unfused pp4_ep2_vpp2" bash benchmarks/bench_ep.sh
  [dp8]="8 $PROF"
  [ep8_nccl]="8 --set ep=8 $STEPS"
  [ep8_cap]="8 --set ep=8 $CAP $PROF"
  [ep8_cap_ovl]="8 --set ep=8 $CAP --set ep_overlap=true $PROF"
  [ep8_cap_pipe]="8 --set ep=8 $CAP --set ep_overlap=true --set ep_overlap_schedule=pipelined $PROF"
  [ep8_cap_unfused]="8 --set ep=8 $CAP --set ep_capacity_fused=false $STEPS"
  [ep8_symm]="8 --set ep=8 $SYMM $STEPS"
  [pp4_ep2_vpp2]="8 --set pp=4 --set ep=2 $CAP --set n_layers=16 --set pipeline_schedule=vpp --set vpp=2 --set microbatches=8 --set micro_batch_size=4 $PROF"
  # the committed fixture (tests/fixtures/h100_4gpu/ep4_cap_ovl): two profiled steps
  [ep4_cap_ovl_fixture]="4 --set ep=4 $CAP --set ep_overlap=true --set steps=10 --set timing_warmup_steps=3 --set log_every=5 --set profile_step_start=7 --set profile_step_end=9"
)
for name in ${ROWS:-check dp4 ep4_nccl ep4_cap ep4_cap_ovl ep4_symm ep4_nccl_L1_ovl}; do
  t0=$(date +%s)
  if [ "$name" = check ]; then
    echo "=== check: the dispatch paths on NCCL and NVSHMEM"
    EP_WORKER_DEVICE=cuda timeout 420 python3 -m torch.distributed.run --standalone --nproc-per-node "${CHECK_NPROC:-4}" \
      tests/trainer/_ep_dispatch_worker.py "$OUTDIR" > "$OUTDIR/check.log" 2>&1
    echo "check: exit $? in $(( $(date +%s) - t0 )) s"
    grep -E "^(PASS|FAIL) |cases PASS" "$OUTDIR/check.log" || tail -20 "$OUTDIR/check.log"
    continue
  fi
  set -- ${RUNS[$name]}
  nproc=$1; shift
  echo "=== $name: python -m trainer.launch --config gpu_proxy_train --nproc $nproc $*"
  rm -rf "${WORK:?}/$name"
  timeout 900 python3 -m trainer.launch --config gpu_proxy_train --nproc "$nproc" "$@" -o "$WORK/$name" \
    > "$OUTDIR/$name.log" 2>&1
  echo "$name: exit $? in $(( $(date +%s) - t0 )) s"
  tail -2 "$OUTDIR/$name.log"
  if [ "$name" = ep4_loads ] && [ -f "$WORK/ep4_loads/routing.json" ]; then  # the gain the placement predicts
    python3 -m tracelens moe "$WORK/ep4_loads" > "$OUTDIR/ep4_loads.moe.txt" 2>&1 || true
    sed -n '/^expert placement/,/^train with/p' "$OUTDIR/ep4_loads.moe.txt"
  fi
  if ls "$WORK/$name"/traces/*.json.gz >/dev/null 2>&1; then
    python3 -m tracelens comm "$WORK/$name" > "$OUTDIR/$name.comm.txt" 2>&1 || true
    grep "^exposed all-to-all" "$OUTDIR/$name.comm.txt" || true
    python3 -m tracelens comm "$WORK/$name" --json > "$OUTDIR/$name.comm.json" 2>/dev/null || true
  fi
done
python3 - "$OUTDIR" "$WORK" <<'EOF'
import json, sys
from pathlib import Path
out, work = Path(sys.argv[1]), Path(sys.argv[2])
rows = {}
for m in sorted(work.glob("*/manifest.json")):
    j = json.loads(m.read_text())
    mt = j["metrics"]
    rows[m.parent.name] = {
        "world": j["device"]["count"], "device": j["device"]["name"], "parallel": j.get("parallel"),
        "ep_dispatch": j.get("ep_dispatch"), "tokens_per_s_per_gpu": mt["tokens_per_s_per_gpu"], "mfu": mt["mfu"],
        "mean_step_time_s": mt["mean_step_time_s"], "peak_memory_gib": [p / 2**30 for p in mt["peak_memory_bytes"]],
        "loss": mt["loss"], "status": j.get("status"), "ep_placement": j.get("ep_placement")}
(out / "bench_ep.json").write_text(json.dumps(rows, indent=1))
lines = ["| row | GPUs | tokens/s/GPU | MFU | step ms | peak GiB (max) | dropped | expected rank imb. | final loss |",
         "|---|---|---|---|---|---|---|---|---|"]
for n, r in rows.items():
    tps = r["tokens_per_s_per_gpu"]
    dr = (r["ep_dispatch"] or {}).get("dropped_share")
    pl = (r["ep_placement"] or {}).get("layers")  # balanced: max over layers, contiguous -> balanced
    imb = (f"{max(x['imbalance_contiguous'] for x in pl):.2f} -> {max(x['imbalance_balanced'] for x in pl):.2f}"
           if pl else "-")
    lines.append(f"| {n} | {r['world']} | {tps:,.0f} | {100 * (r['mfu'] or 0):.1f} % | {1e3 * r['mean_step_time_s']:.1f} | "
                 f"{max(r['peak_memory_gib']):.1f} | {'-' if dr is None else f'{100 * dr:.2f} %'} | {imb} | {r['loss'][-1]:.4f} |"
                 if tps else f"| {n} | {r['world']} | failed | | | | | | |")
(out / "bench_ep.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
