#!/usr/bin/env bash
# fp8_check.sh — the FP8 GEMMs (runtime/cuda/gemm.h, --gemm fp8: per-row scales by default, per tensor with
# TESSERA_FP8_SCALING=tensor) on one Hopper GPU, in one device call, by phases (PHASES, default test,bench):
#   test   tests/gpu/engine_tests/fp8_gemm_test: quantization EQUAL to the host's (core/fp8.h) per row and per tensor,
#          the products against the host reference (outer-vector scaling and the fallback epilogue), fp8 (both
#          scalings) vs bf16 (and CPU) logits on the fixtures and a 2-layer Llama-3-8B-shaped model, option errors;
#   bench  its throughput case (TESSERA_FP8_BENCH=1): the Llama-3-8B layer GEMMs at m = 2048, bf16 vs FP8 per tensor,
#          per row (outer vector) and per row (epilogue), the table twice;
#   stream stream_bench at 128K (dense bf16 and FP8, streamingllm bf16 and FP8; scripts/gpu/stream_1m.sh, TAG
#          fp8_128k), then at 1M (streamingllm FP8, then bf16; TAG fp8_1m) when ONE_M=1 (default);
#   real   the real SmolLM2-135M-Instruct on the GPU, --gemm bf16 vs fp8 (per row) vs fp8 per tensor in the same run:
#          perplexity (`tessera eval --tasks none --perplexity`, kjv, PPL_LENGTHS 2048,8192; the CPU f32 reference in
#          docs/accuracy/smollm2-135m: 5.009 at 2K, 6.998 at 8K) and RULER's niah_single within the 8K
#          context (REAL_LENGTHS 4096,8192 x depths 10,50,90, REAL_SAMPLES 2), dense attention, greedy; first the CPU
#          engine's perplexity at CPU_PPL_LENGTHS (2048; empty skips it): the f32 reference of the GPU's scoring.
# Binaries built on the CPU machine and carried (ninja -C build/cuda-ci stream_bench fp8_gemm_test):
#   BUILD_DIR=build/cuda-ci bash scripts/gpu/fp8_check.sh
#   carry ["build/gpu-debs", "build/cuda-ci/bench/gpu/stream_bench", "build/cuda-ci/tests/gpu/fp8_gemm_test"]
# The real phase runs after scripts/gpu/smollm2_gpu.sh's calls on the same warm host (the model joined from its two
# carried halves at build/models/, tessera built at build/sr-cuda), e.g. as its 3rd call's second command:
#   PHASES=real bash scripts/gpu/fp8_check.sh      (TESSERA=..., MODEL=... override the paths)
# cuBLASLt logs errors, hints and info (CUBLASLT_LOG_MASK=13) during the tests: why a call is refused.
# Writes $OUT/fp8_test.log, $OUT/fp8_bench.log, $OUT/stream/ (stream_1m.sh's files), $OUT/fp8-real/.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
export BUILD_DIR=${BUILD_DIR:-$ROOT/build/cuda}
OUTDIR=${OUT:-$ROOT/build/fp8-out}
PHASES=${PHASES:-test,bench}
has() { case ",$PHASES," in *,$1,*) return 0 ;; esac; return 1; }
mkdir -p "$OUTDIR"
[ -f "$ROOT/build/gpu-sysroot/deps.env" ] || bash "$ROOT/scripts/gpu/deps.sh" unpack > "$OUTDIR/deps.log" 2>&1
[ -f "$ROOT/build/gpu-sysroot/deps.env" ] && . "$ROOT/build/gpu-sysroot/deps.env"
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader
echo "fp8_check: commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null); cuBLASLt: $(ls /usr/local/cuda/lib64/libcublasLt.so.*.* 2>/dev/null | head -1)"
T=$BUILD_DIR/tests/gpu/fp8_gemm_test
if has test || has bench; then
  [ -x "$T" ] || echo "fp8_check: $T missing"
fi
if has test && [ -x "$T" ]; then
  CUBLASLT_LOG_MASK=${CUBLASLT_LOG_MASK:-13} timeout -k 5 150 "$T" 2>&1 | tee "$OUTDIR/fp8_test.log" | grep -E "^\[fp8\]|FAILED|PASSED|Failure|error|cublasLt"
  echo "fp8_check: fp8_gemm_test exit ${PIPESTATUS[0]}"
fi
if has bench && [ -x "$T" ]; then
  { TESSERA_FP8_BENCH=1 timeout -k 5 60 "$T" --gtest_filter='*Throughput*'
    if [ "${FAST_ACCUM:-0}" = 1 ]; then
      echo "--- TESSERA_FP8_FAST_ACCUM=1"
      TESSERA_FP8_FAST_ACCUM=1 TESSERA_FP8_BENCH=1 timeout -k 5 60 "$T" --gtest_filter='*Throughput*'
    fi; } 2>&1 | tee "$OUTDIR/fp8_bench.log" | grep -E "^\[fp8\]|---|FAILED"
fi
if has stream; then
  mkdir -p "$OUTDIR/stream"
  SEQS=131072 METHODS=streamingllm,streamingllm-fp8,dense-fp8 DENSE=131072 DECODE=${DECODE:-16} TAG=fp8_128k \
    TIME_S=${TIME_S_128K:-150} bash "$ROOT/scripts/gpu/stream_1m.sh" | tail -8
  if [ "${ONE_M:-1}" = 1 ]; then
    SEQS=1048576 METHODS=${METHODS_1M:-streamingllm-fp8,streamingllm} DENSE=0 DECODE=${DECODE:-16} TAG=fp8_1m \
      TIME_S=${TIME_S_1M:-200} bash "$ROOT/scripts/gpu/stream_1m.sh" | tail -6
  fi
fi
if has real; then
  TS=${TESSERA:-$ROOT/build/sr-cuda/src/tessera}
  MODEL=${MODEL:-$ROOT/build/models/smollm2-135m-instruct-q4_1.gguf}
  R=$OUTDIR/fp8-real
  mkdir -p "$R"
  # The KJV haystack the perplexity and needle cases read (/usr/lib/bible.data; the device image lacks it): the copy
  # gemma_gpu.sh's prepare carries in build/gemma-bin.
  if [ ! -f /usr/lib/bible.data ] && [ -f "$ROOT/build/gemma-bin/bible.data" ]; then
    cp "$ROOT/build/gemma-bin/bible.data" /usr/lib/bible.data || echo "fp8_check real: cannot install bible.data"
  fi
  if [ ! -x "$TS" ] || [ ! -f "$MODEL" ]; then
    echo "fp8_check real: needs $TS and $MODEL (scripts/gpu/smollm2_gpu.sh's calls make both)" | tee "$R/summary.txt"
  else
    if [ -n "${CPU_PPL_LENGTHS-2048}" ]; then
      timeout -k 5 "${REAL_STEP_S:-150}" "$TS" eval -m "$MODEL" --device cpu --tasks none --perplexity "${CPU_PPL_LENGTHS-2048}" \
        --haystack kjv --attn dense -o "$R/ppl_cpu" > "$R/ppl_cpu.log" 2>&1
      echo "real cpu f32 perplexity exit $?: $(grep -E '^eval: perplexity' "$R/ppl_cpu.log" | tr '\n' ' ')" | tee -a "$R/summary.txt"
    fi
    # Three GEMM precisions, each over the same perplexity text and the same needle cases.
    for v in bf16 fp8 fp8-tensor; do
      case $v in
        bf16) env=(); gemm=bf16 ;;
        fp8) env=(TESSERA_FP8_SCALING=row); gemm=fp8 ;;
        fp8-tensor) env=(TESSERA_FP8_SCALING=tensor); gemm=fp8 ;;
      esac
      env "${env[@]}" timeout -k 5 "${REAL_STEP_S:-150}" "$TS" eval -m "$MODEL" --device cuda --gemm "$gemm" \
        --tasks none --perplexity "${PPL_LENGTHS:-2048,8192}" --haystack kjv --attn dense -o "$R/ppl_$v" > "$R/ppl_$v.log" 2>&1
      rc=$?
      echo "real $v perplexity exit $rc: $(grep -E '^eval: perplexity' "$R/ppl_$v.log" | tr '\n' ' ')$([ $rc = 0 ] || tail -n 1 "$R/ppl_$v.log")" \
        | tee -a "$R/summary.txt"
      env "${env[@]}" timeout -k 5 "${REAL_STEP_S:-150}" "$TS" eval -m "$MODEL" --device cuda --gemm "$gemm" \
        --tasks niah_single -l "${REAL_LENGTHS:-4096,8192}" --depths "${REAL_DEPTHS:-10,50,90}" \
        --samples "${REAL_SAMPLES:-2}" --attn dense --answer-tokens 16 -o "$R/niah_$v" > "$R/niah_$v.log" 2>&1
      rc=$?
      echo "real $v niah_single exit $rc: $(grep -cE ' pass \(' "$R/niah_$v.log") pass, $(grep -cE ' FAIL \(' "$R/niah_$v.log") fail$([ $rc = 0 ] || echo "; $(tail -n 1 "$R/niah_$v.log")")" \
        | tee -a "$R/summary.txt"
    done
  fi
fi
