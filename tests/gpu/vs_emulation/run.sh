#!/usr/bin/env bash
# Host emulation of the VS device index build (lower_cuda.cu, "VS estimator/index v2" in NOTES.md): extract.py
# pulls the kernels' own source, ../bs_emulation/shim.h (+ vs_shim.h) runs every lane as a fiber. lower_runs.cpp
# compares the warp build with the runs against lower_tile for random VS heads.
# Usage: bash tests/gpu/vs_emulation/run.sh [cases]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 "$here/extract.py" "$work"
g++ -std=c++20 -O1 -Wno-unknown-pragmas -I"$work" -I"$here" -I"$here/../bs_emulation" -I"$root/src" \
  -o "$work/lower_runs" "$here/lower_runs.cpp"
"$work/lower_runs" "$@"
g++ -std=c++20 -O1 -Wno-unknown-pragmas -I"$work" -I"$here" -I"$here/../bs_emulation" -I"$root/src" \
  -o "$work/topk" "$here/topk.cpp"
"$work/topk"
