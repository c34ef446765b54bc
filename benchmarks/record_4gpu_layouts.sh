#!/usr/bin/env bash
# Record the held-out 4-GPU layout space of issue 35 (autotune/spaces/gpu_layout4.yaml: ep x micro-batch x dispatch,
# 18 profiled trials of gpu_proxy_train) with benchmarks/bench_autotune.py: the grid, then the guided search replayed
# from the grid's measurements, and the what-if's accuracy from the space's baseline. Resumable: a device call is
# at most 10 minutes, so STOP_AFTER starts no trial past that many seconds and the next call goes on where it stopped.
# Every call leaves the whole grid so far (stores, manifests, traces; no logs) in $OUT as layouts.tgz.part-* (the
# device tool returns files of at most 16 MiB): `cat layouts.tgz.part-* | tar -xz` gives grid/ and guided/.
#
#   on a 4-GPU machine, from the checkout (carry: [".whl"]):
#     STOP_AFTER=420 bash benchmarks/record_4gpu_layouts.sh      # again until it prints "grid complete"
#   then the cross-layout predictions from two of its trials (the DP and the EP baseline):
#     python benchmarks/layouts_from_sweep.py WORK/grid -o measured.json && python benchmarks/bench_whatif_layouts.py measured.json
set -u
source "$(dirname "$0")/gpu_env.sh"
OUTDIR=${OUT:-/tmp/tracelens-layouts}
WORK=${WORK:-/tmp/tracelens-layouts-runs}
mkdir -p "$OUTDIR" "$WORK"
ls tracelens/*.so >/dev/null 2>&1 || python3 setup.py -q build_ext --inplace > "$OUTDIR/build.log" 2>&1 \
  || echo "C scanner not built: $(tail -1 "$OUTDIR/build.log")"
resume=""
[ -d "$WORK/grid" ] && resume=--resume
t0=$(date +%s)
# shellcheck disable=SC2086
timeout "${TIMEOUT:-3600}" python3 benchmarks/bench_autotune.py --config gpu_layout4 --out "$WORK" $resume \
  --tolerance 0.05 --max-share 0.25 --accuracy ${STOP_AFTER:+--stop-after "$STOP_AFTER"} >> "$OUTDIR/layouts.log" 2>&1
rc=$?
echo "bench_autotune: exit $rc in $(( $(date +%s) - t0 )) s ($([ $rc = 0 ] && echo 'grid complete' || echo 'resume to go on'))"
grep -E "^\[autotune\] trial .* ->|^(grid|guided)|predicted|prediction" "$OUTDIR/layouts.log" | cut -c1-220 | tail -60
rm -f "$OUTDIR"/layouts.tgz.part-*
tar -C "$WORK" -czf - --exclude=logs --exclude='*.log' . | split -b 15m - "$OUTDIR/layouts.tgz.part-"
ls -la "$OUTDIR"
