#!/bin/bash
# stop 34, issue 37: glibc malloc's settings against page faults on the device (gVisor: a fault costs more there).
# The 2 GB a100_triton tile and the 200 MB mi300_sglang tile, `tracelens analyze` on CPUs 2,3 with an empty cache,
# the variants alternating, RUNS rounds: default; MALLOC_TOP_PAD_ 256 MB + MALLOC_TRIM_THRESHOLD_ 512 MB; the same
# with MALLOC_ARENA_MAX=2. Carry [".whl/c31"]; lines in $OUT/malloc.txt.
set -u
S=/tmp/s34m; mkdir -p $S /tmp/big
[ -d /tmp/site31 ] || tar -C /tmp -xJf .whl/c31/site.tar.xz; export PYTHONPATH=/tmp/site31
export TRACELENS_CORPUS_EXTERNAL=$PWD/.whl/c31/ext
python3 setup.py -q build_ext --inplace > $S/build.log 2>&1
. benchmarks/bytecode.sh
for kt in a100_triton:2000 mi300_sglang:200; do
  k=${kt%%:*}; mb=${kt##*:}
  taskset -c 8-15 python3 -c "
import sys; sys.path.insert(0, '.')
from pathlib import Path
from benchmarks.bench_load import CORPUS, corpus_source, tile
src = {n: s for n, s, _ in CORPUS}['$k']
tile(corpus_source(src), Path('/tmp/big'), '$k', $mb)" > $S/tile_$k.log 2>&1 &
done
wait
for kt in mi300_sglang:200 a100_triton:2000; do
  k=${kt%%:*}; mb=${kt##*:}; t=/tmp/big/$k-${mb}MB/rank0.json
  for r in $(seq ${RUNS:-2}); do
    for v in default pad arena; do
      case $v in
        default) E="";;
        pad) E="MALLOC_TOP_PAD_=268435456 MALLOC_TRIM_THRESHOLD_=536870912";;
        arena) E="MALLOC_ARENA_MAX=2 MALLOC_TOP_PAD_=268435456 MALLOC_TRIM_THRESHOLD_=536870912";;
      esac
      rm -rf /tmp/bigout /tmp/bigcache
      env $E TRACELENS_CACHE_DIR=/tmp/bigcache taskset -c 2,3 python3 benchmarks/rusage.py "$k $v $r" -- \
        python3 -m tracelens analyze $t -o /tmp/bigout -q 2>&1 | tee -a $OUT/malloc.txt
    done
  done
done
