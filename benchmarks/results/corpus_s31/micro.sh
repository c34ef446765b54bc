#!/bin/bash
# stop 31, issue 37: the device CPU's cost of the load's pieces, single thread on CPU 2: the compiled scan from a
# memory map vs from bytes read, the hashes the cache key could use, read() and page-fault throughput; CPU topology.
set -u
tar -C /tmp -xJf .whl/c31/site.tar.xz && export PYTHONPATH=/tmp/site31
python3 setup.py -q build_ext --inplace > /dev/null 2>&1
{ lscpu -e 2>/dev/null | head -20; grep -o -m1 -w "sha_ni" /proc/cpuinfo; grep -o -m1 -w avx512f /proc/cpuinfo; grep -o -m1 -w avx2 /proc/cpuinfo
  cat /sys/devices/system/cpu/cpu2/topology/thread_siblings_list 2>/dev/null; } > $OUT/topo.txt 2>&1
python3 - > /dev/null 2>&1 <<'PY'
import sys; sys.path.insert(0, "benchmarks")
from pathlib import Path
import bench_load as b
src = {n: p for n, p, _ in b.CORPUS}
b.tile(b.corpus_source(src["pp2_1f1b_r0"]), Path("/tmp/tiles"), "pp2_1f1b_r0", 200)
PY
taskset -c 2 python3 - <<'PY' 2>&1 | tee $OUT/micro.txt
import time, hashlib, mmap, os, zlib
from tracelens.io import scanner
p = "/tmp/tiles/pp2_1f1b_r0-200MB/rank0.json"
def t(f, n=3):
    r = []
    for _ in range(n):
        s = time.perf_counter(); f(); r.append(time.perf_counter() - s)
    return round(sorted(r)[n // 2], 3)
def scan_map(): m = scanner.map_file(p); scanner.Scan(m).run(threads=1)
def scan_bytes(): d = open(p, "rb").read(); scanner.Scan(d).run(threads=1)
data = open(p, "rb").read()
def scan_held(): scanner.Scan(data).run(threads=1)
print("scan from mmap", t(scan_map)); print("scan from read()", t(scan_bytes)); print("scan of bytes held", t(scan_held))
print("read() 200 MB", t(lambda: open(p, "rb").read()))
def touch_map():
    with open(p, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        s = 0
        for i in range(0, len(m), 4096): s += m[i]
print("fault every page of a map", t(touch_map))
for name in ("sha256", "blake2b", "sha1", "md5"):
    print(name, t(lambda: hashlib.new(name, data).digest()))
try:
    import xxhash; print("xxh3_128", t(lambda: xxhash.xxh3_128(data).digest()), xxhash.VERSION)
except ImportError as e: print("xxhash", e)
print("crc32", t(lambda: zlib.crc32(data)))
PY
