#!/usr/bin/env bash
# One device call on the H200: the benchmark sweep with the pipelined compile pre-pass (worker
# processes build the autotuning compiles first, a few at once, while the others build the
# kernels from the start and on while one process times, all handing their executables over),
# measuring only what the committed results file does not hold yet (--resume; rows recorded as
# skipped are measured again).
#   run: bash scripts/h200_sweep.sh [more benchmarks.run args...]
# --resume reads the measurements already made from --out and appends to it, so the script starts
# from a copy of benchmarks/results/h200.jsonl in $OUT: the file that comes back is the committed
# file plus this call's rows. Merge it by copying it over benchmarks/results/h200.jsonl (the report
# keeps the last row of each measurement), and call again while the summary reports skipped ones.
# Needs the tokamax wheels in .whl/tokamax/ (ignored by git; carried by the call) or
# shared/wheels/tokamax/.
# Environment:
#   SHAPES (presets, default full), BUDGET (--time-budget, s, default 480: the pre-pass and the
#   timing together), COMPILE_PROCESSES (default benchmarks.run's: cores - 1),
#   DEVICE_COMPILE_PROCESSES (--device-compile-processes: of those, how many autotune on the GPU
#   at once before timing starts; default benchmarks.run's: 3, as more time-slice the one GPU
#   and each compile gets slower; the others build kernels from the start, until --time-budget),
#   PIPELINE=0 (--no-compile-pipeline: every compile before anything is timed, as in session 4),
#   COMPILE_BUDGET (s, default half of BUDGET), JAX_CACHE (the cache, default
#   /tmp/pallas_attn_jax_cache: kept while the machine stays warm, so a second call loads the
#   first one's compiles), HARD_TIMEOUT (s, default 575; a device call ends at 600),
#   FRESH=1 (measure everything again, appending a new run to the copy instead of --resume: what
#   the "full sweep in a few minutes" claim is timed with).
set -u
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
wheels=$(ls .whl/tokamax/*.whl shared/wheels/tokamax/*.whl 2>/dev/null)
if [ -n "$wheels" ]; then
  # shellcheck disable=SC2086
  python3 -m pip install -q --no-index --no-deps --target /tmp/site $wheels \
    >"$OUT/pip.log" 2>&1 || echo "tokamax install failed (see pip.log)"
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv
nproc
cp benchmarks/results/h200.jsonl "$OUT/h200.jsonl"
start=$(date +%s)
# shellcheck disable=SC2086
mode=--resume
[ "${FRESH:-0}" = 1 ] && mode=--append
timeout "${HARD_TIMEOUT:-575}" python3 -m benchmarks.run $mode --out "$OUT/h200.jsonl" \
  --shapes "${SHAPES:-full}" --time-budget "${BUDGET:-480}" \
  --compile-cache "${JAX_CACHE:-/tmp/pallas_attn_jax_cache}" \
  ${COMPILE_PROCESSES:+--compile-processes $COMPILE_PROCESSES} \
  ${DEVICE_COMPILE_PROCESSES:+--device-compile-processes $DEVICE_COMPILE_PROCESSES} \
  ${COMPILE_BUDGET:+--compile-budget $COMPILE_BUDGET} \
  $([ "${PIPELINE:-1}" = 0 ] && echo --no-compile-pipeline) "$@" >"$OUT/bench.log" 2>&1
echo "benchmarks.run exit $? after $(( $(date +%s) - start )) s"
grep -v "Autotuning cache miss\|cuda_timer" "$OUT/bench.log" | tr '\r' '\n' \
  | grep -v "call/s\]\|s/call\]" | grep "compile pre-pass" | head -40
grep -v "Autotuning cache miss\|cuda_timer" "$OUT/bench.log" | tr '\r' '\n' \
  | grep -v "call/s\]\|s/call\]" | tail -60
# What this call measured and what is still left (rows recorded as skipped).
python3 - benchmarks/results/h200.jsonl "$OUT/h200.jsonl" <<'EOF'
import sys
from benchmarks import report
before = {r.get("run_id") for r in report.load(sys.argv[1])}
new = [r for r in report.load(sys.argv[2])
       if r.get("kind") == "attention" and r.get("run_id") not in before]
built = [r for r in new if r.get("compile_s") is not None]
print(f"this call: {len(new)} rows, {sum(r['error'] is None for r in new)} measured, "
      f"{sum(r.get('error_kind') == 'skipped' for r in new)} skipped; "
      f"{sum(bool(r.get('cache_hit')) for r in built)} of {len(built)} builds from the cache, "
      f"{sum(r['compile_s'] for r in built):.0f} s building "
      f"({sum(r.get('lower_s') or 0 for r in built):.0f} s lowering), "
      f"{sum(r.get('measure_s') or 0 for r in built):.0f} s measuring")
# Rows whose repeats spread by over 10% (a disturbed measurement; benchmarks/NOTES.md session 13).
noisy = report.disturbed(new)
print(f"repeats spread > 10%: {len(noisy)} rows")
for r in noisy[:20]:
  print(f"  {r['implementation']} {r['pass']} d{r['head_dim']} N{r['seq_q']} "
        f"{'causal ' if r['causal'] else ''}ms {min(r['repeat_ms']):.3f}..{max(r['repeat_ms']):.3f}")
EOF
