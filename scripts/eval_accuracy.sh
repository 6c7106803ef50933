#!/usr/bin/env bash
# The accuracy runs behind docs/accuracy/ (issue 6): dense and six sparse policies on the same cases, on the two
# real CPU test models. Each run appends to its folder's results.json (--resume), so an interrupted run picks up
# where it stopped, and re-running a finished one costs nothing.
#
#   bash scripts/eval_accuracy.sh smollm2     # SmolLM2-135M-Instruct, up to 8K      (about 60 min on 2 idle cores)
#   bash scripts/eval_accuracy.sh gemma       # Gemma-3-270M: layer metrics and perplexity (the task grid runs on
#                                             # the GPU: scripts/gpu/run.sh eval)
#   bash scripts/eval_accuracy.sh smoke       # a few cases, as CI's smoke test runs
set -euo pipefail
cd "$(dirname "$0")/.."
MODELS=${TESSERA_MODELS:-$HOME/.cache/tessera/models}
T=${TESSERA_BIN:-build/release/src/tessera}
[ -x "$T" ] || { cmake --preset release >/dev/null && cmake --build build/release -j"$(nproc)" --target tessera; }

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
    # The task cases of Gemma-3 (needle grid to 32K, six RULER tasks) run on the GPU engine:
    # scripts/gpu/run.sh eval (docs/accuracy/gemma-3-270m-gpu). The CPU adds what only the CPU engine measures.
    M=$MODELS/gemma-3-270m-q4_k_m.gguf; D=docs/accuracy/gemma-3-270m
    $T eval -m "$M" --tasks none --layer-stats 2048 --perplexity 4096,8192 --attn "$POLICIES" -o $D
    ;;
  smoke)
    bash tests/cli/eval_smoke.sh "$T"
    ;;
  *) echo "usage: $0 smollm2|gemma|smoke"; exit 2 ;;
esac
