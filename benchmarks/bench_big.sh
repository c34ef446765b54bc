#!/usr/bin/env bash
# Issue 20, bounded memory: large traces analyzed on 2 pinned cores, for the device machine's CPU (16 cores,
# 128 GiB; no GPU work). For each size of SIZES (MB, default "2000 8000"): tiles the H200 MoE loop fixture
# to that size with every CPU (benchmarks/scale_trace.py --jobs), runs cold load + analyze + summary in
# fresh processes pinned to CPUS (default 2,3, as `taskset -c 2,3`), up to REPEAT runs (default 3) while
# the call's BUDGET seconds allow (default 400, the tiling included; a size is skipped when fewer than
# ~30 s per GB + 30 s are left), writes big-<MB>MB.txt (the table) and big-<MB>MB.json (every run) into $OUT, and deletes
# the trace. env.txt records the machine and versions.
#
#   benchmarks/bench_big.sh                                   # the device machine: 2 GB x3, then 8 GB
#   SIZES=300 CPUS=0,1 REPEAT=1 benchmarks/bench_big.sh       # a quick local check
#
# Wheels for packages the device image lacks (msgspec, tqdm, ...) are installed from .whl/ when present,
# and the compiled scanner is built in place when it is not importable (it needs a C compiler; without one
# the loader's msgspec path runs, and each table's decoder line says so).
set -u
SIZES=${SIZES:-2000 8000}
CPUS=${CPUS:-2,3}
REPEAT=${REPEAT:-3}
BUDGET=${BUDGET:-400}
WORK=${WORK:-/tmp/tracelens-big}
OUTDIR=${OUT:-$WORK/out}
export PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p "$WORK" "$OUTDIR"
if ! python3 -c "import msgspec" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  [ -d /tmp/site/msgspec ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "wheel install failed" | tee "$OUTDIR/env.txt"; exit 9; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! python3 -c "import tracelens.io._kineto_fast" 2>/dev/null; then
  python3 setup.py -q build_ext --inplace >"$WORK/build_ext.log" 2>&1 || echo "compiled scanner not built (see $WORK/build_ext.log)"
fi
# bytecode as an installed Python has it: with PYTHONDONTWRITEBYTECODE set (the device image sets it) and
# packages installed without it, every fresh process compiles pandas, numpy, pyarrow, HTA and tracelens from
# source (~1 s, the same for both tools, a third of a 200 MB run of tracelens). So bytecode is written once,
# under PYTHONPYCACHEPREFIX, for those packages and the wheels' (both tools alike), then read by every run.
. benchmarks/bytecode.sh
{ echo "== $(date -u) host=$(hostname) cpus=$(nproc) sizes=$SIZES pinned=$CPUS"
  python3 -c "import sys, numpy, pandas, pyarrow; print('python', sys.version.split()[0], 'numpy', numpy.__version__, 'pandas', pandas.__version__, 'pyarrow', pyarrow.__version__)"
  free -g | head -2; } 2>&1 | tee "$OUTDIR/env.txt"
rc=0
for MB in $SIZES; do
  LEFT=$(( BUDGET - ($(date +%s) - T0) ))
  NEED=$(( MB * 30 / 1000 + 30 ))  # tiling + one run, ~30 s per GB on the device CPU's 2 cores (est.)
  [ "$LEFT" -lt "$NEED" ] && { echo "== $LEFT s left, $MB MB needs ~$NEED: skipped" | tee -a "$OUTDIR/env.txt"; rc=3; break; }
  python3 benchmarks/bench_load.py --big --target-mb "$MB" --cpus "$CPUS" --repeat "$REPEAT" --budget "$LEFT" \
    --work "$WORK" --out "$OUTDIR" || rc=$?
done
exit $rc
