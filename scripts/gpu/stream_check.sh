#!/usr/bin/env bash
# stream_check.sh — issue 20's GPU decisions (runtime/cuda/stream_decide.h) in one device call: the streaming GPU
# tests (stream_gpu_test) then stream_bench with ltri / infllm deciding on the device,
# beside streamingllm, the dense engine and the host-decision baseline ("ltri-host" / "infllm-host": the path before
# stream_decide.h) from the same run (Llama-3-8B shapes, random weights, GPU 0).
#
#   device call:  bash scripts/gpu/stream_check.sh     carry ["build/gpu-debs"] (+ prebuilt binaries, below)
#
# Binaries: build/cuda/tests/gpu/engine_gpu_test and build/cuda/bench/gpu/stream_bench when they are carried and
# start (PREBUILT=1, the default), else configured and built here (those two targets only: ~3-5 min on 16 cores).
# Env: SEQS (8192,32768,131072), METHODS (streamingllm,infllm,ltri,infllm-host,ltri-host), HOST_MAX (the host
# baseline's rows up to this length, 8192), DEVICE_MAX (ltri / infllm rows, 131072), DENSE (131072), CHUNK (512),
# DECODE (16), TIME_S (240: the bench's limit), SKIP_TEST=1, SKIP_BENCH=1. Writes $OUT/stream/{test.log,bench.log,bench.csv}.
# The 256K run of docs/streaming.md ("Span discovery ... on the device"):
#   SEQS=8192,32768,131072,262144 DEVICE_MAX=262144 TIME_S=270 TEST_S=60 bash scripts/gpu/stream_check.sh
# (256K pins ~34 GB of host memory for ltri / infllm.)
# HEADS=N: a synthetic retrieval-heads file (query head 0 of each of N layers, score 0.5) for every row: "ltri" then
# keeps each layer's kv head 0 only in its span index, "ltri-fullindex" every kv head (docs/streaming.md, "The index
# size"), e.g.  HEADS=32 SEQS=131072 METHODS=ltri,ltri-fullindex DENSE=0 TIME_S=130 TEST_S=45 bash scripts/gpu/stream_check.sh
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
ROOT=$PWD
OUTDIR=${OUT:-$ROOT/build/stream-out}/stream
mkdir -p "$OUTDIR"
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
bash scripts/gpu/deps.sh unpack > "$OUTDIR/deps.log" 2>&1 || { tail -20 "$OUTDIR/deps.log"; exit 1; }
. build/gpu-sysroot/deps.env
TEST=build/cuda/tests/gpu/stream_gpu_test
BENCH=build/cuda/bench/gpu/stream_bench
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
if [ "${PREBUILT:-1}" != 1 ] || ! "$TEST" --gtest_list_tests > /dev/null 2>&1 || ! [ -x "$BENCH" ]; then
  echo "stream_check: building $TEST and $BENCH here"
  # shellcheck disable=SC2086
  cmake --preset cuda -B build/cuda -DTESSERA_WERROR=ON $TESSERA_DEPS_CMAKE_ARGS > "$OUTDIR/configure.log" 2>&1 &&
    cmake --build build/cuda -j"${JOBS:-16}" --target stream_gpu_test stream_bench > "$OUTDIR/build.log" 2>&1 ||
    { tail -40 "$OUTDIR/configure.log" "$OUTDIR/build.log"; exit 1; }
fi
rc=0
if [ "${SKIP_TEST:-0}" != 1 ]; then
  timeout -k 5 "${TEST_S:-150}" "$TEST" > "$OUTDIR/test.log" 2>&1
  rc=$?
  grep -E "^\[stream\]|OK \]|FAILED|Failure|Expected|Which is|actual|PASSED" "$OUTDIR/test.log" | head -60
  echo "stream_check: StreamGpu tests exit $rc"
fi
[ "${SKIP_BENCH:-0}" = 1 ] && exit $rc
TIME_S=${TIME_S:-240}
HEAD_ARGS=()
if [ -n "${HEADS:-}" ]; then
  for ((l = 0; l < HEADS; ++l)); do echo "$l 0 0.5"; done > "$OUTDIR/retrieval-heads.txt"
  HEAD_ARGS=(--retrieval-heads "$OUTDIR/retrieval-heads.txt")
fi
timeout -k 10 "$TIME_S" "$BENCH" "${HEAD_ARGS[@]}" --seq "${SEQS:-8192,32768,131072}" \
  --methods "${METHODS:-streamingllm,infllm,ltri,infllm-host,ltri-host}" \
  --method-max-seq "ltri=${DEVICE_MAX:-131072},infllm=${DEVICE_MAX:-131072},ltri-host=${HOST_MAX:-8192},infllm-host=${HOST_MAX:-8192}" \
  --dense "${DENSE:-131072}" --decode "${DECODE:-16}" --chunk "${CHUNK:-512}" --host-budget 100e9 --prepin \
  --max-seconds $((TIME_S - 30)) --csv "$OUTDIR/bench.csv" > "$OUTDIR/bench.log" 2>&1
echo "stream_check: stream_bench exit $? (124: cut at ${TIME_S} s)"
cat "$OUTDIR/bench.log"
exit $rc
