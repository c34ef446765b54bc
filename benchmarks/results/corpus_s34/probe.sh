#!/bin/bash
# stop 34, issue 37: why our command takes ~1.8x the dev machine's time on the device's CPU. One call: the 200 MB
# mi300_sglang and b200_eager tiles built, then on CPUs 2,3 (a) io_probe.py (what a page costs here), (b) phases.py
# on each tile with the default, TRACELENS_NO_MMAP=1, one scan thread, and glibc's malloc on huge pages, three runs
# each, alternating. Carry [".whl/c31"]; lines in $OUT/probe.txt.
set -u
S=/tmp/s34p; OUT=${OUT:-/tmp/s34out}; mkdir -p $OUT; mkdir -p $S
SITE=${SITE:-/tmp/site31}; [ -d $SITE ] || tar -C /tmp -xJf .whl/c31/site.tar.xz; export PYTHONPATH=$SITE
export TRACELENS_CORPUS_EXTERNAL=$PWD/.whl/c31/ext
python3 setup.py -q build_ext --inplace > $S/build.log 2>&1
. benchmarks/bytecode.sh
W=/tmp/s34w
taskset -c ${TCPUS:-8-15} python3 benchmarks/bench_load.py --corpus --only mi300_sglang,b200_eager --no-hta --repeat 1 --api-repeat 1 \
  --work $W > $S/tile.log 2>&1
R=$OUT/probe.txt
{ cat /sys/kernel/mm/transparent_hugepage/enabled 2>&1; ldd --version | head -1; uname -r; } > $R
for k in mi300_sglang b200_eager; do
  T=$W/$k-200MB/rank0.json
  echo "== io_probe $k" >> $R
  taskset -c ${PCPUS:-2,3} python3 benchmarks/results/corpus_s34/io_probe.py $T >> $R 2>&1
  for i in $(seq ${RUNS:-3}); do
    for v in default nommap scan1 hugetlb; do
      case $v in
        default) E="";; nommap) E="TRACELENS_NO_MMAP=1";; scan1) E="TRACELENS_SCAN_THREADS=1";;
        hugetlb) E="GLIBC_TUNABLES=glibc.malloc.hugetlb=1";;
      esac
      rm -rf $S/o $S/c
      echo "== $k $v run $i" >> $R
      env $E TRACELENS_CACHE_DIR=$S/c taskset -c ${PCPUS:-2,3} python3 benchmarks/rusage.py run -- \
        python3 benchmarks/results/corpus_s32/phases.py analyze $T -o $S/o -q 2>&1 | grep -E "^PHASE|^run" \
        | grep -v "scan start" >> $R
    done
  done
done
python3 - $R <<'PY'
import re, sys, collections, statistics
rows = collections.defaultdict(list); cur = None
for line in open(sys.argv[1]):
    m = re.match(r"== (\S+) (\S+) run", line)
    if m: cur = m.groups(); continue
    m = re.match(r"run rc \S+ wall (\S+) user (\S+) sys (\S+) rss_mb (\S+) minflt (\S+)", line)
    if m and cur: rows[cur].append(tuple(float(x) for x in m.groups()))
for (k, v), rs in sorted(rows.items()):
    med = [statistics.median(r[i] for r in rs) for i in range(5)]
    print(f"{k:14s} {v:8s} wall {med[0]:.2f} user {med[1]:.2f} sys {med[2]:.2f} rss {med[3]:.0f} MiB minflt {med[4]:.0f}  (walls {[r[0] for r in rs]})")
PY
