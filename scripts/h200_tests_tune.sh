#!/usr/bin/env bash
# One device call: the `gpu` tests selected by TEST_K over TEST_SELECT, then benchmarks/tune.py
# (TUNE_ARGS, then TUNE_ARGS2 if set), logs to $OUT. Needs nothing beyond the repository (no
# tokamax). The whole suite (TEST_SELECT=tests TEST_K="not 30001 and not 32768") took ~10 min at 12
# workers in session 23, more than one call's 600 s beside a tuner run: split it (a -k per file, or
# the node ids not reached, through xargs) over two calls.
set -u
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv
if [ -n "${TEST_SELECT:-}" ]; then
  # shellcheck disable=SC2086
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${TEST_TIMEOUT:-240}" \
    python3 -m pytest -o addopts="" -m gpu -n "${TEST_WORKERS:-12}" -v -p no:cacheprovider \
    --timeout="$(( ${TEST_TIMEOUT:-240} - 15 ))" --timeout-method=thread \
    ${TEST_K:+-k "$TEST_K"} $TEST_SELECT >"$OUT/gpu_tests.log" 2>&1
  grep -E "PASSED|FAILED|ERROR|Timeout|passed|failed" "$OUT/gpu_tests.log" | sed 's/ *\[ *[0-9]*%\]//' \
    | grep -v PASSED | tail -30
  echo "passed: $(grep -c PASSED "$OUT/gpu_tests.log")"
fi
# TUNE_ARGS, then TUNE_ARGS2 (a second tuner run: other variants on other shapes), each within
# TUNE_TIMEOUT seconds.
for n in "" 2; do
  args_var="TUNE_ARGS$n"
  if [ -n "${!args_var:-}" ]; then
    # shellcheck disable=SC2086
    timeout "${TUNE_TIMEOUT:-300}" python3 -m benchmarks.tune ${!args_var} \
      --out "$OUT/tune$n.jsonl" >"$OUT/tune$n.log" 2>&1
    grep -v "Autotuning cache miss\|cuda_timer" "$OUT/tune$n.log" | tail -60
  fi
done
