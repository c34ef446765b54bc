#!/bin/bash
# stop 31, issue 37: traces of the corpus alone on CPUs 2,3 (nothing else running; K: which), HTA in the same run,
# medians of 3, with the session's starting commit (add7f01, `git archive` into bench_data/before) as "before"
set -u
S=/tmp/s31r; mkdir -p $S
tar -C /tmp -xJf .whl/c31/site.tar.xz && export PYTHONPATH=/tmp/site31
export TRACELENS_CORPUS_EXTERNAL=$PWD/.whl/c31/ext
python3 setup.py -q build_ext --inplace > $S/build.log 2>&1
(cd bench_data/before && python3 setup.py -q build_ext --inplace > $S/build_before.log 2>&1)
python3 -c "import xxhash, msgspec, hta, plotly; print('xxhash', xxhash.VERSION)" > $OUT/deps.txt 2>&1
OUT=$OUT/alone ONLY=${K:-h100_owlv2,mi300_sglang,pp2_1f1b_r0,b200_eager} CPUS=2,3 EXTRA="--compare-root bench_data/before" \
  timeout ${LIMIT:-540} bash benchmarks/bench_corpus.sh > $S/log 2>&1
sed -n '/^trace/,$p' $S/log | tail -14
