#!/usr/bin/env bash
# stream_1m.sh — issue 20's long-prompt run: streaming memory on ONE GPU (GPU 0) with Llama-3-8B shapes (random
# weights), 128K .. 1M tokens, streamingllm (sinks + window; its decisions never wait for the host) beside the dense
# engine at 128K: TTFT, peak GPU memory, decode tokens/s at the length, host memory (bench/gpu/stream_bench.cpp).
# streamingllm keeps no evicted block (it never retrieves one): no pinned host memory, so 1M runs on the one-GPU
# kinds (128 GiB). ltri / infllm keep theirs in pinned host memory (bf16, 32 layers: ~136 GB at 1M, ~68 GB at 512K):
# past ~512K they need the 2- or 4-GPU kinds (256 / 512 GiB; only GPU 0 is used).
# Expected (H200, 2026-11-27 ~09:40 UTC): ~30K tok/s with chunk 2048, 1M in 35.1 s; the whole script ~3 min after the
# build (docs/streaming.md "1M tokens on a one-GPU machine").
#
#   device call (after the build, same call):
#     BUILD_ONLY=1 bash scripts/gpu/check.sh && bash scripts/gpu/stream_1m.sh        carry ["build/gpu-debs"]
#   or with binaries built here (ninja -C build/cuda-ci stream_bench) and carried:
#     BUILD_DIR=build/cuda-ci bash scripts/gpu/stream_1m.sh    carry ["build/gpu-debs", "build/cuda-ci/bench/gpu/stream_bench"]
#
# Writes $OUT/stream/{$TAG.csv,$TAG.log,$TAG.host_mem.txt,gpu.txt} (TAG: stream_1m) and prints the table last.
# BUILD_DIR: where stream_bench is (build/cuda; carried binaries: build/cuda-ci, with the debs unpacked here).
# TESSERA_STREAM_PROFILE=1: each streaming row is followed by its attention sections' GPU time. Env: SEQS
# (default 131072,262144,524288,1048576), METHODS (streamingllm; ltri / infllm: ~17 s / ~13 s at 128K on an H200 with
# the device decisions (ltri scores by cuBLAS bf16 GEMMs, the default; "ltri-fused" / "ltri-gemm" pick a scoring,
# stream_decide.h), so only with LTRI_MAX small (or see scripts/gpu/ltri_1m.sh: ltri at 1M); ltri-host / infllm-host: the host path,
# ~70-115 s at 32K), LTRI_MAX (ltri / infllm rows up to this length, 32768), DENSE (dense
# rows, 131072), DECODE (16), CHUNK (2048; the paper's 512 measured 1.2x slower at 128K),
# HOST_BUDGET (bytes, 200e9), TIME_S (330: the bench's own limit; rows that would start after ~300 s are skipped),
# PREPIN (1: each streaming row allocates its pinned pool before the timed prefill, reported as "pin s"; 0: inside TTFT),
# GEMM (bf16 | fp8: every row's GEMMs, stream_bench --gemm; or a method / "dense" with the suffix "-fp8" in METHODS,
# e.g. METHODS=streamingllm,streamingllm-fp8,dense-fp8, for bf16 and FP8 rows from the same run; dense-fp8 rows stop
# at DENSE_MAX, 131072), EXTRA (more stream_bench arguments, e.g. "--retrieval-heads FILE").
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD_DIR=${BUILD_DIR:-$ROOT/build/cuda}
OUTDIR=${OUT:-$ROOT/build/stream-out}/stream
mkdir -p "$OUTDIR"
# Carried binaries (BUILD_DIR=build/cuda-ci, built on another machine) need the CUDA libraries of the debs.
[ -f "$ROOT/build/gpu-sysroot/deps.env" ] || bash "$ROOT/scripts/gpu/deps.sh" unpack > "$OUTDIR/deps.log" 2>&1
[ -f "$ROOT/build/gpu-sysroot/deps.env" ] && . "$ROOT/build/gpu-sysroot/deps.env"
TAG=${TAG:-stream_1m}  # the files' name: several calls in one device command keep theirs apart
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
BIN=$BUILD_DIR/bench/gpu/stream_bench
if [ ! -x "$BIN" ]; then
  echo "stream_1m: $BIN missing: building it"
  cmake --build "$BUILD_DIR" -j"${JOBS:-16}" --target stream_bench > "$OUTDIR/build.log" 2>&1 || { tail -30 "$OUTDIR/build.log"; exit 1; }
fi
{ nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv; echo; free -g; nproc; } > "$OUTDIR/gpu.txt" 2>&1
TIME_S=${TIME_S:-330}
echo "stream_1m: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null) on $(head -2 "$OUTDIR/gpu.txt" | tail -1)"
# Host memory in use, sampled every 5 s while the bench runs (MemAvailable drop = pinned blocks + the rest).
( while sleep 5; do echo "$(date +%s) $(grep -E 'MemTotal|MemAvailable' /proc/meminfo | tr -s ' ' | tr '\n' ' ')"; done ) \
  > "$OUTDIR/$TAG.host_mem.txt" 2>&1 &
SAMPLER=$!
timeout -k 10 "$TIME_S" "$BIN" --seq "${SEQS:-131072,262144,524288,1048576}" \
  --methods "${METHODS:-streamingllm}" --method-max-seq "ltri=${LTRI_MAX:-32768},infllm=${LTRI_MAX:-32768},dense-fp8=${DENSE_MAX:-131072}" \
  --dense "${DENSE:-131072}" --decode "${DECODE:-16}" --chunk "${CHUNK:-2048}" --host-budget "${HOST_BUDGET:-200e9}" \
  --max-seconds $((TIME_S - 40)) --csv "$OUTDIR/$TAG.csv" $([ "${PREPIN:-1}" = 1 ] && echo --prepin) \
  $([ -n "${GEMM:-}" ] && echo --gemm "$GEMM") ${EXTRA:-} \
  > "$OUTDIR/$TAG.log" 2>&1
rc=$?
kill "$SAMPLER" 2> /dev/null
echo "stream_1m: stream_bench exit $rc (124: cut at ${TIME_S} s; the rows before are kept)"
cat "$OUTDIR/$TAG.log"
exit $rc
