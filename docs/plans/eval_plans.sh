#!/usr/bin/env bash
# Evaluates the plans of docs/plans/ against dense and the hand presets at about the same density (README.md there).
#   bash docs/plans/eval_plans.sh [TESSERA] [MODEL...]      (default: build/ci/src/tessera, smollm2 gemma3)
# Same cases for every policy: niah_single at 4096 tokens, needles at 25/75% depth (a small set: the CPU is slow); per-layer
# attention recall/density at 4096 (--layer-stats). Output: docs/plans/eval-<model>/ (report.md, results.json, ...).
set -euo pipefail
cd "$(dirname "$0")/../.."
TESSERA=${1:-build/ci/src/tessera}
shift || true
MODELS=("${@:-smollm2 gemma3}")
MODELS_DIR=${TESSERA_MODELS:-$HOME/.cache/tessera/models}
declare -A FILE=([smollm2]=smollm2-135m-instruct-q4_1.gguf [gemma3]=gemma-3-270m-q4_k_m.gguf)
# The presets each plan is compared with (densities at 4096 in README.md):
#  trianglemix: the preset's own split (start = layers / 2);
#  moa: one uniform MoA window with the plan's density at 4096 (alpha 0, beta from the window's exact density);
#  minference: each of the plan's candidates on every head (the VS shape most heads chose, and the A-shape).
declare -A PRESETS=(
  [smollm2]="trianglemix;moa:alpha=0,beta=0.2095;vs:v=87,s=261;ashape:sink=60,local=241"
  [gemma3]="trianglemix;moa:alpha=0,beta=0.2041;vs:v=87,s=261;ashape:sink=60,local=241"
)
for model in ${MODELS[@]}; do
  plans="docs/plans/$model-trianglemix.json;docs/plans/$model-moa.json;docs/plans/$model-minference.json"
  "$TESSERA" eval -m "$MODELS_DIR/${FILE[$model]}" --tasks niah_single -l 4096 --depths 25,75 \
    --attn "$plans;${PRESETS[$model]}" --layer-stats 4096 --device cpu -o "docs/plans/eval-$model"
done
