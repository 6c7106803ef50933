#!/usr/bin/env bash
# Builds tessera and runs every CPU test (the README's test command; .ci/run calls it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh models   # apt packages + the real test models (PyPI)
cmake --preset ci >/dev/null
cmake --build build/ci -j "$(nproc)"
ctest --preset ci -j "$(nproc)" --timeout 600
