#!/usr/bin/env bash
# TriangleMix's start layer checked by a sweep on the accuracy harness (issue 16; trianglemix.txt validates its split
# the same way): the plan's start layer against earlier and later ones, same Triangle (8, 512, 128), dense shallow
# layers, on the same cases as dense — needles at 4096 tokens (25% and 75% depth), perplexity of the haystack at 4096, and the
# per-layer attention recall at 4096.
#   bash docs/plans/sweep_trianglemix.sh [TESSERA]        (default build/ci/src/tessera; SmolLM2-135M, its plan: 22)
set -euo pipefail
cd "$(dirname "$0")/../.."
TESSERA=${1:-build/ci/src/tessera}
MODEL=${TESSERA_MODELS:-$HOME/.cache/tessera/models}/smollm2-135m-instruct-q4_1.gguf
attn=""
for start in 6 12 18 22 26 30; do
  attn="$attn;trianglemix:start=$start,sink=8,local=512,last=128"
done
"$TESSERA" eval -m "$MODEL" --tasks niah_single -l 4096 --depths 25,75 --attn "${attn#;}" \
  --perplexity 4096 --layer-stats 4096 --device cpu -o docs/plans/sweep-trianglemix-smollm2
