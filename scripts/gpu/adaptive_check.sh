#!/usr/bin/env bash
# scripts/gpu/adaptive_check.sh — adaptive VS and BS budgets on a GPU machine (issue 16: vs_adaptive, bs_adaptive,
# pattern.h), in one device call carrying build/gpu-debs:
#   run(command="bash scripts/gpu/adaptive_check.sh", carry=["build/gpu-debs"])      (OUT is the device's $OUT)
#   1. build: configure build/cuda (the cuda preset, warnings as errors, the carried packages) and build only
#      attention_gpu_test and attention_gpu_bench (FULL_BUILD=1: scripts/gpu/check.sh BUILD_ONLY=1, all of cuda_all)
#   2. the GPU tests of the adaptive path (tests/gpu/attention_gpu_test): DeviceEstimateTest.Adaptive* (device
#      counts vs the CPU's, coverage and minimality on exact f64 sums / pooled scores, VS and BS),
#      DeviceIndexTest/EndToEndTest vs_adaptive_* and bs_adaptive_* (the index built over the padded layout equals
#      the CPU lowering; output vs the reference), DeviceLoweringOnHost (padded VS and BS lists); then the other
#      estimator / index / end-to-end cases (regressions); unless SKIP_SANITIZER=1, compute-sanitizer racecheck and
#      memcheck on one adaptive VS and one adaptive BS estimate case
#   3. attention_gpu_bench on model-like inputs at 32K and 128K: dense, vs (1000, 6096), bs (100, 64), vsa90, vsa95,
#      bsa90, bsa95 in the same run (density, estimate / index / kernel / total ms, x vs dense; "adaptive" lines:
#      what the coverage target kept per head). BENCH_ARGS replaces the default arguments.
# Logs and the CSV go to $OUT (build.log, test.log, sanitizer_*.log, bench.log, adaptive_model.csv).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-build/adaptive-check}
mkdir -p "$OUT"
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
if [ "${FULL_BUILD:-0}" = 1 ]; then
  BUILD_ONLY=1 OUT=$OUT/check bash scripts/gpu/check.sh > "$OUT/build.log" 2>&1
else
  if [ -d build/gpu-debs ]; then bash scripts/gpu/deps.sh unpack > "$OUT/deps.log" 2>&1; fi
  # shellcheck disable=SC1091
  [ -f build/gpu-sysroot/deps.env ] && . build/gpu-sysroot/deps.env
  # shellcheck disable=SC2086
  cmake --preset cuda -B build/cuda -DTESSERA_WERROR=ON ${TESSERA_DEPS_CMAKE_ARGS:-} > "$OUT/build.log" 2>&1
  cmake --build build/cuda -j"${JOBS:-16}" --target attention_gpu_test attention_gpu_bench >> "$OUT/build.log" 2>&1
fi
echo "build: exit $?, $(( $(date +%s) - start )) s, $(grep -c 'error' "$OUT/build.log") lines with 'error'"
grep -E "error|FAILED" "$OUT/build.log" | head -20
# shellcheck disable=SC1091
[ -f build/gpu-sysroot/deps.env ] && . build/gpu-sysroot/deps.env
T=build/cuda/tests/gpu/attention_gpu_test
t=$(date +%s)
timeout 240 "$T" --gtest_filter='*Adaptive*:*vs_adaptive*:*bs_adaptive*:DeviceLoweringOnHost*' > "$OUT/test.log" 2>&1
echo "adaptive GPU tests: exit $?, $(( $(date +%s) - t )) s"
grep -E "^\[  PASSED|^\[  FAILED|^\[       OK|^\[  SKIPPED|end2end|Failure|Expected|Which is" "$OUT/test.log" | head -60
t=$(date +%s)
timeout ${REST_TIMEOUT_S:-150} "$T" --gtest_filter='*DeviceEstimate*:*DeviceIndexTest*:*EndToEndTest*' \
  > "$OUT/test_rest.log" 2>&1
echo "estimator / index / end-to-end GPU tests: exit $?, $(( $(date +%s) - t )) s"
grep -E "^\[  PASSED|^\[  FAILED|Failure" "$OUT/test_rest.log" | head -20
if [ "${SKIP_SANITIZER:-0}" != 1 ]; then
  export PATH=$PATH:/usr/local/cuda/bin
  for tool in racecheck memcheck; do
    t=$(date +%s)
    timeout 120 compute-sanitizer --tool "$tool" --error-exitcode 3 "$T" \
      --gtest_filter='*DeviceEstimateTest.AdaptiveVerticalSlashReachesGammaMinimally/s1000_d128_bf16:*DeviceEstimateTest.AdaptiveBlockSparseReachesGammaMinimally/s1000_d128_bf16' \
      > "$OUT/sanitizer_$tool.log" 2>&1
    echo "compute-sanitizer $tool: exit $?, $(( $(date +%s) - t )) s"
    grep -E "ERROR SUMMARY|hazard|Invalid" "$OUT/sanitizer_$tool.log" | head -5
  done
fi
t=$(date +%s)
# shellcheck disable=SC2086
timeout ${BENCH_TIMEOUT_S:-300} build/cuda/bench/gpu/attention_gpu_bench \
  ${BENCH_ARGS:---seq 32768,131072 --patterns dense,vs,bs,vsa90,vsa95,bsa90,bsa95 --inputs model --reps 5 --kernel auto --csv $OUT/adaptive_model.csv} \
  2>&1 | tee "$OUT/bench.log"
echo "attention_gpu_bench: $(( $(date +%s) - t )) s"
echo "total: $(( $(date +%s) - start )) s"
