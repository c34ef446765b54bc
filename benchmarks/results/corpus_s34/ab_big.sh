#!/bin/bash
# stop 34, issue 37: the 2 GB a100_triton tile on one device host, this code against the stop's start (8fb7f29:
# `git archive` into bench_data/b34, its extensions built there), alternating, RUNS pairs, `taskset -c 2,3`, empty cache;
# then phases of this code's run. Carry [".whl/c31", "bench_data/b34"].
set -u
S=/tmp/s34ab; mkdir -p $S /tmp/big
[ -d /tmp/site31 ] || tar -C /tmp -xJf .whl/c31/site.tar.xz; export PYTHONPATH=/tmp/site31
export TRACELENS_CORPUS_EXTERNAL=$PWD/.whl/c31/ext
python3 setup.py -q build_ext --inplace > $S/build.log 2>&1
(cd bench_data/b34 && python3 setup.py -q build_ext --inplace > $S/build_before.log 2>&1)
EXTRA="--compare-root bench_data/b34" . benchmarks/bytecode.sh
K=${K:-a100_triton}
taskset -c 8-15 python3 -c "
import sys; sys.path.insert(0, '.')
from pathlib import Path
from benchmarks.bench_load import CORPUS, corpus_source, tile
src = {n: s for n, s, _ in CORPUS}['$K']
tile(corpus_source(src), Path('/tmp/big'), '$K', 2000)" > $S/tile.log 2>&1
t=/tmp/big/$K-2000MB/rank0.json
R=$PWD/benchmarks/rusage.py
for r in $(seq ${RUNS:-2}); do
  for side in now before; do
    d=$PWD; [ $side = before ] && d=$PWD/bench_data/b34
    rm -rf /tmp/bigout /tmp/bigcache
    (cd $d && TRACELENS_CACHE_DIR=/tmp/bigcache taskset -c 2,3 python3 $R "$K $side $r" -- \
      python3 -m tracelens analyze $t -o /tmp/bigout -q) 2>&1 | tee -a $OUT/ab.txt
  done
done
if [ -n "${PHASES:-}" ]; then
  rm -rf /tmp/bigout /tmp/bigcache
  TRACELENS_CACHE_DIR=/tmp/bigcache taskset -c 2,3 python3 benchmarks/results/corpus_s32/phases.py analyze $t \
    -o /tmp/bigout -q 2>&1 | grep PHASE > $OUT/phases_$K.txt
fi
