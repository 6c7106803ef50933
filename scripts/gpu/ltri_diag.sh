#!/usr/bin/env bash
# scripts/gpu/ltri_diag.sh — one device call for issue 35's Ltri-at-1M work with binaries built here and carried
# (bash scripts/gpu/run.sh bins stream_bench stream_gpu_test stream_decide_test stream_host_bench fp8_gemm_test
# ttft_bench, packed into build/gpu-pack/bins.tar.xz): the machine's CPU, the GPU tests (TESTS=1; FP8TEST=1 adds
# fp8_gemm_test), the host's share of the decisions on that CPU (HOSTBENCH=1: stream_host_bench), TTFT at 128K with
# FP8 GEMMs, the activations' quantization fused and separate (TTFT=1), then ROWS_1M through scripts/gpu/ltri_1m.sh.
# Everything under $OUT/diag.
set -uo pipefail
[ -e /work/main ] || { mkdir -p /work && ln -s "$PWD" /work/main; }
rm -rf build/gpu-bin
tar -xJf build/gpu-pack/bins.tar.xz -C build
export LD_LIBRARY_PATH=$PWD/build/gpu-bin/lib
o=$OUT/diag
mkdir -p "$o"
{ lscpu | head -20; nproc; nvidia-smi --query-gpu=name,clocks.sm,power.draw,power.limit --format=csv; } > "$o/machine.txt" 2>&1
if [ "${TESTS:-1}" = 1 ]; then
  TESSERA_KV_TYPE=f32 build/gpu-bin/stream_gpu_test > "$o/stream_gpu_test.log" 2>&1; tail -3 "$o/stream_gpu_test.log"
  TESSERA_KV_TYPE=f32 build/gpu-bin/stream_decide_test > "$o/stream_decide_test.log" 2>&1; tail -3 "$o/stream_decide_test.log"
fi
if [ "${FP8TEST:-0}" = 1 ]; then
  build/gpu-bin/fp8_gemm_test > "$o/fp8_gemm_test.log" 2>&1; tail -3 "$o/fp8_gemm_test.log"
fi
if [ "${TTFT:-0}" = 1 ]; then
  P="vs_adaptive:gamma=0.9-fp8;dense-fp8"
  build/gpu-bin/ttft_bench --seq 131072 --weights local --policies "$P" --csv "$o/ttft-fused.csv" > "$o/ttft-fused.log" 2>&1
  TESSERA_FP8_FUSED=0 build/gpu-bin/ttft_bench --seq 131072 --weights local --policies "$P" --csv "$o/ttft-separate.csv" \
    > "$o/ttft-separate.log" 2>&1
  build/gpu-bin/ttft_bench --seq 131072 --weights local --policies "$P" --csv "$o/ttft-fused2.csv" > "$o/ttft-fused2.log" 2>&1
  tail -4 "$o"/ttft-*.log
fi
if [ "${HOSTBENCH:-1}" = 1 ]; then
  for i in 1 2; do
    build/gpu-bin/stream_host_bench --seq 1048576 --chunk 1024 --early-layers votes \
      --retrieval-heads docs/streaming/ltri-llm-retrieval-heads.txt 2>&1 | tee -a "$o/stream_host_bench.log"
  done
fi
OUT=$o TESTS=0 CHUNK=${CHUNK:-1024} bash scripts/gpu/ltri_1m.sh
