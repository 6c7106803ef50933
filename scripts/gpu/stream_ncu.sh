#!/usr/bin/env bash
# scripts/gpu/stream_ncu.sh — every kernel of a window of one stream_bench run timed by Nsight Compute (each launch
# replayed alone: durations, not the overlap), summed per kernel name (scripts/gpu/ncu_kernels.py), for the
# streaming decisions' GPU profile (issue 35). device: carry ["build/gpu-pack"] with build/gpu-bin unpacked.
#   SEQ (32768), CHUNK (1024), METHOD (ltri-earlyvotes), SKIP launches before the window (20000: past the chunks before
#   the first eviction), COUNT launches in it (1500), BENCH (build/gpu-bin/stream_bench), TAG (names the files).
# Writes $OUT/ncu-$TAG.csv and $OUT/ncu-$TAG.md.
set -uo pipefail
. scripts/gpu/lib.sh
lib_init
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
export LD_LIBRARY_PATH=$PWD/build/gpu-bin/lib:${LD_LIBRARY_PATH:-}
ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2> /dev/null | head -1)
[ -n "$ncu" ] || { echo "stream_ncu: no ncu"; exit 1; }
out=${OUT:-/tmp/stream-ncu}
tag=${TAG:-new}
mkdir -p "$out"
timeout "${NCU_TIMEOUT:-240}" "$ncu" --clock-control none --launch-skip "${SKIP:-20000}" --launch-count "${COUNT:-1500}" \
  --metrics gpu__time_duration.sum --csv --page raw --print-units base \
  "${BENCH:-build/gpu-bin/stream_bench}" --seq "${SEQ:-32768}" --dense 0 --decode 0 --chunk "${CHUNK:-1024}" \
  --host-kv fp8 --gemm fp8 --retrieval-heads docs/streaming/ltri-llm-retrieval-heads.txt \
  --methods "${METHOD:-ltri-earlyvotes}" > "$out/ncu-$tag.csv" 2> "$out/ncu-$tag.err"
python3 scripts/gpu/ncu_kernels.py "$out/ncu-$tag.csv" "$tag: ${METHOD:-ltri-earlyvotes} at ${SEQ:-32768}, chunk ${CHUNK:-1024}" |
  tee "$out/ncu-$tag.md"
