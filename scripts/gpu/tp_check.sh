#!/usr/bin/env bash
# scripts/gpu/tp_check.sh — build, test and benchmark the tensor-parallel engine (src/parallel, docs/multi-gpu.md) on a
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
#   bench_<N>gpu_<len>  tp_bench --gpus N (N = TP_GPUS, default: every GPU), uniform / greedy / genetic placement
#   bench_1gpu_<len>    tp_bench --gpus 1 (the same engine on one GPU: the baseline of the same call)
#              for each length of TP_LENGTHS that the time left can hold
# $OUT receives summary.txt, tp_gpu_test.xml, tp_bench.csv (every table row), head_profile.json and tp_check.tgz.
# Environment: OUT, JOBS (16), TP_BUDGET_S, TP_GPUS, TP_LENGTHS (131072,262144), TP_COSTS (profile), TP_PLACEMENTS
# (uniform,greedy,genetic).
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
run_step build 360 cmake --build "$BUILD_DIR" -j "${JOBS:-16}" --target tp_gpu_test tp_bench
run_step test 100 "$BUILD_DIR/tests/gpu/tp_gpu_test" --gtest_output="xml:$OUT/tp_gpu_test.xml"

GPUS=${TP_GPUS:-$(nvidia-smi -L | wc -l)}
LENGTHS=${TP_LENGTHS:-131072,262144}
POLICY=$ROOT/build/tp-data/Llama_3_8B_Instruct_262k_kv_out_v32_fit_o_best_pattern.json
left() { echo $((BUDGET - ($(date +%s) - START) - 10)); }
# One step per length and GPU count (a step cut by its time limit loses only its own table; the per-rank JSON files
# of every finished run stay in the tarball). A length starts only when the time left could hold it.
for LEN in ${LENGTHS//,/ }; do
  need=$((LEN / 2048))  # seconds a length needs for N GPUs x 3 placements and 1 GPU, roughly (2 H200s: 128K 30 s, 256K 75 s)
  if [ "$(left)" -lt "$need" ]; then
    echo "bench $LEN SKIPPED (about ${need}s needed, $(left)s left)" | tee -a "$SUMMARY"
    continue
  fi
  run_step "bench_${GPUS}gpu_$LEN" $(($(left) - need / 3)) "$BUILD_DIR/bench/gpu/tp_bench" --gpus "$GPUS" --policy "$POLICY" \
    --lengths "$LEN" --costs "${TP_COSTS:-profile}" --placements "${TP_PLACEMENTS:-uniform,greedy,genetic}" \
    --out "$WORK/bench_N_$LEN" --max-seconds $(($(left) - need / 2))
  run_step "bench_1gpu_$LEN" $(($(left))) "$BUILD_DIR/bench/gpu/tp_bench" --gpus 1 --policy "$POLICY" \
    --lengths "$LEN" --costs flops --out "$WORK/bench_1_$LEN"
done

: > "$OUT/tp_bench.csv"
for f in "$WORK"/bench_N_*/tp_bench.csv "$WORK"/bench_1_*/tp_bench.csv; do
  [ -f "$f" ] || continue
  [ -s "$OUT/tp_bench.csv" ] && tail -n +2 "$f" >> "$OUT/tp_bench.csv" || cat "$f" >> "$OUT/tp_bench.csv"
done
cp "$WORK"/bench_N_131072/head_profile.json "$OUT/" 2> /dev/null
cp "$SUMMARY" "$OUT/summary.txt"
tar -czf "$OUT/tp_check.tgz" -C "$WORK" logs $(cd "$WORK" && ls -d bench_* 2> /dev/null) 2> /dev/null
cat "$SUMMARY"
cat "$OUT/tp_bench.csv"
