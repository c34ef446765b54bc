#!/usr/bin/env bash
# Issue 20, bounded memory: one large trace analyzed on 2 pinned cores, for the device machine's CPU (16 cores,
# 128 GiB; no GPU work). Tiles the H200 MoE loop fixture to MB megabytes (default 8000) with every CPU
# (benchmarks/scale_trace.py --jobs), then runs cold load + analyze + summary in fresh processes pinned to
# CPUS (default 2,3: `taskset -c 2,3`), as many runs (up to REPEAT, default 3) as BUDGET seconds allow
# (default 400, the tiling included), and writes big.txt (the table) and big.json (every run) into $OUT.
# The tiled trace lives under /tmp/tracelens-big and is deleted at the end.
#
#   benchmarks/bench_big.sh            # 8 GB on the device machine (the command of record)
#   MB=300 CPUS=0,1 REPEAT=1 benchmarks/bench_big.sh     # a quick local check
#
# Wheels for packages the device image lacks (msgspec, tqdm, ...) are installed from .whl/ when present,
# and the compiled scanner is built in place when it is not importable (it needs a C compiler; without one
# the loader's msgspec path runs, and big.txt's decoder line says so).
set -u
MB=${MB:-8000}
CPUS=${CPUS:-2,3}
REPEAT=${REPEAT:-3}
BUDGET=${BUDGET:-400}
WORK=${WORK:-/tmp/tracelens-big}
OUTDIR=${OUT:-$WORK/out}
export PYTHONUNBUFFERED=1
mkdir -p "$WORK" "$OUTDIR"
if ! python3 -c "import msgspec" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  [ -d /tmp/site/msgspec ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "wheel install failed" | tee "$OUTDIR/big.txt"; exit 9; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! python3 -c "import tracelens.io._kineto_fast" 2>/dev/null; then
  python3 setup.py -q build_ext --inplace >"$WORK/build_ext.log" 2>&1 || echo "compiled scanner not built (see $WORK/build_ext.log)"
fi
{ echo "== $(date -u) host=$(hostname) cpus=$(nproc) MB=$MB pinned=$CPUS"; python3 -c "import sys, numpy, pandas, pyarrow; print('python', sys.version.split()[0], 'numpy', numpy.__version__, 'pandas', pandas.__version__, 'pyarrow', pyarrow.__version__)"; } | tee "$OUTDIR/env.txt"
exec python3 benchmarks/bench_load.py --big --target-mb "$MB" --cpus "$CPUS" --repeat "$REPEAT" --budget "$BUDGET" \
  --work "$WORK" --out "$OUTDIR"
