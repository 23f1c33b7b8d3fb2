#!/usr/bin/env bash
# One device call on the H200: the `gpu` tests, then the benchmark sweep (and, optionally, the
# Flax example); logs and results go to $OUT. Needs the tokamax wheels copied to .whl/tokamax/
# (ignored by git; carried by the call).
#   run: bash scripts/h200_session.sh [benchmark args...]
# Environment:
#   TEST_TIMEOUT (s, default 200; 0 skips the tests), TEST_SELECT (test files, default tests/),
#   TEST_K (a pytest -k expression, default none: every `gpu` test), TEST_WORKERS (default 8),
#   BENCH_TIMEOUT (s, default 340; 0 skips the benchmark),
#   EXAMPLE_ARGS (if set: python -m examples.flax_lm $EXAMPLE_ARGS, EXAMPLE_TIMEOUT default 120).
# The full `gpu` suite compiles every kernel of ~60 cases (about 10 s each, CPU-bound): with 16
# workers it needs ~10 minutes; split it with TEST_K across calls.
set -u
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl/tokamax/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/tokamax/*.whl \
    >"$OUT/pip.log" 2>&1 || echo "tokamax install failed (see pip.log)"
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv
if [ "${TEST_TIMEOUT:-200}" != 0 ]; then
  # Several processes share the GPU (compilation is CPU-bound), so no up-front allocation. A hung
  # kernel fails its test (thread method: dumps the stacks) instead of eating the call.
  # shellcheck disable=SC2086
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${TEST_TIMEOUT:-200}" \
    python3 -m pytest -o addopts="" -m gpu -n "${TEST_WORKERS:-8}" -v -p no:cacheprovider \
    --timeout="$(( ${TEST_TIMEOUT:-200} - 20 ))" --timeout-method=thread \
    ${TEST_K:+-k "$TEST_K"} ${TEST_SELECT:-tests/} >"$OUT/gpu_tests.log" 2>&1
  grep -E "PASSED|FAILED|ERROR|Timeout|passed|failed" "$OUT/gpu_tests.log" | sed 's/ *\[ *[0-9]*%\]//' \
    | tail -40
fi
if [ "${BENCH_TIMEOUT:-340}" != 0 ]; then
  timeout "${BENCH_TIMEOUT:-340}" python3 -m benchmarks.run --out "$OUT/h200.jsonl" "$@" \
    >"$OUT/bench.log" 2>&1
  grep -v "Autotuning cache miss\|cuda_timer" "$OUT/bench.log" | tail -45
fi
if [ -n "${EXAMPLE_ARGS:-}" ]; then
  # shellcheck disable=SC2086
  timeout "${EXAMPLE_TIMEOUT:-120}" python3 -m examples.flax_lm $EXAMPLE_ARGS \
    >"$OUT/flax_lm.log" 2>&1
  tail -25 "$OUT/flax_lm.log"
fi
