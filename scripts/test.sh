#!/usr/bin/env bash
# Builds tessera and runs every CPU test (the README's test command; .ci/run calls it), then compiles the CUDA
# backend (compile only, no GPU: `cmake --preset cuda-ci`, sm_90a, warnings as errors; build target cuda_all =
# tessera_cuda, tessera_runtime_cuda, the GPU tests and benches, the CLI with --device cuda) and prints
# "CUDA compile: N s". Fails if a test fails or the CUDA code does not compile; the CUDA step is skipped, with a
# message, only where no nvcc is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh models   # apt packages + the real test models (PyPI)
cmake --preset ci >/dev/null
cmake --build build/ci -j "$(nproc)"
ctest --preset ci -j "$(nproc)" --timeout 600

if ! command -v nvcc > /dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=$PATH:/usr/local/cuda/bin
fi
if ! command -v nvcc > /dev/null; then
  echo "CUDA compile: skipped (no nvcc on PATH or in /usr/local/cuda/bin)"
  exit 0
fi
LOG=build/cuda-ci.log
start=$(date +%s)
if ! { cmake --preset cuda-ci && cmake --build --preset cuda-ci -j "$(nproc)"; } > "$LOG" 2>&1; then
  echo "CUDA compile: FAILED after $(( $(date +%s) - start )) s (cmake --preset cuda-ci; full log in $LOG):"
  grep -E "error|Error|FAILED" "$LOG" | head -40
  tail -n 30 "$LOG"
  exit 1
fi
echo "CUDA compile: $(( $(date +%s) - start )) s ($(grep -m1 -oE 'tessera: building [^;]*' "$LOG" | sed 's/tessera: //'); sm_90a, warnings as errors)"
