#!/usr/bin/env bash
# One device call on the H200: the `gpu` tests, then the benchmark sweep; logs and results go to
# $OUT. Needs the tokamax wheels copied to .whl/tokamax/ (ignored by git; carried by the call).
#   run: bash scripts/h200_session.sh [benchmark args...]
set -u
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl/tokamax/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/tokamax/*.whl \
    >"$OUT/pip.log" 2>&1 || echo "tokamax install failed (see pip.log)"
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv
# Tests: 8 processes share the GPU (compilation is CPU-bound), so no up-front allocation.
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${TEST_TIMEOUT:-200}" \
  python3 -m pytest -m gpu -n 8 -q -p no:cacheprovider tests/test_mosaic_gpu.py 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -15
timeout "${BENCH_TIMEOUT:-340}" python3 -m benchmarks.run --out "$OUT/h200.jsonl" "$@" 2>&1 \
  | tee "$OUT/bench.log" | tail -70
