#!/usr/bin/env bash
# The what-if acceptance runs on one GPU, resumable across machine leases of at most 10 minutes a call:
# for each space in order (default: gpu_whatif_mbs gpu_whatif_recompute gpu_whatif_gc_small), the grid,
# the model's predictions of every grid point from the baseline trial alone, and the guided search
# (benchmarks/bench_autotune.py --accuracy). A space finished in an earlier call is skipped; an unfinished
# one resumes from its stores (nothing measured is lost or rerun).
#
#   benchmarks/whatif_grids.sh [--budget S] [--work DIR] [--live SPACE ...] [--spaces "a b c"]
#
#   --budget S   start no trial after S seconds of this call (default 480): the call ends inside 10 minutes
#   --work DIR   where the sweeps live between calls (default /tmp/whatif_grids; the same machine keeps it)
#   --live SPACE run that space's guided search for real (its own trials, before the grid) instead of
#                answering it from the grid's store
#
# Packing, into $OUT when set (at most 8 files: a call works on at most 3 spaces): per space this call worked
# on, <space>.json (bench_autotune.json), <space>_runs.tgz (every trial's manifest.json + traces + trial.log, the grid and guided stores, the sweep
# reports), and log.txt. Wheels for packages the device image lacks are installed from .whl/ when present.
set -u
BUDGET=480
WORK=/tmp/whatif_grids
SPACES="gpu_whatif_mbs gpu_whatif_recompute gpu_whatif_gc_small"
LIVE=""
while [ $# -gt 0 ]; do
  case "$1" in
    --budget) BUDGET=$2; shift ;;
    --work) WORK=$2; shift ;;
    --spaces) SPACES=$2; shift ;;
    --live) LIVE="$LIVE $2"; shift ;;
    *) echo "whatif_grids.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
export PYTHONUNBUFFERED=1
T0=$(date +%s)
LOG=${OUT:-$WORK}/log.txt
mkdir -p "$WORK" "$(dirname "$LOG")"
if ls .whl/*.whl >/dev/null 2>&1 && ! python3 -c "import plotly, msgspec" 2>/dev/null; then
  [ -d /tmp/site/plotly ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "wheel install failed" | tee -a "$LOG"; exit 9; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
{ echo "== $(date -u) host=$(hostname) budget=${BUDGET}s"; nvidia-smi --query-gpu=name,memory.used --format=csv,noheader 2>&1; } | tee -a "$LOG"
python3 -c "import yaml, tracelens, reports.sweep, autotune.sweep" 2>&1 | tee -a "$LOG" || exit 9
rc=0
RAN=""
for S in $SPACES; do
  [ -f "$WORK/$S.done" ] && { echo "== $S: done in an earlier call" | tee -a "$LOG"; continue; }
  LEFT=$(( BUDGET - ($(date +%s) - T0) ))
  [ "$LEFT" -lt 60 ] && { echo "== no time left for $S (resume it in the next call)" | tee -a "$LOG"; rc=3; break; }
  MODE=""
  case " $LIVE " in *" $S "*) MODE="--live" ;; esac
  [ "$(echo $RAN | wc -w)" -ge 3 ] && { echo "== $S: next call (a call packs at most 3 spaces)" | tee -a "$LOG"; rc=3; break; }
  RAN="$RAN $S"
  echo "== $(date -u) $S ${MODE:-replay} stop-after ${LEFT}s" | tee -a "$LOG"
  set -o pipefail
  python3 benchmarks/bench_autotune.py --config "$S" --out "$WORK/$S" --accuracy --tolerance 0.05 --max-share 0.25 \
    --resume --stop-after "$LEFT" $MODE 2>&1 | tee -a "$LOG"
  brc=$?
  set +o pipefail
  echo "== $S rc=$brc" | tee -a "$LOG"
  if [ $brc -eq 0 ]; then touch "$WORK/$S.done"; else rc=$brc; break; fi
done
if [ -n "${OUT:-}" ]; then
  for S in $RAN; do  # the spaces this call worked on (an earlier call packed the others)
    [ -d "$WORK/$S" ] || continue
    cp "$WORK/$S/bench_autotune.json" "$OUT/$S.json" 2>/dev/null
    (cd "$WORK" && tar czf "$OUT/${S}_runs.tgz" --exclude='*.lock' --exclude='*.html' "$S" 2>/dev/null)
  done
  ls -la "$OUT"
fi
exit $rc
