#!/usr/bin/env bash
# Issue 20 on the device machine's CPU in one call: the bounded-memory runs (bench_big.sh: 2 GB x3 and
# 8 GB, analysis pinned to cores 2,3) and the 200 MB corpus (bench_corpus.sh) in TRACE_GROUPS of traces run side
# by side, each group pinned to its own pair of the remaining cores (4,5 / 6,7 / ...), HTA and tracelens
# on the same pair. Side by side, the groups share the memory bus and the last-level cache: a trace's
# ratio is still HTA's time over tracelens' on the same two cores in the same minutes. Results in
# $OUT/big/ and $OUT/corpus-g<N>/.
#
#   bash benchmarks/bench_device_cpu.sh        carry: [".whl", "bench_data/external"] (see bench_corpus.sh)
#   TRACE_GROUPS="pp2_1f1b_r0 v100_test" BIG=0 bash benchmarks/bench_device_cpu.sh    # corpus only
set -u
OUTDIR=${OUT:-/tmp/tracelens-device-cpu}
BIG=${BIG:-1}
BIG_CPUS=${BIG_CPUS:-0-3}  # the big runs' tiling uses these; their analysis is pinned to CPUS (bench_big.sh: 2,3)
FIRST_CORE=${FIRST_CORE:-4}  # the corpus groups take pairs from here on
TRACE_GROUPS=${TRACE_GROUPS:-"pp2_1f1b_r0,moe_loop v100_test,moe_grouped mi300_sglang,ep2_loop_r0 h100_owlv2,a100_control,cpu_tiny a100_alexnet,mi250 mi300_resnet,b200_eager,h100_timesformer"}
export PYTHONUNBUFFERED=1
mkdir -p "$OUTDIR"
if ! python3 -c "import msgspec, hta" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl .whl/bench/*.whl || { echo "wheel install failed" >&2; exit 9; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c "import tracelens.io._kineto_fast" 2>/dev/null || python3 setup.py -q build_ext --inplace >/dev/null 2>&1 || true
# bytecode as an installed Python has it: with PYTHONDONTWRITEBYTECODE set (the device image sets it) and
# packages installed without it, every fresh process compiles pandas, numpy, pyarrow, HTA and tracelens from
# source (~1 s, the same for both tools, a third of a 200 MB run of tracelens). So bytecode is written once,
# under PYTHONPYCACHEPREFIX, for those packages and the wheels' (both tools alike), then read by every run.
. benchmarks/bytecode.sh
pids=()
if [ "$BIG" = 1 ]; then
  (OUT=$OUTDIR/big taskset -c "$BIG_CPUS" bash benchmarks/bench_big.sh > "$OUTDIR/big.log" 2>&1) &
  pids+=($!)
fi
c=$FIRST_CORE
g=0
for only in $TRACE_GROUPS; do
  (OUT=$OUTDIR/corpus-g$g WORK=/tmp/tracelens-corpus-g$g CPUS=$c,$((c + 1)) ONLY=$only REPEAT=${CORPUS_REPEAT:-3} bash benchmarks/bench_corpus.sh \
     > "$OUTDIR/corpus-g$g.log" 2>&1) &
  pids+=($!)
  c=$((c + 2)); g=$((g + 1))
done
wait "${pids[@]}"
cat "$OUTDIR"/big/*.txt 2>/dev/null | tail -20
grep -h "x \|ratio\|peak" "$OUTDIR"/corpus-g*/corpus.txt 2>/dev/null | tail -40
