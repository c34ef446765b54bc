#!/bin/bash
# stop 33, issue 37: 2 GB tiles (K: corpus names, comma-separated) built side by side on TILE_CPUS (8-15), then each
# `tracelens analyze TILE -o OUT` alone on CPUS (2,3) with an empty cache, RUNS times (2), wall / CPU / peak RSS of the
# largest process (benchmarks/rusage.py); phases of one more run with benchmarks/results/corpus_s32/phases.py.
set -u
S=/tmp/s33b; mkdir -p $S /tmp/big
[ -d /tmp/site31 ] || tar -C /tmp -xJf .whl/c31/site.tar.xz; export PYTHONPATH=/tmp/site31
export TRACELENS_CORPUS_EXTERNAL=$PWD/.whl/c31/ext
python3 -c 'import tracelens.io._kineto_fast' 2>/dev/null || python3 setup.py -q build_ext --inplace > $S/build.log 2>&1
. benchmarks/bytecode.sh
names=${K:-a100_triton,h100_moe_mbs8}
mkdir -p $OUT; taskset -c ${CPUS:-2,3} python3 benchmarks/host_speed.py | tee -a $OUT/big.txt  # (hosts differ: stop 34)
for k in ${names//,/ }; do
  taskset -c ${TILE_CPUS:-8-15} python3 -c "
import sys; sys.path.insert(0, '.')
from pathlib import Path
from benchmarks.bench_load import CORPUS, corpus_source, tile
src = {n: s for n, s, _ in CORPUS}['$k']
tile(corpus_source(src), Path('/tmp/big'), '$k', 2000)" > $S/tile_$k.log 2>&1 &
done
wait
for k in ${names//,/ }; do
  t=/tmp/big/$k-2000MB/rank0.json
  ls -la $t | tee -a $OUT/big.txt
  for r in $(seq ${RUNS:-2}); do
    rm -rf /tmp/bigout /tmp/bigcache
    TRACELENS_CACHE_DIR=/tmp/bigcache taskset -c ${CPUS:-2,3} python3 benchmarks/rusage.py "$k run $r" -- \
      python3 -m tracelens analyze $t -o /tmp/bigout -q 2>&1 | tee -a $OUT/big.txt
  done
  if [ -n "${PHASES:-}" ]; then
    rm -rf /tmp/bigout /tmp/bigcache
    TRACELENS_CACHE_DIR=/tmp/bigcache taskset -c ${CPUS:-2,3} python3 benchmarks/results/corpus_s32/phases.py analyze $t \
      -o /tmp/bigout -q 2>&1 | grep PHASE > $OUT/phases_$k.txt
  fi
  du -sh /tmp/bigout/summary.json /tmp/bigout/tables >> $OUT/big.txt 2>&1
  rm -f $t
done
