#!/usr/bin/env bash
# fp8_check.sh — issue 20's FP8 GEMMs (runtime_cuda/gemm.h, --gemm fp8) on one Hopper GPU, in one device call:
#   1. tests/gpu/engine_tests/fp8_gemm_test: quantization EQUAL to the host's (core/fp8.h), the product against the
#      host reference, fp8 vs bf16 (and CPU) logits on the fixtures and a 2-layer Llama-3-8B-shaped model, option
#      errors; then its throughput case (TESSERA_FP8_BENCH=1): the Llama-3-8B layer GEMMs at m = 2048, bf16 vs FP8,
#      with and without TESSERA_FP8_FAST_ACCUM=1;
#   2. stream_bench at 128K: dense bf16 and FP8, streamingllm bf16 and FP8 (scripts/gpu/stream_1m.sh, TAG fp8_128k);
#   3. stream_bench at 1M: streamingllm FP8, then bf16 (TAG fp8_1m), when ONE_M=1 (default).
# Binaries built on the CPU machine and carried (ninja -C build/cuda-ci stream_bench fp8_gemm_test):
#   BUILD_DIR=build/cuda-ci bash scripts/gpu/fp8_check.sh
#   carry ["build/gpu-debs", "build/cuda-ci/bench/gpu/stream_bench", "build/cuda-ci/tests/gpu/fp8_gemm_test"]
# cuBLASLt logs errors, hints and info (CUBLASLT_LOG_MASK=13) during the tests: why a call is refused.
# Writes $OUT/fp8_test.log, $OUT/fp8_bench.log and $OUT/stream/ (stream_1m.sh's files).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
export BUILD_DIR=${BUILD_DIR:-$ROOT/build/cuda}
OUTDIR=${OUT:-$ROOT/build/fp8-out}
mkdir -p "$OUTDIR/stream"
[ -f "$ROOT/build/gpu-sysroot/deps.env" ] || bash "$ROOT/scripts/gpu/deps.sh" unpack > "$OUTDIR/stream/deps.log" 2>&1
[ -f "$ROOT/build/gpu-sysroot/deps.env" ] && . "$ROOT/build/gpu-sysroot/deps.env"
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
echo "fp8_check: commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null)"
T=$BUILD_DIR/tests/gpu/fp8_gemm_test
if [ -x "$T" ]; then
  CUBLASLT_LOG_MASK=${CUBLASLT_LOG_MASK:-13} timeout -k 5 120 "$T" 2>&1 | tee "$OUTDIR/fp8_test.log" | grep -E "^\[fp8\]|FAILED|PASSED|Failure|error|cublasLt"
  echo "fp8_check: fp8_gemm_test exit ${PIPESTATUS[0]}"
  { TESSERA_FP8_BENCH=1 timeout -k 5 45 "$T" --gtest_filter='*Throughput*'
    echo "--- TESSERA_FP8_FAST_ACCUM=1"
    TESSERA_FP8_FAST_ACCUM=1 TESSERA_FP8_BENCH=1 timeout -k 5 45 "$T" --gtest_filter='*Throughput*'; } 2>&1 \
    | tee "$OUTDIR/fp8_bench.log" | grep -E "^\[fp8\]|---|FAILED"
else
  echo "fp8_check: $T missing"
fi
SEQS=131072 METHODS=streamingllm,streamingllm-fp8,dense-fp8 DENSE=131072 DECODE=${DECODE:-16} TAG=fp8_128k \
  TIME_S=${TIME_S_128K:-150} bash "$ROOT/scripts/gpu/stream_1m.sh" | tail -8
if [ "${ONE_M:-1}" = 1 ]; then
  SEQS=1048576 METHODS=${METHODS_1M:-streamingllm-fp8,streamingllm} DENSE=0 DECODE=${DECODE:-16} TAG=fp8_1m \
    TIME_S=${TIME_S_1M:-200} bash "$ROOT/scripts/gpu/stream_1m.sh" | tail -6
fi
