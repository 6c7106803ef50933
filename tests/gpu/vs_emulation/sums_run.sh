#!/usr/bin/env bash
# Host emulation of the VS estimate's score, stats and sums kernels (estimate_cuda.cu) of the working tree against
# a reference revision of estimate_cuda.cu (default: the one before 861c0c2, v2's serial sums): see sums.cpp.
# Usage: bash tests/gpu/vs_emulation/sums_run.sh [case name]   (REF=<git revision> to pick the reference)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git -C "$root" show "${REF:-861c0c2~1}:src/attention/cuda/estimate_cuda.cu" > "$work/ref.cu"
python3 "$here/sums_extract.py" "$work" "$work/ref.cu"
g++ -std=c++20 -O2 -Wno-unknown-pragmas -I"$work" -I"$here" -I"$here/../bs_emulation" \
  -o "$work/sums" "$here/sums.cpp"
"$work/sums" "$@"
