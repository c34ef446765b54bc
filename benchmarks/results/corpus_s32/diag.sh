#!/bin/bash
# stop 32, issue 37: what the device machine's CPU (gVisor) charges `tracelens analyze` for besides Python: system
# time and page faults per run (benchmarks/rusage.py), the cost of a first touch of fresh memory (numpy, with and without
# its huge-page advice), the imports with the cyclic GC on and off, and a py-spy profile that does not pause the
# process (--nonblocking). CPUs 2,3; two 200 MB tiles.
set -u
S=/tmp/s32; mkdir -p $S
tar -C /tmp -xJf .whl/c31/site.tar.xz && export PYTHONPATH=/tmp/site31 PATH=/tmp/site31/py_spy-0.4.3.data/scripts:$PATH
python3 setup.py -q build_ext --inplace > $S/build.log 2>&1
. benchmarks/bytecode.sh
export TRACELENS_CORPUS_EXTERNAL=$PWD/.whl/c31/ext
{ cat /sys/kernel/mm/transparent_hugepage/enabled; uname -a; python3 -c "import numpy, pandas, pyarrow, sys; print(sys.version.split()[0], numpy.__version__, pandas.__version__, pyarrow.__version__)"; } > $OUT/env.txt 2>&1
python3 - > $S/tile.log 2>&1 <<'PY'
import sys; sys.path.insert(0, "benchmarks")
from pathlib import Path
import bench_load as b
src = {n: p for n, p, _ in b.CORPUS}
for n in ["h100_owlv2", "mi300_sglang"]:
    b.tile(b.corpus_source(src[n]), Path("/tmp/tiles"), n, 200)
PY
one() {  # trace variant env...
  local t=$1 v=$2; shift 2; rm -rf $S/o $S/c
  env TRACELENS_CACHE_DIR=$S/c "$@" taskset -c 2,3 python3 benchmarks/rusage.py "$t $v" -- \
    python3 -m tracelens analyze /tmp/tiles/$t-200MB/rank0.json -o $S/o -q 2>>$S/err | tee -a $OUT/time.txt
}
for i in 1 2 3; do for t in h100_owlv2 mi300_sglang; do
  one $t default
  one $t glibc_big GLIBC_TUNABLES=glibc.malloc.mmap_threshold=4294967295:glibc.malloc.trim_threshold=4294967295
  one $t offload0 TRACELENS_OFFLOAD=0
done; done
taskset -c 2 python3 - > $OUT/faults.txt 2>&1 <<'PY'
import time, resource, numpy as np
def t(f, n=3):
    r = []
    for _ in range(n):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt; s = time.perf_counter(); f(); r.append((time.perf_counter() - s, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0))
    r.sort(); return f"{r[n // 2][0] * 1e3:.1f} ms, {r[n // 2][1]} faults"
N = 400 << 20
print("np.ones 400 MB (fresh memory each time)", t(lambda: np.ones(N // 8)))
a = np.empty(N // 8); a.fill(1)
print("fill 400 MB already touched", t(lambda: a.fill(2)))
try:
    from numpy._core.multiarray import _set_madvise_hugepage
    _set_madvise_hugepage(False); print("np.ones 400 MB, no huge-page advice", t(lambda: np.ones(N // 8))); _set_madvise_hugepage(True)
except Exception as e: print("no _set_madvise_hugepage", e)
import pyarrow as pa
print("arrow pool", pa.default_memory_pool().backend_name)
x = np.arange(50_000_000)
print("pa.array(int64 50M).take(reversed) fresh", t(lambda: pa.array(x).take(pa.array(x[::-1].copy()))))
PY
for i in 1 2 3 4 5; do for g in on off; do
  taskset -c 2 python3 -c "
import time; t=time.perf_counter()
if '$g' == 'off':
    import gc; gc.disable()
import tracelens.trace, tracelens.analyzer, reports.artifacts
print('imports gc $g', round(time.perf_counter()-t,3))" >> $OUT/imports.txt 2>&1
done; done
rm -rf $S/o $S/c; TRACELENS_CACHE_DIR=$S/c taskset -c 2,3 py-spy record --nonblocking -r 1000 --threads -f raw -o $OUT/prof_owlv2.txt -- python3 -m tracelens analyze /tmp/tiles/h100_owlv2-200MB/rank0.json -o $S/o > $S/pyspy.log 2>&1
rm -rf $S/o $S/c; TRACELENS_CACHE_DIR=$S/c taskset -c 2,3 python3 -X importtime -m tracelens analyze /tmp/tiles/h100_owlv2-200MB/rank0.json -o $S/o 2> $OUT/importtime_owlv2.txt > /dev/null
gzip -f $OUT/prof_owlv2.txt $OUT/importtime_owlv2.txt
cat $OUT/env.txt $OUT/time.txt $OUT/faults.txt $OUT/imports.txt
