#!/usr/bin/env bash
# scripts/gpu/stream_nsys.sh — where the GPU idles in a streaming prefill (issue 35): one stream_bench row under
# Nsight Systems (CUDA trace only), exported to sqlite and summarised by scripts/gpu/nsys_gaps.py (the device's busy
# share in a window of the prefill, the idle gaps by the activities around them). device: build/gpu-bin unpacked.
#   SEQ (262144), CHUNK (1024), METHOD (ltri-earlyvotes), BENCH (build/gpu-bin/stream_bench), TAG (names the files),
#   FROM / TO (the window, fractions of the run's device activity: 0.5 / 0.9).
# Writes $OUT/nsys-$TAG.md (the sqlite is left in /tmp: hundreds of MB).
set -uo pipefail
. scripts/gpu/lib.sh
lib_init
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
export LD_LIBRARY_PATH=$PWD/build/gpu-bin/lib:${LD_LIBRARY_PATH:-}
nsys=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems*/bin/nsys /usr/local/cuda*/nsight-systems*/bin/nsys 2> /dev/null | head -1)
[ -n "$nsys" ] || { echo "stream_nsys: no nsys"; exit 1; }
out=${OUT:-/tmp/stream-nsys}
tag=${TAG:-new}
mkdir -p "$out"
rep=/tmp/nsys-$tag
timeout "${NSYS_TIMEOUT:-240}" "$nsys" profile -t cuda -s none --cpuctxsw none -o "$rep" --force-overwrite true \
  "${BENCH:-build/gpu-bin/stream_bench}" --seq "${SEQ:-262144}" --dense 0 --decode 0 --chunk "${CHUNK:-1024}" \
  --host-kv fp8 --gemm fp8 --retrieval-heads docs/streaming/ltri-llm-retrieval-heads.txt \
  --methods "${METHOD:-ltri-earlyvotes}" > "$out/nsys-$tag.log" 2>&1
"$nsys" export -t sqlite -o "$rep.sqlite" --force-overwrite true "$rep.nsys-rep" >> "$out/nsys-$tag.log" 2>&1
python3 scripts/gpu/nsys_gaps.py "$rep.sqlite" --from "${FROM:-0.5}" --to "${TO:-0.9}" \
  --title "$tag: ${METHOD:-ltri-earlyvotes} at ${SEQ:-262144}, chunk ${CHUNK:-1024}" | tee "$out/nsys-$tag.md"
