#!/usr/bin/env bash
# Issues 20 and 37's corpus benchmark on the device machine's CPU (16 quiet cores; the issues' number of record):
# benchmarks/bench_load.py --corpus pinned to 2 cores (CPUS, default 2,3) for tracelens and HTA alike: per trace
# `tracelens analyze TRACE -o OUT` as users run it (fresh process, empty cache dir, report + tables + summary.json;
# the acceptance measure), the API path (load + analyze + summary) and HTA, medians of REPEAT (3), in groups of
# traces that fit a 10-minute call (ONLY: comma-separated corpus names, default all 20; ~60-70 s a trace with
# HTA, a100_triton's HTA stops at the 120 s timeout). Writes corpus.txt / corpus.json into $OUT; tiled traces in
# WORK (default /tmp/tracelens-corpus). The 20 names, in bench_load.py's CORPUS order:
#   moe_loop moe_grouped ep2_loop_r0 pp2_1f1b_r0 a100_control v100_test a100_alexnet mi250 mi300_resnet
#   mi300_sglang b200_eager h100_owlv2 h100_timesformer cpu_tiny h100_moe_mbs8 ep4_cap_ovl_r0 pp4_1f1b_r0
#   ep4_mbs16_r0 dp4_mbs16_r0 a100_triton
#
# The device copy of the repository has no ../shared, so carry a copy of the external fixtures and the
# benchmark wheels (both git-ignored):
#   cp -r ../shared/fixtures/external bench_data/external
#   pip download --no-deps -d .whl/bench HolisticTraceAnalysis==0.5.0 networkx pydot pyparsing psutil \
#       --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64
#   run: ONLY=moe_loop,moe_grouped,... bash benchmarks/bench_corpus.sh      carry: [".whl", "bench_data/external"]
# EXTRA: more bench_load.py arguments, e.g. EXTRA="--compare-root bench_data/before" with an older checkout's
# tracelens, reports and moespec there (`git archive REV tracelens reports moespec setup.py pyproject.toml`, its
# scanner built in place): its CLI runs alternately with this one's, as "before"
set -u
CPUS=${CPUS:-2,3}
ONLY=${ONLY:-}
REPEAT=${REPEAT:-3}
WORK=${WORK:-/tmp/tracelens-corpus}
OUTDIR=${OUT:-/tmp/tracelens-corpus/out}
export PYTHONUNBUFFERED=1
mkdir -p "$OUTDIR"
if ! python3 -c "import msgspec, hta" 2>/dev/null; then
  ls .whl/*.whl .whl/bench/*.whl >/dev/null 2>&1 || { echo "bench_corpus.sh: no wheels in .whl/ and .whl/bench/" >&2; exit 9; }
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
[ -d bench_data/external ] && export TRACELENS_CORPUS_EXTERNAL=${TRACELENS_CORPUS_EXTERNAL:-$PWD/bench_data/external}
{ echo "== $(date -u) host=$(hostname) cpus=$CPUS only=${ONLY:-all}"; nproc; python3 -c "import sys, pandas, numpy; print(sys.version.split()[0], 'pandas', pandas.__version__, 'numpy', numpy.__version__)"
  taskset -c "$CPUS" python3 benchmarks/host_speed.py; } | tee "$OUTDIR/env.txt"  # (the host's speed: hosts differ)
taskset -c "$CPUS" python3 benchmarks/bench_load.py --corpus ${ONLY:+--only "$ONLY"} --repeat "$REPEAT" \
  --work "$WORK" --hta-timeout 120 --json "$OUTDIR/corpus.json" ${EXTRA:-} 2>&1 | tee "$OUTDIR/corpus.txt"
