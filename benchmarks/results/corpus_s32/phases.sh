#!/bin/bash
# stop 32, issue 37: the phases of `tracelens analyze` on the device machine's CPU (CPUs 2,3): when the scan, the parse,
# the imports, the load, the analysis and the summary end (phases.py), per trace and scan-thread setting, alternating.
set -u
S=/tmp/s32p; mkdir -p $S
[ -n "${NO_SITE:-}" ] || { tar -C /tmp -xJf .whl/c31/site.tar.xz && export PYTHONPATH=/tmp/site31; }
export TRACELENS_CORPUS_EXTERNAL=$PWD/.whl/c31/ext
python3 setup.py -q build_ext --inplace > $S/build.log 2>&1
. benchmarks/bytecode.sh
python3 - > $S/tile.log 2>&1 <<'PY'
import os, sys; sys.path.insert(0, "benchmarks")
from pathlib import Path
import bench_load as b
src = {n: p for n, p, _ in b.CORPUS}
for n in os.environ.get("TLIST", "h100_owlv2 mi300_sglang").split():
    b.tile(b.corpus_source(src[n]), Path("/tmp/tiles"), n, 200)
PY
for i in 1 2 3; do for t in ${TLIST:-h100_owlv2 mi300_sglang}; do for v in ${VARIANTS:-default scan2}; do
  case $v in scan2) E="TRACELENS_SCAN_THREADS=2";; noparse) E="TRACELENS_NO_PREFETCH_PARSE=1";; *) E="X=1";; esac
  rm -rf $S/o $S/c
  echo "== $t $v $i" >> $OUT/phases.txt
  env $E TRACELENS_CACHE_DIR=$S/c taskset -c ${CPUS:-2,3} python3 benchmarks/results/corpus_s32/phases.py analyze /tmp/tiles/$t-200MB/rank0.json -o $S/o -q 2>&1 | grep PHASE >> $OUT/phases.txt
done; done; done
cp $S/*.log $OUT/ 2>/dev/null
cat $OUT/phases.txt | awk '/^==/{h=$0} /write_all \[/{print h, $2}'
