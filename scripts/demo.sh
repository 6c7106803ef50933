#!/usr/bin/env bash
# The README's main job: set everything up, build, and run a long prompt through a real small model with dense
# and with sparse attention, printing both answers, the prefill times and the speedup.
# Until the model runtime is complete it runs the attention benchmark (dense vs every pattern at 16K).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake --preset release >/dev/null
cmake --build build/release -j "$(nproc)" --target attention_bench
./build/release/bench/attention_bench --seq 16384 --dim 128
