#!/bin/bash
# stop 33, issue 37, one call: (A) the lowest traces of the corpus alone on CPUs 2,3 (K), HTA 0.5.0 in the same run,
# medians of REPEAT (3), the stop's start (23dc04b: `git archive` into bench_data/b33, its scanner built here) as
# "before", alternating; (B) beside it, the 2 GB tiles (BIG: corpus names) built on CPUs 8-15 and analyzed on CPUs
# 6,7 (big.sh, two runs each, phases of a third).
set -u
S=/tmp/s33f; mkdir -p $S
tar -C /tmp -xJf .whl/c31/site.tar.xz && export PYTHONPATH=/tmp/site31
export TRACELENS_CORPUS_EXTERNAL=$PWD/.whl/c31/ext
python3 setup.py -q build_ext --inplace > $S/build.log 2>&1
(cd bench_data/b33 && python3 setup.py -q build_ext --inplace > $S/build_before.log 2>&1)
ROOT_OUT=$OUT
mkdir -p $ROOT_OUT/big
git log --oneline -1 > $ROOT_OUT/rev.txt 2>/dev/null
(OUT=$ROOT_OUT/big K=${BIG:-a100_triton,h100_moe_mbs8} CPUS=6,7 TILE_CPUS=8-15 PHASES=1 \
  timeout ${LIMIT:-540} bash benchmarks/results/corpus_s33/big.sh > $S/big.log 2>&1) &
OUT=$ROOT_OUT/alone ONLY=${K:-b200_eager,mi300_sglang,v100_test,h100_owlv2} CPUS=2,3 REPEAT=${REPEAT:-3} \
  EXTRA="--compare-root bench_data/b33 --api-repeat 1" timeout ${LIMIT:-540} bash benchmarks/bench_corpus.sh > $S/log 2>&1
wait
sed -n '/^trace/,$p' $S/log | tail -10
cat $ROOT_OUT/big/big.txt
