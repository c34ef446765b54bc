#!/bin/bash
# stop 30, issue 37: the lowest of the 4-stream call, alone on CPUs 2,3 (nothing else running)
set -u
S=/tmp/s30a; mkdir -p $S
mkdir -p /tmp/w && tar -C /tmp/w -xJf .whl/c30x/wheels.tar.xz && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/w/*.whl > $S/pip.log 2>&1 || { cat $S/pip.log; exit 9; }
mkdir -p /tmp/ext bench_data/ext30/tracelens && tar -C /tmp/ext -xJf .whl/c30x/ext.tar.xz && for f in /tmp/ext/tracelens/*.json; do gzip -1 -c $f > bench_data/ext30/tracelens/$(basename $f).gz; done
export PYTHONPATH=/tmp/site TRACELENS_CORPUS_EXTERNAL=$PWD/bench_data/ext30
python3 setup.py -q build_ext --inplace > $S/build.log 2>&1
OUT=$OUT/alone ONLY=${K:-pp2_1f1b_r0,b200_eager,mi300_sglang,h100_owlv2} CPUS=2,3 timeout 560 bash benchmarks/bench_corpus.sh > $S/log 2>&1
sed -n '/^trace/,$p' $S/log | tail -12
