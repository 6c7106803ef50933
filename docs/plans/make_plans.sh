#!/usr/bin/env bash
# Makes the plans of docs/plans/ (README.md there says what they are and how they compare with the presets).
#   bash docs/plans/make_plans.sh [TESSERA] [METHODS...]     (default: build/ci/src/tessera, all three methods)
# Needs the real test models (scripts/fetch_models.sh). CPU only; times are in docs/plans/README.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
TESSERA=${1:-build/ci/src/tessera}
shift || true
METHODS=("${@:-trianglemix moa minference}")
MODELS_DIR=${TESSERA_MODELS:-$HOME/.cache/tessera/models}
declare -A FILE=([smollm2]=smollm2-135m-instruct-q4_1.gguf [gemma3]=gemma-3-270m-q4_k_m.gguf)
for model in smollm2 gemma3; do
  for method in ${METHODS[@]}; do
    case $method in
      trianglemix) args=(--lengths 1024,2048 --samples 2) ;;
      moa) args=(--lengths 1024,2048 --samples 2 --budget 0.5 --validation-length 3072) ;;
      minference) args=(--lengths 2048 --samples 2 --budget 0.3) ;;
    esac
    echo "== $model $method"
    /usr/bin/time -v "$TESSERA" plan --method "$method" -m "$MODELS_DIR/${FILE[$model]}" "${args[@]}" \
      --report-lengths 4096,16384,65536 -o "docs/plans/$model-$method.json" \
      > "docs/plans/$model-$method.txt" 2> "docs/plans/$model-$method.log"
    grep -E "Maximum resident|Elapsed" "docs/plans/$model-$method.log" || true
  done
done
