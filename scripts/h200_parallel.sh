#!/usr/bin/env bash
# One device call on a 2-GPU machine (nvidia-h200-x2): two jobs at once, one per GPU, so that one
# call's device time does twice the work (e.g. the benchmark sweep on GPU 0 while the `gpu` tests
# run on GPU 1). Each job is a bash command line, run from the repository root with
# CUDA_VISIBLE_DEVICES set to its GPU and JOB_OUT set to its own folder. tokamax is installed once
# first (from .whl/tokamax/, carried). Everything the jobs write under JOB_OUT comes back packed in
# $OUT/gpu0.tgz and $OUT/gpu1.tgz (the device tool returns at most 8 files), with each job's
# console output in $OUT/gpuN.log.
#   run: JOB0='...' JOB1='...' bash scripts/h200_parallel.sh
# Several processes compile at once: XLA_PYTHON_CLIENT_PREALLOCATE=false lets them share a GPU.
set -u
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl/tokamax/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/tokamax/*.whl \
    >"$OUT/pip.log" 2>&1 || echo "tokamax install failed (see pip.log)"
fi
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.mem,temperature.gpu --format=csv
for gpu in 0 1; do
  job_var="JOB$gpu"
  [ -n "${!job_var:-}" ] || continue
  mkdir -p "/tmp/job$gpu"
  (CUDA_VISIBLE_DEVICES=$gpu JOB_OUT=/tmp/job$gpu bash -c "${!job_var}" >"$OUT/gpu$gpu.log" 2>&1;
   echo "job $gpu exit $?" >>"$OUT/gpu$gpu.log") &
done
wait
for gpu in 0 1; do
  [ -d "/tmp/job$gpu" ] && tar -C "/tmp/job$gpu" -czf "$OUT/gpu$gpu.tgz" .
  [ -f "$OUT/gpu$gpu.log" ] && { echo "=== gpu $gpu"; grep -v "Autotuning cache miss\|cuda_timer" \
    "$OUT/gpu$gpu.log" | tail -30; }
done
