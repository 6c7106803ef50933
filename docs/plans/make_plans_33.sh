#!/usr/bin/env bash
# The SmolLM2 plans of issue 33 (README.md, "Plans for the lengths they run at"): made for a range of lengths
# ("planned_lengths" in the file), MInference sized for the longest with no degenerate candidates, MoA with its
# calibration noise and its pick by held-out tasks. CPU; the commands as run, with what each printed in *.txt.
#   bash docs/plans/make_plans_33.sh [TESSERA]        (default: build/ci/src/tessera)
# Gemma-3 at 8K-32K: docs/plans/gemma3_gpu.sh on a GPU machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
T=${1:-build/ci/src/tessera}
M=${TESSERA_MODELS:-$HOME/.cache/tessera/models}/smollm2-135m-instruct-q4_1.gguf
run() {  # name, arguments
  local name=$1
  shift
  /usr/bin/time -v "$T" plan -m "$M" "$@" --report-lengths 2048,4096,8192 -o "docs/plans/$name.json" \
    > "docs/plans/$name.txt" 2> "docs/plans/$name.log"
  grep -E "Maximum resident|Elapsed" "docs/plans/$name.log" || true
}
# MInference: one long retrieval sample at each end of the range (MInference searches on one), sized for 4K.
run smollm2-minference-2k-4k --method minference --lengths 2048,4096 --samples 1 --budget 0.3 --validation-cases 0
# MInference for 2K-8K (README.md, "MInference's per-head choice on the rows that answer"): sized for 8K at 0.15
# (~0.3 at 4K), one sample per length, the choice by all-row and query-row error (--minference-query-weight 0.75, the
# default), and the held-out repair on 2 tasks at 2K and 4K.
run smollm2-minference-2k-8k --method minference --lengths 2048,4096,8192 --samples 1 --budget 0.15 \
  --validation-length 2048,4096 --validation-cases 2 --minference-repair
# MoA: 3 items per profiled length, the Pareto pick by 2 held-out tasks at 2K, then perplexity.
run smollm2-moa-1k-2k --method moa --lengths 1024,2048 --samples 3 --budget 0.5 --validation-length 2048 \
  --validation-cases 2 --moa-loss first-order  # made before the Fisher loss existed (then the only estimate)
# MoA with the Fisher (second-order) rule loss, the default since 6e00e7b (--moa-loss fisher): the same calibration
# and held-out tasks as the first-order plan above.
run smollm2-moa-fisher-1k-2k --method moa --lengths 1024,2048 --samples 3 --budget 0.5 --validation-length 2048 \
  --validation-cases 2 --moa-loss fisher
