#!/usr/bin/env bash
# scripts/gpu/nccl.sh — where NCCL is, for the tensor-parallel engine (src/parallel/cuda; docs/multi-gpu.md).
#
#   bash scripts/gpu/nccl.sh locate     prints TESSERA_NCCL_ROOT=<dir> (a folder with include/nccl.h and
#                                       lib/libnccl.so*) for the first of: $TESSERA_NCCL_ROOT, the CUDA toolkit
#                                       (nvcc's folder), the nvidia-nccl-cu13 / -cu12 wheel of python3 (PyTorch's
#                                       dependency: the GPU machines' image has it), build/nccl; exit 1 if none
#   bash scripts/gpu/nccl.sh download   pip download of the wheel matching the CUDA toolkit (nvidia-nccl-cu13 for
#                                       CUDA 13, -cu12 for 12) into build/nccl-wheel, unpacked into build/nccl
#                                       (for a machine with neither; the library is large: carry it only if needed)
# src/parallel/cuda/CMakeLists.txt searches the same places itself; pass -DTESSERA_NCCL_ROOT=<dir> to choose.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD

has_nccl() { [ -f "$1/include/nccl.h" ] && ls "$1"/lib/libnccl.so* > /dev/null 2>&1; }

locate() {
  local c
  for c in "${TESSERA_NCCL_ROOT:-}" "$(dirname "$(dirname "$(command -v nvcc 2> /dev/null || echo /usr/local/cuda/bin/nvcc)")")" \
    /usr/local/cuda "$(python3 -c 'import nvidia.nccl, os; print(list(nvidia.nccl.__path__)[0])' 2> /dev/null || true)" \
    "$ROOT/build/nccl/nvidia/nccl"; do
    if [ -n "$c" ] && has_nccl "$c"; then
      echo "TESSERA_NCCL_ROOT=$c"
      grep -m1 -E '#define NCCL_(MAJOR|VERSION_CODE)' "$c/include/nccl.h" || true
      return 0
    fi
  done
  echo "nccl.sh: no NCCL found (CUDA toolkit, python3's nvidia-nccl wheel, build/nccl); try: bash scripts/gpu/nccl.sh download" >&2
  return 1
}

download() {
  local major wheel
  major=$(nvcc --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
  wheel=nvidia-nccl-cu${major:-13}
  rm -rf "$ROOT/build/nccl-wheel" "$ROOT/build/nccl"
  python3 -m pip download --no-deps --only-binary=:all: -d "$ROOT/build/nccl-wheel" "$wheel"
  mkdir -p "$ROOT/build/nccl"
  python3 -m zipfile -e "$ROOT"/build/nccl-wheel/*.whl "$ROOT/build/nccl"
  locate
}

case "${1:-}" in
  locate) locate ;;
  download) download ;;
  *) sed -n '2,12p' "$0"; exit 2 ;;
esac
