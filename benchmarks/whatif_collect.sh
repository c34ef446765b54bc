#!/usr/bin/env bash
# Development data for the what-if performance model: a fixed set of trainer runs of the single-GPU proxy
# (trainer/configs/gpu_proxy.yaml) that each change one or two knobs (sync-free level, grouped-GEMM
# backend, micro-batch size, recompute, manual GC, fused AdamW), plus the grouped-GEMM tuner's timings
# for the expert shapes of the micro-batch sizes used.  Runs one after another on one GPU, from the repo
# root:
#
#   benchmarks/whatif_collect.sh [--dry-run] [--work DIR] [--out DIR] [--config NAME] [--budget S]
#                                [--deadline S] [--runs "r01_... r02_..."] [--tune-mbs "2 8 16 24"]
#                                [--tune-reps N] [--no-tune] [--set key=value ...] [--python PY]
#
# Every run writes WORK/runs/<name>/ (manifest.json, traces/rank0.json.gz, train.log with its stdout and
# stderr).  A failed run does not stop the script: its exit status goes to WORK/summary.tsv.  No new run
# or tuner shape starts once --budget seconds (default 480) have passed since the script started, and a
# run still going at --deadline seconds (default 540) is killed, so the whole command ends inside a 10-minute
# limit with time to pack; what did not start is listed as "not_started" in summary.tsv (start it
# again with --runs).  The traced runs come first.
#
# Packing (into --out, default $OUT, else WORK/out; at most 8 files): runs.tar.gz with every run's
# manifest.json + train.log, the tuner JSONs and logs, the tuning-cache JSON, summary.tsv and env.txt;
# plus trace_<name>.json.gz for each run marked "keep trace" whose trace is at most 16 MiB; plus summary.tsv.
# --set adds overrides to every trainer run (after the common ones), e.g. a CPU smoke test:
#   benchmarks/whatif_collect.sh --config tiny --set device=cpu --set dtype=fp32 --no-tune --work /tmp/w
set -u

PY=python3
CONFIG=gpu_proxy
WORK=${WHATIF_WORK:-/tmp/whatif_work}
OUTDIR=${OUT:-}
BUDGET_S=480
DEADLINE_S=540
RUNS_SEL=""
TUNE_MBS="2 8 16 24"
TUNE_REPS=5
DO_TUNE=1
DRY=0
EXTRA=()

while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --work) WORK=$2; shift ;;
    --out) OUTDIR=$2; shift ;;
    --config) CONFIG=$2; shift ;;
    --budget) BUDGET_S=$2; shift ;;
    --deadline) DEADLINE_S=$2; shift ;;
    --runs) RUNS_SEL=$2; shift ;;
    --tune-mbs) TUNE_MBS=$2; shift ;;
    --tune-reps) TUNE_REPS=$2; shift ;;
    --no-tune) DO_TUNE=0 ;;
    --set) EXTRA+=(--set "$2"); shift ;;
    --python) PY=$2; shift ;;
    -h|--help) sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "whatif_collect.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[ -n "$OUTDIR" ] || OUTDIR=$WORK/out

COMMON=(--set steps=16 --set profile_step_start=6 --set profile_step_end=7 --set timing_warmup_steps=2
        --set log_every=4)

# name | keep trace (1/0) | overrides (space-separated key=value)
SPECS=(
  "r01_L0_loop_mbs2|1|sync_free_level=0 grouped_gemm_backend=loop micro_batch_size=2"
  "r02_L0_torch_mbs2|1|sync_free_level=0 grouped_gemm_backend=torch micro_batch_size=2"
  "r03_L3_torch_mbs2|1|sync_free_level=3 grouped_gemm_backend=torch micro_batch_size=2"
  "r04_L3_torch_mbs8|1|sync_free_level=3 grouped_gemm_backend=torch micro_batch_size=8"
  "r05_L3_torch_mbs2_rc123|1|sync_free_level=3 grouped_gemm_backend=torch micro_batch_size=2 recompute_layer_ids=[1,2,3]"
  "r06_L1_loop_mbs2|0|sync_free_level=1 grouped_gemm_backend=loop micro_batch_size=2"
  "r07_L0_loop_mbs8|0|sync_free_level=0 grouped_gemm_backend=loop micro_batch_size=8"
  "r08_L3_triton_mbs8|0|sync_free_level=3 grouped_gemm_backend=triton micro_batch_size=8"
  "r09_L0_multistream_mbs2|0|sync_free_level=0 grouped_gemm_backend=multistream micro_batch_size=2"
  "r10_L3_torch_mbs16|0|sync_free_level=3 grouped_gemm_backend=torch micro_batch_size=16"
  "r11_L3_torch_mbs16_gc10|0|sync_free_level=3 grouped_gemm_backend=torch micro_batch_size=16 manual_gc=10"
  "r12_L3_torch_mbs16_adamwfused|0|sync_free_level=3 grouped_gemm_backend=torch micro_batch_size=16 optimizer=adamw_fused"
  "r13_L3_torch_mbs24|0|sync_free_level=3 grouped_gemm_backend=torch micro_batch_size=24"
)

T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
log() { echo "[whatif $(elapsed)s] $*" >&2; }

mkdir -p "$WORK/runs" "$WORK/tune" "$WORK/cache" "$OUTDIR"
WORK=$(cd "$WORK" && pwd); OUTDIR=$(cd "$OUTDIR" && pwd)
SUMMARY=$WORK/summary.tsv
printf 'name\tkeep_trace\trc\twall_s\ttrace_bytes\toverrides\n' > "$SUMMARY"

# environment record (cheap; what the model's data was measured on)
if [ "$DRY" = 0 ]; then
  {
    echo "date_utc $(date -u +%FT%TZ)"; echo "host $(hostname)"; echo "git $(git rev-parse HEAD 2>/dev/null)"
    git status --short 2>/dev/null | sed 's/^/dirty /'
    "$PY" -c 'import sys, torch, triton; print("python", sys.version.split()[0]); print("torch", torch.__version__); print("triton", triton.__version__); print("cuda", torch.cuda.is_available() and torch.cuda.get_device_name(0))' 2>&1
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  } > "$WORK/env.txt" 2>&1
fi

selected() {  # is run $1 selected by --runs (empty: all)?
  [ -z "$RUNS_SEL" ] && return 0
  case " $RUNS_SEL " in *" $1 "*) return 0 ;; esac
  return 1
}

for spec in "${SPECS[@]}"; do
  IFS='|' read -r name keep ovs <<< "$spec"
  selected "$name" || continue
  run=$WORK/runs/$name
  sets=()
  for kv in $ovs; do sets+=(--set "$kv"); done
  cmd=("$PY" -m trainer.launch --config "$CONFIG" --nproc 1 -o "$run" "${COMMON[@]}" "${sets[@]}" "${EXTRA[@]}")
  if [ "$DRY" = 1 ]; then
    echo "${cmd[*]} > $run/train.log 2>&1"
    continue
  fi
  if [ "$(elapsed)" -ge "$BUDGET_S" ]; then
    log "$name: not started (budget ${BUDGET_S}s spent)"
    printf '%s\t%s\tnot_started\t0\t0\t%s\n' "$name" "$keep" "$ovs" >> "$SUMMARY"
    continue
  fi
  left=$(( DEADLINE_S - $(elapsed) )); [ "$left" -lt 30 ] && left=30
  mkdir -p "$run"
  log "$name: start (limit ${left}s): $ovs"
  t=$(date +%s)
  PYTHONUNBUFFERED=1 timeout -k 10 "$left" "${cmd[@]}" > "$run/train.log" 2>&1
  rc=$?
  w=$(( $(date +%s) - t ))
  [ "$rc" = 124 ] && echo "whatif_collect: killed after ${left}s (deadline ${DEADLINE_S}s)" >> "$run/train.log"
  tb=0; [ -f "$run/traces/rank0.json.gz" ] && tb=$(stat -c %s "$run/traces/rank0.json.gz")
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$keep" "$rc" "$w" "$tb" "$ovs" >> "$SUMMARY"
  log "$name: rc=$rc ${w}s trace=${tb}B | $(grep -E '^\[trainer\] wrote|Error|error' "$run/train.log" | tail -1)"
done

if [ "$DO_TUNE" = 1 ]; then
  for m in $TUNE_MBS; do
    cmd=("$PY" -m tracelens kernels tune --config "$CONFIG" --set "micro_batch_size=$m" --set sync_free_level=3
         --reps "$TUNE_REPS" --json "$WORK/tune/tune_mbs$m.json")
    if [ "$DRY" = 1 ]; then
      echo "TRACELENS_CACHE_DIR=$WORK/cache ${cmd[*]} > $WORK/tune/tune_mbs$m.log 2>&1"
      continue
    fi
    if [ "$(elapsed)" -ge "$BUDGET_S" ]; then
      log "tune mbs$m: not started (budget ${BUDGET_S}s spent)"
      printf 'tune_mbs%s\t0\tnot_started\t0\t0\tmicro_batch_size=%s\n' "$m" "$m" >> "$SUMMARY"
      continue
    fi
    left=$(( DEADLINE_S - $(elapsed) )); [ "$left" -lt 30 ] && left=30
    t=$(date +%s)
    TRACELENS_CACHE_DIR=$WORK/cache PYTHONUNBUFFERED=1 timeout -k 10 "$left" "${cmd[@]}" > "$WORK/tune/tune_mbs$m.log" 2>&1
    rc=$?
    w=$(( $(date +%s) - t ))
    printf 'tune_mbs%s\t0\t%s\t%s\t0\tmicro_batch_size=%s\n' "$m" "$rc" "$w" "$m" >> "$SUMMARY"
    log "tune mbs$m: rc=$rc ${w}s | $(grep -E '^winners|rror' "$WORK/tune/tune_mbs$m.log" | tail -2 | tr '\n' ' ')"
  done
fi

[ "$DRY" = 1 ] && exit 0

# ---- pack ----
log "packing into $OUTDIR"
cache_json=$(cd "$WORK" && find cache -name '*.json' 2>/dev/null)
(cd "$WORK" && tar czf "$OUTDIR/runs.tar.gz" summary.tsv env.txt tune $cache_json \
   $(find runs -maxdepth 2 \( -name manifest.json -o -name train.log \) | sort))
cp "$SUMMARY" "$OUTDIR/summary.tsv"
LIMIT=$((16 * 1024 * 1024))
for spec in "${SPECS[@]}"; do
  IFS='|' read -r name keep _ <<< "$spec"
  tr=$WORK/runs/$name/traces/rank0.json.gz
  [ "$keep" = 1 ] && [ -f "$tr" ] || continue
  sz=$(stat -c %s "$tr")
  if [ "$sz" -le "$LIMIT" ]; then
    cp "$tr" "$OUTDIR/trace_$name.json.gz"
  else
    log "trace of $name is $sz bytes (> 16 MiB): not packed"
  fi
done
ls -la "$OUTDIR" >&2
column -t -s $'\t' "$SUMMARY" >&2 2>/dev/null || cat "$SUMMARY" >&2
log "done"
