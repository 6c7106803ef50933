#!/usr/bin/env bash
# The accuracy runs on a GPU machine (docs/accuracy/<model>-gpu/): the same policies and tasks as
# scripts/eval_accuracy.sh, on the bf16 GPU engine (`tessera eval --device cuda`), with a larger grid than the CPU
# can afford. Builds tessera with the GPU engine first (scripts/gpu/check.sh BUILD_ONLY=1; carry build/gpu-debs)
# and runs the engine's GPU tests (the real models in the folder of MODEL included).
#
#   MODEL=/path/gemma-3-270m-q4_k_m.gguf NAME=gemma-3-270m HAYSTACK=kjv:/path/bible.data LENGTHS=4096,8192,16384,32768 \
#     bash scripts/gpu/eval_gpu.sh            # results tarred into $OUT/<NAME>-gpu.tgz
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-build/eval-gpu}
mkdir -p "$OUT"
: "${MODEL:?MODEL=path of the GGUF}" "${NAME:?NAME=folder name}"
HAYSTACK=${HAYSTACK:-kjv}
LENGTHS=${LENGTHS:-4096,8192,16384,32768}
TASK_LENGTHS=${TASK_LENGTHS:-4096,16384}
SAMPLES=${SAMPLES:-1}      # cases per (length, depth) of the needle grid
POLICIES="vs:v=256,s=1024;bs:top_k=16;ashape:sink=64,local=1024;triangle:sink=64,local=1024,last=64;trianglemix;moa:alpha=512,beta=0.25,sink=64"
T=build/cuda/src/tessera
if [ ! -x "$T" ]; then
  BUILD_ONLY=1 OUT=$OUT/check bash scripts/gpu/check.sh > "$OUT/build.log" 2>&1
fi
# shellcheck disable=SC1091
[ -f build/gpu-sysroot/deps.env ] && . build/gpu-sysroot/deps.env  # LD_LIBRARY_PATH: the carried OpenBLAS
if [ ! -f "$OUT/engine_test.log" ]; then
  TESSERA_MODEL_DIR=$(dirname "$MODEL") build/cuda/tests/gpu/engine_gpu_test > "$OUT/engine_test.log" 2>&1
  grep -E "^\[  PASSED|^\[  FAILED|^\[engine\] .*gguf" "$OUT/engine_test.log"
fi
D=$OUT/$NAME-gpu
"$T" eval -m "$MODEL" --device cuda --haystack "$HAYSTACK" --tasks niah_single --lengths "$LENGTHS" \
  --depths 0,25,50,75,100 --samples "${SAMPLES:-1}" --attn "$POLICIES" -o "$D" --resume 2> "$OUT/eval_niah.log" > /dev/null
"$T" eval -m "$MODEL" --device cuda --haystack "$HAYSTACK" \
  --tasks niah_multikey,niah_multivalue,passkey,variable_tracking,common_words,frequent_words \
  --lengths "$TASK_LENGTHS" --depths 50 --attn "$POLICIES" -o "$D" --resume 2> "$OUT/eval_tasks.log" > /dev/null
tail -3 "$OUT/eval_niah.log" "$OUT/eval_tasks.log"
cat "$D/report.md"
tar czf "$OUT/$NAME-gpu.tgz" -C "$OUT" "$NAME-gpu" eval_niah.log eval_tasks.log && rm -rf "$D"
