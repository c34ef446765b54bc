#!/bin/bash
# stop 32, issue 37: traces of the corpus alone on CPUs 2,3 (K: which, comma-separated), HTA 0.5.0 in the same run,
# medians of REPEAT (4), the API path once (its events / steps / GPU time), with the session's starting commit
# (01a5bc4, `git archive` into bench_data/b32; its scanner built here) as "before", alternating with this tree's CLI.
set -u
S=/tmp/s32r; mkdir -p $S
tar -C /tmp -xJf .whl/c31/site.tar.xz && export PYTHONPATH=/tmp/site31
export TRACELENS_CORPUS_EXTERNAL=$PWD/.whl/c31/ext
python3 setup.py -q build_ext --inplace > $S/build.log 2>&1
(cd bench_data/b32 && python3 setup.py -q build_ext --inplace > $S/build_before.log 2>&1)
python3 -c "import xxhash, msgspec, hta, plotly; print('xxhash', xxhash.VERSION)" > $OUT/deps.txt 2>&1
OUT=$OUT/alone ONLY=${K:-h100_owlv2,mi300_sglang,pp2_1f1b_r0,b200_eager} CPUS=2,3 REPEAT=${REPEAT:-4} \
  EXTRA="--compare-root bench_data/b32 --api-repeat 1" timeout ${LIMIT:-540} bash benchmarks/bench_corpus.sh > $S/log 2>&1
sed -n '/^trace/,$p' $S/log | tail -14
