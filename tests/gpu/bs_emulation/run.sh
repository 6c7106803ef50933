#!/usr/bin/env bash
# Host emulation of the BS estimator's kernels (estimate_cuda.cu, "BS estimator v2" in NOTES.md), no GPU needed:
# extract.py pulls the kernels' own source out of estimate_cuda.cu / estimate_cuda.h / block_topk.cuh, shim.h runs
# every lane as a fiber (ucontext) of one CPU thread, synchronising warps and blocks at __syncwarp, __syncthreads
# and the warp intrinsics (cp.async is a plain copy). warp_topk.cpp checks WarpTopK on random rows (ties, NaN, +-0,
# rows from registers and from memory); pipeline.cpp runs pooling, scoring and selection over small layers (odd
# sizes, chunks with a cache tail, several block sizes, top_k 0 / 1 / >= blocks, exact ties, many waves, rows
# longer than 2048 blocks) and compares every query block's key blocks with a direct f32 evaluation of the
# estimate's definition. It catches logic and indexing errors, not memory-model ones (racecheck on the device does
# those). Usage: bash tests/gpu/bs_emulation/run.sh [case name]   (about 2 minutes for all cases)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 "$here/extract.py" "$work"
g++ -std=c++20 -O1 -Wno-unknown-pragmas -I"$work" -I"$here" -o "$work/warp_topk" "$here/warp_topk.cpp"
g++ -std=c++20 -O1 -Wno-unknown-pragmas -I"$work" -I"$here" -o "$work/pipeline" "$here/pipeline.cpp"
"$work/warp_topk"
"$work/pipeline" "$@"
