#!/usr/bin/env bash
# Host emulation of the device index build (lower_cuda.cu, "VS estimator/index v2" and "Index build v3" in
# NOTES.md): extract.py pulls the kernels' own source, ../bs_emulation/shim.h (+ vs_shim.h) runs every lane as a
# fiber. lower_runs.cpp compares the warp build with the runs and the column coverage against lower_tile for
# random VS heads; lower_bs.cpp the warp build of block-sparse heads (per kind and warp-for-all layers with other
# kinds); topk.cpp VsTopK (estimate_cuda.cu).
# Usage: bash tests/gpu/vs_emulation/run.sh [vs cases] [bs cases]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 "$here/extract.py" "$work"
g++ -std=c++20 -O1 -Wno-unknown-pragmas -I"$work" -I"$here" -I"$here/../bs_emulation" -I"$root/src" \
  -o "$work/lower_runs" "$here/lower_runs.cpp"
"$work/lower_runs" ${1:-}
g++ -std=c++20 -O1 -Wno-unknown-pragmas -I"$work" -I"$here" -I"$here/../bs_emulation" -I"$root/src" \
  -o "$work/lower_bs" "$here/lower_bs.cpp"
"$work/lower_bs" ${2:-}
g++ -std=c++20 -O1 -Wno-unknown-pragmas -I"$work" -I"$here" -I"$here/../bs_emulation" -I"$root/src" \
  -o "$work/topk" "$here/topk.cpp"
"$work/topk"
