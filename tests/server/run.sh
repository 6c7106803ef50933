#!/usr/bin/env bash
# Runs one tests/server script against `tessera serve` on the real SmolLM2-135M, with the Python that has OpenAI's
# client (build/venv, made by scripts/setup.sh models; or $TESSERA_PYTHON).
#   tests/server/run.sh <path to the tessera binary> <script.py>
# Exit 77 (ctest: skipped) when the model is missing and TESSERA_ALLOW_MISSING_MODELS=1, as the other real-model
# tests do; a missing model or client otherwise fails.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
export TESSERA_BIN=$1
MODELS=${TESSERA_MODELS:-$HOME/.cache/tessera/models}
export TESSERA_MODEL=$MODELS/smollm2-135m-instruct-q4_1.gguf
if [ ! -f "$TESSERA_MODEL" ]; then
  if [ "${TESSERA_ALLOW_MISSING_MODELS:-0}" = 1 ]; then echo "skip: $TESSERA_MODEL is missing"; exit 77; fi
  echo "FAIL: $TESSERA_MODEL is missing (run scripts/setup.sh models)"; exit 1
fi
PY=${TESSERA_PYTHON:-$ROOT/build/venv/bin/python}
if ! "$PY" -c "import openai" 2>/dev/null; then
  echo "FAIL: $PY has no openai package (run scripts/setup.sh models, which makes build/venv)"; exit 1
fi
exec "$PY" "$HERE/$2"
