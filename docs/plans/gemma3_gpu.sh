#!/usr/bin/env bash
# Issue 33 on the GPU (for the lead): Gemma-3-270M plans for 8K-32K and their rows of the table in README.md
# ("Plans against presets"). Needs the CUDA build (cmake --preset cuda; build/cuda/src/tessera), the Gemma-3 GGUF on
# the GPU machine ($TESSERA_MODELS, default ~/.cache/tessera/models) and, for MoA, CBC (coinor-libcbc-dev; the plan
# refuses MoA without it). The calibration's dense answers, the held-out answers and MInference's candidate sizing
# run on the CPU engine; the gradient passes (MoA) and the search's forward (MInference) on the GPU.
#   bash docs/plans/gemma3_gpu.sh [TESSERA]
set -euo pipefail
cd "$(dirname "$0")/../.."
T=${1:-build/cuda/src/tessera}
M=${TESSERA_MODELS:-$HOME/.cache/tessera/models}/gemma-3-270m-q4_k_m.gguf
L=8192,16384,32768
# MInference: one long retrieval sample per end of the range (its search), candidates sized for 32K.
"$T" plan --method minference -m "$M" --device cuda --lengths 8192,32768 --samples 1 --budget 0.3 \
  --validation-length 16384 --validation-cases 4 --report-lengths $L -o docs/plans/gemma3-minference-8k-32k.json \
  > docs/plans/gemma3-minference-8k-32k.txt
# MoA: 8 items per profiled length (the report's calibration_noise says whether that is enough).
"$T" plan --method moa -m "$M" --device cuda --lengths 8192,16384 --samples 8 --budget 0.5 \
  --validation-length 12288 --validation-cases 4 --report-lengths $L -o docs/plans/gemma3-moa-8k-16k.json \
  > docs/plans/gemma3-moa-8k-16k.txt
# The uniform MoA window of the MoA plan's density at 16K (the report's calibration_noise names it).
UNI=$(python3 -c "import json; print(json.load(open('docs/plans/gemma3-moa-8k-16k.report.json'))['calibration_noise'][-1]['uniform_spec'])")
P="docs/plans/gemma3-minference-8k-32k.json;docs/plans/gemma3-moa-8k-16k.json;docs/plans/gemma3-trianglemix.json"
Q="vs_adaptive;trianglemix;ashape:sink=64,local=2048;$UNI"
"$T" plan --method measure -m "$M" --lengths $L --attn "$P;$Q" -o docs/plans/eval33-gemma3-density.json
"$T" eval -m "$M" --device cuda --tasks niah_single,niah_multikey,variable_tracking -l $L --depths 25,75 \
  --attn "$P;$Q" --perplexity $L -o docs/plans/eval33-gemma3
IFS=';' read -ra POLICIES <<< "$P;$Q"
"$T" bench -m "$M" --device cuda -d 8192 16384 32768 --decode 0 --attn "${POLICIES[@]}" > docs/plans/eval33-gemma3-bench.md
