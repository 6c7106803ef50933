#!/usr/bin/env bash
# scripts/gpu/ltri_1m.sh — Ltri at 128K and 1M on one H200 with binaries built here (issue 35), in one device call:
#   bash scripts/gpu/run.sh bins stream_bench stream_gpu_test     # here, after ninja -C build/cuda-ci those targets
#   device: bash scripts/gpu/ltri_1m.sh    carry ["build/gpu-bin", "build/gpu-debs"]
# ROWS_128K: the methods at 128K (one stream_bench process); ROWS_1M: one process per method at 1M (each holds its
# own ~70 GB of pinned FP8 blocks); CHUNK: the prefill chunk (default 512, the paper's; every per-chunk cost of the
# decisions and of the global pass divides by it); TESTS=1 first runs stream_gpu_test; BENCH: another stream_bench
# (an older commit's, for a side-by-side in one call), its files named with TAG. Logs and CSVs under $OUT.
set -uo pipefail
. scripts/gpu/lib.sh
lib_init
deps_env > /dev/null 2>&1
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
export LD_LIBRARY_PATH=$PWD/build/gpu-bin/lib:${LD_LIBRARY_PATH:-}
B=${BENCH:-build/gpu-bin/stream_bench}
t=${TAG:-}
S="--dense 0 --decode 8 --chunk ${CHUNK:-512} --host-budget 110e9 --prepin --host-kv fp8 --gemm fp8 --retrieval-heads docs/streaming/ltri-llm-retrieval-heads.txt"
out=${OUT:-/tmp/ltri1m}
mkdir -p "$out"
if [ "${TESTS:-1}" = 1 ]; then
  TESSERA_KV_TYPE=f32 build/gpu-bin/stream_gpu_test > "$out/test.log" 2>&1; grep -E "^\[stream\]|FAILED|PASSED" "$out/test.log" | tail -20
fi
if [ -n "${ROWS_128K:-}" ]; then
  $B --seq 131072 $S --methods "$ROWS_128K" --csv "$out/128k-c${CHUNK:-512}$t.csv" 2>&1 | grep -v '^\s*$' | tee "$out/128k-c${CHUNK:-512}$t.log"
fi
for m in $(echo "${ROWS_1M:-}" | tr , " "); do
  $B --seq 1048576 $S --methods "$m" --csv "$out/1m-$m-c${CHUNK:-512}$t.csv" 2>&1 | grep '^|' | grep -v "tokens\|---" | tee "$out/1m-$m-c${CHUNK:-512}$t.log"
done
