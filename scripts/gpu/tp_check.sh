#!/usr/bin/env bash
# scripts/gpu/tp_check.sh — build, test and benchmark the tensor-parallel engine (src/dist, docs/multi-gpu.md) on a
# machine with 2 or more GPUs, in one call.
#
#   here (Debian 12), once:  bash scripts/gpu/deps.sh download          (build/gpu-debs)
#                            bash scripts/gpu/tp_check.sh prepare       (copies MInference's Llama-3-8B-262K config
#                                                                        from ../shared/data into build/tp-data)
#   there:                   bash scripts/gpu/tp_check.sh               (device call, kind nvidia-h100-x2, with
#                                                                        carry ["build/gpu-debs", "build/tp-data"])
# Steps (logs in build/tp-check/logs; each step capped so that the whole run stays within TP_BUDGET_S, default 560):
#   env        nvidia-smi, nvcc, where NCCL is (scripts/gpu/nccl.sh locate)
#   configure  cmake --preset cuda -B build/tp-cuda (+ deps.sh's arguments, TESSERA_NCCL_ROOT from nccl.sh)
#   build      tp_gpu_test tp_bench (and what they need)
#   test       tp_gpu_test: TP on 2 GPUs vs the single-GPU engine (fixtures), sparse policy under 3 placements
#   bench_1    tp_bench --gpus 1 at TP_LENGTHS (the same engine on one GPU: the baseline of the same call)
#   bench_N    tp_bench --gpus N (N = TP_GPUS, default: every GPU) at TP_LENGTHS, uniform / greedy / genetic
# $OUT receives summary.txt, tp_gpu_test.xml, tp_bench_1.csv, tp_bench_N.csv, head_profile.json and tp_check.tgz.
# Environment: OUT, JOBS (16), TP_BUDGET_S, TP_GPUS, TP_LENGTHS (131072,262144), TP_COSTS (profile).
# NCCL_NVLS_ENABLE=0 is exported for every process (no NVLink multicast on shared machines).
set -u
set -o pipefail
cd "$(dirname "$0")/../.." || exit 1
ROOT=$PWD
export NCCL_NVLS_ENABLE=0

if [ "${1:-}" = prepare ]; then
  mkdir -p build/tp-data
  cp ../shared/data/minference-configs/Llama_3_8B_Instruct_262k_kv_out_v32_fit_o_best_pattern.json build/tp-data/
  ls -la build/tp-data
  exit 0
fi

WORK=$ROOT/build/tp-check
LOGS=$WORK/logs
OUT=${OUT:-$WORK/out}
BUILD_DIR=$ROOT/build/tp-cuda
BUDGET=${TP_BUDGET_S:-560}
START=$(date +%s)
mkdir -p "$OUT" "$LOGS"
SUMMARY=$LOGS/summary.txt
: > "$SUMMARY"
export PATH=$PATH:/usr/local/cuda/bin
# Sources carry the sender's modification times: touch them so that a warm machine's objects are rebuilt.
find "$ROOT/src" "$ROOT/tests" "$ROOT/bench" -type f -exec touch {} +

run_step() {
  local name=$1 max=$2
  shift 2
  local left cap rc t0
  left=$((BUDGET - ($(date +%s) - START)))
  cap=$max
  [ "$left" -lt "$cap" ] && cap=$left
  if [ "$cap" -lt 10 ]; then
    echo "$name SKIPPED (budget spent)" | tee -a "$SUMMARY"
    return 99
  fi
  t0=$(date +%s)
  timeout -k 10 "$cap" "$@" > "$LOGS/$name.log" 2>&1
  rc=$?
  local status=ok
  [ $rc -ne 0 ] && status="FAILED (rc $rc)"
  [ $rc -eq 124 ] && status="TIMED OUT after ${cap}s"
  echo "$name $status $(($(date +%s) - t0))s" | tee -a "$SUMMARY"
  tail -n 25 "$LOGS/$name.log"
  return $rc
}

run_step env 30 bash -c 'nvidia-smi -L; nvcc --version | tail -1; bash scripts/gpu/nccl.sh locate'
NCCL_ARGS=""
ROOT_NCCL=$(bash scripts/gpu/nccl.sh locate 2> /dev/null | sed -n 's/^TESSERA_NCCL_ROOT=//p' | head -1)
[ -n "$ROOT_NCCL" ] && NCCL_ARGS="-DTESSERA_NCCL_ROOT=$ROOT_NCCL"
TESSERA_DEPS_CMAKE_ARGS=""
if [ -d "$ROOT/build/gpu-debs" ] && run_step deps 60 bash "$ROOT/scripts/gpu/deps.sh" unpack; then
  . "$ROOT/build/gpu-sysroot/deps.env"
fi
run_step configure 90 cmake --preset cuda -B "$BUILD_DIR" -DTESSERA_BUILD_BENCH=ON $TESSERA_DEPS_CMAKE_ARGS $NCCL_ARGS
run_step build 330 cmake --build "$BUILD_DIR" -j "${JOBS:-16}" --target tp_gpu_test tp_bench
run_step test 120 "$BUILD_DIR/tests/gpu/tp_gpu_test" --gtest_output="xml:$OUT/tp_gpu_test.xml"

GPUS=${TP_GPUS:-$(nvidia-smi -L | wc -l)}
LENGTHS=${TP_LENGTHS:-131072,262144}
POLICY=$ROOT/build/tp-data/Llama_3_8B_Instruct_262k_kv_out_v32_fit_o_best_pattern.json
left() { echo $((BUDGET - ($(date +%s) - START) - 15)); }
run_step bench_N 400 "$BUILD_DIR/bench/gpu/tp_bench" --gpus "$GPUS" --policy "$POLICY" --lengths "$LENGTHS" \
  --costs "${TP_COSTS:-profile}" --out "$WORK/bench_N" --max-seconds "$(($(left) * 2 / 3))"
run_step bench_1 200 "$BUILD_DIR/bench/gpu/tp_bench" --gpus 1 --policy "$POLICY" --lengths "$LENGTHS" \
  --costs flops --out "$WORK/bench_1" --max-seconds "$(($(left) - 40))"

cp "$WORK/bench_N/tp_bench.csv" "$OUT/tp_bench_N.csv" 2> /dev/null
cp "$WORK/bench_1/tp_bench.csv" "$OUT/tp_bench_1.csv" 2> /dev/null
cp "$WORK/bench_N/head_profile.json" "$OUT/" 2> /dev/null
cp "$SUMMARY" "$OUT/summary.txt"
tar -czf "$OUT/tp_check.tgz" -C "$WORK" logs bench_N bench_1 2> /dev/null
cat "$SUMMARY"
