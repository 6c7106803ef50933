#!/usr/bin/env bash
# The accuracy runs behind docs/accuracy/ (issue 6): dense and six sparse policies on the same cases, on the two
# real CPU test models. Each run appends to its folder's results.json (--resume), so an interrupted run picks up
# where it stopped, and re-running a finished one costs nothing.
#
#   bash scripts/eval_accuracy.sh smollm2     # SmolLM2-135M-Instruct, up to 8K      (about 40 min on 2 cores)
#   bash scripts/eval_accuracy.sh gemma       # Gemma-3-270M, up to 32K              (about 90 min on 2 cores)
#   bash scripts/eval_accuracy.sh smoke       # a few cases, as CI's smoke test runs
set -euo pipefail
cd "$(dirname "$0")/.."
MODELS=${TESSERA_MODELS:-$HOME/.cache/tessera/models}
[ -x build/release/src/tessera ] || { cmake --preset release >/dev/null && cmake --build build/release -j"$(nproc)" --target tessera; }
T=build/release/src/tessera
POLICIES="vs:v=256,s=1024;bs:top_k=16;ashape:sink=64,local=1024;triangle:sink=64,local=1024,last=64;trianglemix;moa:alpha=512,beta=0.25,sink=64"

case "${1:-}" in
  smollm2)
    M=$MODELS/smollm2-135m-instruct-q4_1.gguf; D=docs/accuracy/smollm2-135m
    # The needle grid: 3 lengths x 3 depths, every policy.
    $T eval -m "$M" --tasks niah_single --lengths 2048,4096,8192 --depths 10,50,90 --attn "$POLICIES" -o $D --resume
    # The other RULER-style tasks at 4K.
    $T eval -m "$M" --tasks niah_multikey,niah_multivalue,passkey,variable_tracking,common_words,frequent_words \
      --lengths 4096 --depths 50 --attn "$POLICIES" -o $D --resume
    $T eval -m "$M" --tasks none --layer-stats 2048 --perplexity 2048,8192 --attn "$POLICIES" -o $D
    ;;
  gemma)
    M=$MODELS/gemma-3-270m-q4_k_m.gguf; D=docs/accuracy/gemma-3-270m
    $T eval -m "$M" --tasks niah_single --lengths 4096,8192 --depths 10,50,90 --attn "$POLICIES" -o $D --resume
    $T eval -m "$M" --tasks niah_single --lengths 16384,32768 --depths 50 --attn "$POLICIES" -o $D --resume
    $T eval -m "$M" --tasks niah_multikey,variable_tracking,common_words --lengths 4096 --depths 50 \
      --attn "$POLICIES" -o $D --resume
    $T eval -m "$M" --tasks none --layer-stats 2048 --perplexity 4096,8192 --attn "$POLICIES" -o $D
    ;;
  smoke)
    bash tests/cli/eval_smoke.sh "$T"
    ;;
  *) echo "usage: $0 smollm2|gemma|smoke"; exit 2 ;;
esac
