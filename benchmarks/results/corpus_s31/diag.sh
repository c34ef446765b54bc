#!/bin/bash
# stop 31, issue 37: where `tracelens analyze` spends its time on the device machine's CPU (gVisor), per switch:
# default, no offload fork, no mmap, no prefetch thread; py-spy and -X importtime of one run each. CPUs 2,3.
set -u
S=/tmp/s31; mkdir -p $S
tar -C /tmp -xJf .whl/c31/site.tar.xz && export PYTHONPATH=/tmp/site31 PATH=/tmp/site31/py_spy-0.4.3.data/scripts:$PATH
python3 setup.py -q build_ext --inplace > $S/build.log 2>&1
. benchmarks/bytecode.sh
export TRACELENS_CORPUS_EXTERNAL=$PWD/.whl/c31/ext
{ lscpu | grep -E "Model name|^CPU\(s\)|MHz"; python3 -c "import numpy, pandas, sys; print(sys.version.split()[0], numpy.__version__, pandas.__version__)"; } > $OUT/env.txt 2>&1
python3 - > $S/tile.log 2>&1 <<'PY'
import sys; sys.path.insert(0, "benchmarks")
from pathlib import Path
import bench_load as b
src = {n: p for n, p, _ in b.CORPUS}
for n in ["h100_owlv2", "mi300_sglang", "pp2_1f1b_r0", "b200_eager"]:
    b.tile(b.corpus_source(src[n]), Path("/tmp/tiles"), n, 200)
PY
TIMEFORMAT="%R %U %S"
one() {  # name variant env...
  local t=$1 v=$2; shift 2; rm -rf $S/o $S/c
  { time env TRACELENS_CACHE_DIR=$S/c "$@" taskset -c 2,3 python3 -m tracelens analyze /tmp/tiles/$t-200MB/rank0.json -o $S/o > /dev/null 2>$S/err; } 2> $S/t
  echo "$t $v $(tail -1 $S/t)" | tee -a $OUT/times.txt
}
for t in h100_owlv2 mi300_sglang pp2_1f1b_r0 b200_eager; do
  for i in 1 2 3; do one $t default; done
  for i in 1 2; do one $t offload0 TRACELENS_OFFLOAD=0; one $t nommap TRACELENS_NO_MMAP=1; one $t noprefetch TRACELENS_NO_PREFETCH=1; done
done
for t in h100_owlv2 pp2_1f1b_r0; do
  rm -rf $S/o $S/c; TRACELENS_CACHE_DIR=$S/c taskset -c 2,3 py-spy record -r 250 -s -f raw -o $OUT/prof_$t.txt -- python3 -m tracelens analyze /tmp/tiles/$t-200MB/rank0.json -o $S/o > $OUT/pyspy_$t.log 2>&1
  rm -rf $S/o $S/c; TRACELENS_CACHE_DIR=$S/c taskset -c 2,3 python3 -X importtime -m tracelens analyze /tmp/tiles/$t-200MB/rank0.json -o $S/o 2> $OUT/importtime_$t.txt > /dev/null
done
python3 -c "
import time, os
t=time.perf_counter(); pid=os.fork()
if pid==0: os._exit(0)
os.waitpid(pid,0); print('fork+wait of a small process', round((time.perf_counter()-t)*1e3,2), 'ms')
import numpy as np; a=np.ones(300_000_000//8); t=time.perf_counter(); pid=os.fork()
if pid==0: os._exit(0)
os.waitpid(pid,0); print('fork+wait with 300 MB resident', round((time.perf_counter()-t)*1e3,2), 'ms')
" >> $OUT/env.txt 2>&1
cat $OUT/env.txt
