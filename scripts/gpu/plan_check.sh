#!/usr/bin/env bash
# scripts/gpu/plan_check.sh — the planners' reverse mode on a GPU machine (issue 16: src/plan/cuda), in one device
# call carrying build/gpu-debs:
#   run(command="bash scripts/gpu/plan_check.sh", carry=["build/gpu-debs"])      (OUT is the device's $OUT)
#   1. configure build/cuda (the cuda preset, the carried packages) and build only what this needs:
#      plan_gradients_gpu_test (tessera_plan_cuda), then plan_gradients_bench (with the GPU engine, for the
#      synthetic Llama-3-8B config)
#   2. tests/gpu/plan/plan_gradients_gpu_test (GPU against the CPU on the tiny models; [ gpu-vs-cpu ] lines give the
#      worst errors), then compute-sanitizer memcheck on one of its cases (SKIP_SANITIZER=1 skips it)
#   3. plan_gradients_bench at Llama-3-8B shapes (random weights), BENCH_ARGS (default: --seq 8192 --reps 2
#      --cpu-layers 1: f32 and TF32 passes over 32 layers, then the CPU against the GPU on one layer); with
#      MINFERENCE=1 also MInference's search forward (--minference, MINFERENCE_ARGS, default --seq 8192 --reps 2
#      --cpu-layers 1: the 32-layer GPU search, then the CPU search against the GPU's on one layer)
# The test program includes MInference's GPU search against the CPU's (GpuMInference.*).
# Logs go to $OUT (build.log, test.log, memcheck.log, bench.log).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-build/plan-check}
mkdir -p "$OUT"
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ -d build/gpu-debs ]; then bash scripts/gpu/deps.sh unpack > "$OUT/deps.log" 2>&1; fi
# shellcheck disable=SC1091
[ -f build/gpu-sysroot/deps.env ] && . build/gpu-sysroot/deps.env
# shellcheck disable=SC2086
cmake --preset cuda -B build/cuda -DTESSERA_WERROR=ON ${TESSERA_DEPS_CMAKE_ARGS:-} > "$OUT/build.log" 2>&1
cmake --build build/cuda -j"${JOBS:-16}" --target plan_gradients_gpu_test >> "$OUT/build.log" 2>&1
echo "build (test): exit $?, $(( $(date +%s) - start )) s"
grep -E "error|FAILED" "$OUT/build.log" | head -20
T=build/cuda/tests/gpu/plan_gradients_gpu_test
t=$(date +%s)
timeout 240 "$T" > "$OUT/test.log" 2>&1
echo "plan_gradients_gpu_test: exit $?, $(( $(date +%s) - t )) s"
grep -E "^\[  PASSED|^\[  FAILED|^\[  SKIPPED|gpu-vs-cpu|Failure|Expected|Which is|error" "$OUT/test.log" | head -60
if [ "${SKIP_SANITIZER:-0}" != 1 ]; then
  export PATH=$PATH:/usr/local/cuda/bin
  t=$(date +%s)
  timeout 120 compute-sanitizer --tool memcheck --error-exitcode 3 "$T" --gtest_filter='TinyModels/GpuGradients.EqualCpu/gemma3' \
    > "$OUT/memcheck.log" 2>&1
  echo "compute-sanitizer memcheck: exit $?, $(( $(date +%s) - t )) s"
  grep -E "ERROR SUMMARY|Invalid|PASSED|FAILED" "$OUT/memcheck.log" | head -5
fi
[ "${SKIP_BENCH:-0}" = 1 ] && { echo "total: $(( $(date +%s) - start )) s"; exit 0; }
t=$(date +%s)
cmake --build build/cuda -j"${JOBS:-16}" --target plan_gradients_bench >> "$OUT/build.log" 2>&1
echo "build (bench): exit $?, $(( $(date +%s) - t )) s"
# shellcheck disable=SC2086
timeout "${BENCH_TIMEOUT_S:-300}" build/cuda/bench/gpu/plan_gradients_bench ${BENCH_ARGS:---seq 8192 --reps 2 --cpu-layers 1} \
  2>&1 | tee "$OUT/bench.log"
echo "plan_gradients_bench: $(( $(date +%s) - t )) s"
if [ "${MINFERENCE:-0}" = 1 ]; then
  t=$(date +%s)
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT_S:-300}" build/cuda/bench/gpu/plan_gradients_bench --minference \
    ${MINFERENCE_ARGS:---seq 8192 --reps 2 --cpu-layers 1} 2>&1 | tee "$OUT/minference_bench.log"
  echo "plan_gradients_bench --minference: $(( $(date +%s) - t )) s"
fi
echo "total: $(( $(date +%s) - start )) s"
