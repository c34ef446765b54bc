#!/bin/bash
# stop 30, issue 37: the 15 corpus traces not yet measured under the CLI measure, 4 streams side by side
set -u
S=/tmp/s30; mkdir -p $S
mkdir -p /tmp/w && tar -C /tmp/w -xJf .whl/c30x/wheels.tar.xz && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/w/*.whl > $S/pip.log 2>&1 || { cat $S/pip.log; exit 9; }
mkdir -p /tmp/ext bench_data/ext30 && tar -C /tmp/ext -xJf .whl/c30x/ext.tar.xz && for f in /tmp/ext/tracelens/*.json; do mkdir -p bench_data/ext30/tracelens; gzip -1 -c $f > bench_data/ext30/tracelens/$(basename $f).gz; done
export PYTHONPATH=/tmp/site
export TRACELENS_CORPUS_EXTERNAL=$PWD/bench_data/ext30
python3 setup.py -q build_ext --inplace > $S/build.log 2>&1
{ ls tracelens/io/*.so tracelens/analysis/*.so; lscpu | grep "Model name"; nproc; } > $OUT/env.txt 2>&1
. benchmarks/bytecode.sh
i=0
for spec in "2,3:pp2_1f1b_r0,a100_control,h100_owlv2,b200_eager" "6,7:mi300_sglang,v100_test,a100_alexnet,h100_timesformer" \
            "10,11:mi300_resnet,ep2_loop_r0,moe_loop,cpu_tiny" "14,15:a100_triton,mi250,moe_grouped"; do
  i=$((i+1)); cpus=${spec%%:*}; only=${spec#*:}
  setsid nohup bash -c "OUT=$S/s$i WORK=/tmp/tc$i ONLY=$only CPUS=$cpus bash benchmarks/bench_corpus.sh > $S/s$i.log 2>&1; touch $S/s$i.done" < /dev/null > /dev/null 2>&1 &
done
end=$(( $(date +%s) + ${WAIT:-560} ))
while [ $(date +%s) -lt $end ] && [ $(ls $S/*.done 2>/dev/null | wc -l) -lt 4 ]; do sleep 5; done
for i in 1 2 3 4; do echo "== stream $i"; [ -f $S/s$i.done ] || echo "(not done)"; sed -n '/^trace/,$p' $S/s$i.log | tail -8; cp $S/s$i/corpus.json $OUT/corpus$i.json 2>/dev/null; done > $OUT/all.txt
cat $OUT/all.txt
