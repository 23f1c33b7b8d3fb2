#!/usr/bin/env bash
# One device call: Nsight Compute on the kernels of `benchmarks.stall_profile` (ours and cuDNN's
# forward + backward, and the fused dK/dV/dQ kernel) at NCU_ARGS' shape (default d128 N 4096).
# First a cheap pass (names and durations of LIST_COUNT launches matching LIST_KERNELS; SKIP_LIST=1
# leaves it out), then NCU_SET's sections on NCU_COUNT launches matching NCU_KERNELS after the
# first NCU_SKIP; reports and their text pages land in $OUT (NCU_SOURCE=1: the SASS source page
# too). Clocks left alone.
set -u
# No preallocation: the profiler saves and restores the device memory in use around each replay.
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}
uname -r
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: ${NCU:-none}"
[ -n "$NCU" ] || exit 1
KERNELS=${NCU_KERNELS:-'regex:mosaic_gpu|sdpa|fmha|flash|prop'}
ARGS=${NCU_ARGS:-"--head-dim 128 --seq 4096"}
if [ -z "${SKIP_LIST:-}" ]; then
# shellcheck disable=SC2086
timeout "${LIST_TIMEOUT:-200}" "$NCU" --clock-control none -k "${LIST_KERNELS:-$KERNELS}" \
  --metrics gpu__time_duration.sum -c "${LIST_COUNT:-30}" python3 -m benchmarks.stall_profile $ARGS \
  >"$OUT/list.txt" 2>&1
echo "list exit $?"
grep -E '^  [^ ].*\(|gpu__time_duration|^ran|rror' "$OUT/list.txt" | cut -c1-150 | tail -${LIST_LINES:-60}
fi
# shellcheck disable=SC2086
timeout "${PROF_TIMEOUT:-300}" "$NCU" --clock-control none -k "$KERNELS" \
  --set "${NCU_SET:-full}" --launch-skip "${NCU_SKIP:-0}" -c "${NCU_COUNT:-12}" -o "$OUT/prof" \
  python3 -m benchmarks.stall_profile $ARGS >"$OUT/prof.log" 2>&1
echo "prof exit $?"
tail -5 "$OUT/prof.log"
"$NCU" -i "$OUT/prof.ncu-rep" --page details --print-details all >"$OUT/details.txt" 2>&1
"$NCU" -i "$OUT/prof.ncu-rep" --page raw --csv >"$OUT/raw.csv" 2>&1
# NCU_SOURCE=1: the per-SASS-instruction counters (stall reasons by offset) of every profiled
# kernel, gzipped.
if [ -n "${NCU_SOURCE:-}" ]; then
  "$NCU" -i "$OUT/prof.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip >"$OUT/source.csv.gz"
fi
ls -la "$OUT"
