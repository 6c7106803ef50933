#!/usr/bin/env bash
# scripts/gpu/batch_check.sh — the batched engine on a GPU machine (issue 17), in one device call carrying
# build/gpu-debs (and, optionally, models under build/models: TESSERA_MODELS=build/models):
#   1. build (scripts/gpu/check.sh BUILD_ONLY=1: cuda_all with warnings as errors)
#   2. batch_gpu_test (the paged decode kernel vs the CPU twin; batched vs single-sequence GPU decode; the real
#      models when present) and, unless SKIP_ENGINE_TESTS=1, every other GPU test (ctest -L gpu)
#   3. decode_bench (Llama-3-8B shapes, random weights): DECODE_ARGS (default: contexts 8K/32K/128K, batches
#      1/8/32/64, KV budget 40 GB, dense vs MoA at 50%)
#   4. with HF=1, Hugging Face transformers' decode on the same shapes (bench/gpu/hf_decode_reference.py, HF_ARGS)
# Logs and CSVs go to $OUT (decode.csv, batch_test.log, decode.log, hf_decode.csv).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-build/batch-check}
mkdir -p "$OUT"
start=$(date +%s)
BUILD_ONLY=1 OUT=$OUT/check bash scripts/gpu/check.sh > "$OUT/build.log" 2>&1
echo "build: $(( $(date +%s) - start )) s, $(grep -c 'error' "$OUT/build.log") lines with 'error'"
grep -E "error|FAILED" "$OUT/build.log" | head -20
# shellcheck disable=SC1091
[ -f build/gpu-sysroot/deps.env ] && . build/gpu-sysroot/deps.env
export TESSERA_MODELS=${TESSERA_MODELS:-$PWD/build/models}
t=$(date +%s)
timeout 300 build/cuda/tests/gpu/batch_gpu_test > "$OUT/batch_test.log" 2>&1
echo "batch_gpu_test: exit $?, $(( $(date +%s) - t )) s"
grep -E "^\[  PASSED|^\[  FAILED|^\[       OK|^\[  SKIPPED|^\[batch\]|Failure|Expected|Which is|worst" "$OUT/batch_test.log" | head -60
if [ "${SKIP_ENGINE_TESTS:-0}" != 1 ]; then
  t=$(date +%s)
  ctest --test-dir build/cuda -L gpu -E "PagedDecodeKernel|GpuBatch|RealModelBatch" -j 4 --timeout 300 > "$OUT/ctest.log" 2>&1
  echo "ctest -L gpu (the rest): exit $?, $(( $(date +%s) - t )) s"
  grep -E "tests passed|Failed|\*\*\*" "$OUT/ctest.log" | head -20
fi
t=$(date +%s)
# shellcheck disable=SC2086
timeout ${DECODE_TIMEOUT_S:-240} build/cuda/bench/gpu/decode_bench ${DECODE_ARGS:---csv $OUT/decode.csv} 2>&1 | tee "$OUT/decode.log"
echo "decode_bench: $(( $(date +%s) - t )) s"
# 4. HF=1: Hugging Face transformers on the same shapes, same machine (bench/gpu/hf_decode_reference.py; HF_ARGS).
if [ "${HF:-0}" = 1 ]; then
  t=$(date +%s)
  # shellcheck disable=SC2086
  timeout ${HF_TIMEOUT_S:-300} python3 bench/gpu/hf_decode_reference.py ${HF_ARGS:---csv $OUT/hf_decode.csv} 2>&1 |
    grep -v Warning | tee "$OUT/hf_decode.log"
  echo "hf_decode_reference: $(( $(date +%s) - t )) s"
fi
