#!/usr/bin/env bash
# Record the 4-GPU NCCL run dirs the analyzer's multi-GPU tests read (issue 34; tests/fixtures/h100_4gpu/):
# the GPU proxy (DeepSeek-V2-Lite layer shapes) with expert parallelism over 4 GPUs at sync-free levels 0, 2 and 3,
# and pipeline parallelism over 4 GPUs with 1F1B and interleaved 1F1B (vpp 2). Two profiled steps each, small
# enough to commit gzipped. One tarball per run dir comes back in $OUT (the device tool returns few files).
#
#   on a 4-GPU machine, from the checkout:   bash benchmarks/record_4gpu_fixtures.sh      (carry: [".whl"])
#   ONLY="ep4_L0_loop pp4_1f1b" bash benchmarks/record_4gpu_fixtures.sh
set -u
source "$(dirname "$0")/gpu_env.sh"
OUTDIR=${OUT:-/tmp/tracelens-4gpu}
WORK=${WORK:-/tmp/tracelens-4gpu-runs}
mkdir -p "$OUTDIR" "$WORK"
python3 -c "import yaml, torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())"
NPROC=${NPROC:-4}
# two profiled steps (4, 5) after three warm-up steps; 1,024-token sequences keep each trace small
PROF="--set steps=7 --set profile_step_start=4 --set profile_step_end=5 --set timing_warmup_steps=2 --set log_every=1"
EP="--set ep=$NPROC --set n_layers=2 --set seq_len=1024 --set micro_batch_size=1 $PROF"
PP="--set pp=$NPROC --set microbatches=8 --set micro_batch_size=1 --set seq_len=1024 --set dp_mode=ddp $PROF"
declare -A RUNS=(
  [ep4_L0_loop]="$EP --sync-free-level 0 --grouped-gemm-backend loop"
  [ep4_L3_torch]="$EP --sync-free-level 3 --grouped-gemm-backend torch"
  [ep4_L2_torch]="$EP --sync-free-level 2 --grouped-gemm-backend torch"
  [pp4_1f1b]="$PP --set n_layers=4 --set pipeline_schedule=1f1b"
  [pp4_vpp2]="$PP --set n_layers=8 --set pipeline_schedule=vpp --set vpp=2"
)
for name in ${ONLY:-ep4_L0_loop ep4_L3_torch ep4_L2_torch pp4_1f1b pp4_vpp2}; do
  echo "=== $name: python -m trainer.launch --config gpu_proxy --nproc $NPROC ${RUNS[$name]}"
  t0=$(date +%s)
  # shellcheck disable=SC2086
  python3 -m trainer.launch --config gpu_proxy --nproc "$NPROC" ${RUNS[$name]} -o "$WORK/$name" > "$OUTDIR/$name.log" 2>&1
  rc=$?
  echo "$name: exit $rc in $(( $(date +%s) - t0 )) s"
  tail -3 "$OUTDIR/$name.log"
  [ -d "$WORK/$name" ] && tar -C "$WORK" -czf "$OUTDIR/$name.tgz" --exclude=logs "$name" && ls -la "$OUTDIR/$name.tgz"
done
