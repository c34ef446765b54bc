#!/bin/bash
# stop 32, issue 37: the whole corpus (20 traces at 200 MB) in one call, four groups side by side on CPUs 2,3 / 6,7 /
# 10,11 / 14,15 of one 16-CPU host (as stop 30), each trace's CLI and HTA 0.5.0 in its group's minutes, medians of 3,
# the API path once. Groups balanced by expected minutes (HTA stops at 120 s on a100_triton and mi250).
set -u
S=/tmp/s32f; mkdir -p $S
tar -C /tmp -xJf .whl/c31/site.tar.xz && export PYTHONPATH=/tmp/site31
export TRACELENS_CORPUS_EXTERNAL=$PWD/.whl/c31/ext
python3 setup.py -q build_ext --inplace > $S/build.log 2>&1
python3 -c "import xxhash, msgspec, hta, plotly; print('xxhash', xxhash.VERSION)" > $OUT/deps.txt 2>&1
. benchmarks/bytecode.sh  # once, before the four groups (each would compile the same trees at once)
G1=a100_triton,moe_loop,moe_grouped,h100_timesformer
G2=mi250,ep2_loop_r0,pp2_1f1b_r0,v100_test,a100_control
G3=h100_moe_mbs8,ep4_cap_ovl_r0,a100_alexnet,mi300_resnet,mi300_sglang,cpu_tiny
G4=pp4_1f1b_r0,ep4_mbs16_r0,dp4_mbs16_r0,b200_eager,h100_owlv2
k=0
for spec in "2,3:$G1" "6,7:$G2" "10,11:$G3" "14,15:$G4"; do
  k=$((k + 1)); cpus=${spec%%:*}; only=${spec#*:}
  OUT=$OUT/g$k WORK=/tmp/tracelens-corpus-g$k ONLY=$only CPUS=$cpus REPEAT=3 EXTRA="--api-repeat 1" \
    timeout ${LIMIT:-545} bash benchmarks/bench_corpus.sh > $S/log$k 2>&1 &
done
wait
for k in 1 2 3 4; do sed -n '/^trace/,$p' $S/log$k | grep -v "^CLI:" | tail -9; done
