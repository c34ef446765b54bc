#!/bin/bash
# issue 37's first item, the whole corpus (20 traces at 200 MB) at one code state, in two device calls of ~5 minutes
# (stop 33's single call, full.sh, ran past the 10-minute limit with three traces left): PART=1 or PART=2, each four
# groups side by side on CPUs 2,3 / 6,7 / 10,11 / 14,15 of one 16-CPU host, `tracelens analyze` and HTA 0.5.0 in
# each group's minutes, medians of 3. HTA stops at HTA_TIMEOUT s (60): a100_triton and mi250 reach it, so their
# ratios are lower bounds (our command takes 2-6 s on them). Carry [".whl/c31"]; rows in $OUT/g<k>/corpus.txt.
set -u
S=/tmp/s33s; mkdir -p $S
[ -d /tmp/site31 ] || tar -C /tmp -xJf .whl/c31/site.tar.xz; export PYTHONPATH=/tmp/site31
export TRACELENS_CORPUS_EXTERNAL=$PWD/.whl/c31/ext
python3 setup.py -q build_ext --inplace > $S/build.log 2>&1
. benchmarks/bytecode.sh  # once, before the groups
if [ "${PART:-1}" = 1 ]; then
  G=("a100_triton,moe_loop" "mi250,moe_grouped" "ep2_loop_r0,pp2_1f1b_r0,a100_control" "v100_test,a100_alexnet,mi300_resnet")
else
  G=("mi300_sglang,b200_eager,h100_owlv2" "h100_timesformer,cpu_tiny,h100_moe_mbs8" "ep4_cap_ovl_r0,pp4_1f1b_r0"
     "ep4_mbs16_r0,dp4_mbs16_r0")
fi
CPUSETS=(2,3 6,7 10,11 14,15)
ROOT_OUT=$OUT
for k in 0 1 2 3; do
  OUT=$ROOT_OUT/g$((k + 1)) WORK=/tmp/tracelens-corpus-g$k ONLY=${G[$k]} CPUS=${CPUSETS[$k]} REPEAT=3 \
    EXTRA="--api-repeat 1 --hta-timeout ${HTA_TIMEOUT:-60}" timeout ${LIMIT:-540} bash benchmarks/bench_corpus.sh \
    > $S/log$k 2>&1 &
done
wait
for k in 0 1 2 3; do sed -n '/^trace/,$p' $S/log$k | grep -v "^CLI:" | tail -6; done
