#!/usr/bin/env bash
# scripts/python_wheel_check.sh — `pip install .` into a fresh virtual environment (build/wheel-venv), as a user
# would, then checks the installed package: the module, its stubs and py.typed are there, and the engine's greedy
# answer on the real SmolLM2 equals `tessera run`'s (TESSERA_CLI, default build/ci/src/tessera). scripts/test.sh
# runs it; prints "Python wheel: ok (N s)". CPU only (TESSERA_CUDA=OFF: CI's compile-only CUDA step covers CUDA);
# pip fetches the build dependencies (scikit-build-core, nanobind) into its isolated build environment.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
VENV=build/wheel-venv
MODEL="${TESSERA_MODELS:-$HOME/.cache/tessera/models}/smollm2-135m-instruct-q4_1.gguf"
CLI="${TESSERA_CLI:-build/ci/src/tessera}"
rm -rf "$VENV" build/wheel
"${PYTHON:-python3}" -m venv "$VENV"
LOG=build/wheel-install.log
if ! "$VENV/bin/python" -m pip install --disable-pip-version-check . -Ccmake.define.TESSERA_CUDA=OFF \
  -Cbuild-dir=build/wheel > "$LOG" 2>&1; then
  tail -n 40 "$LOG"
  echo "Python wheel: FAILED (pip install .; full log in $LOG)"
  exit 1
fi
expected=$("$CLI" run -m "$MODEL" -p "The capital of France is" -n 12 | python3 -c '
import sys
out = sys.stdin.read()
start = out.index("answer: ") + len("answer: ")
print(out[start:out.index("\n[dense] prefill", start)], end="")')
cd build  # not the source tree: import the installed package
EXPECTED="$expected" MODEL="$MODEL" "../$VENV/bin/python" - <<'PY'
import os
from pathlib import Path

import tessera

pkg = Path(tessera.__file__).parent
assert "site-packages" in str(pkg), f"imported {pkg}, not the installed wheel"
for f in ("_tessera.pyi", "py.typed", "ops.py", "hf.py"):
    assert (pkg / f).exists(), f"{f} missing from the wheel"
model = tessera.Model.load(os.environ["MODEL"])
text = tessera.Engine(model).generate("The capital of France is", max_tokens=12)
assert text == os.environ["EXPECTED"], (text, os.environ["EXPECTED"])
try:
    import torch  # noqa: F401
except ImportError:
    pass
else:
    raise AssertionError("the fresh environment should not have torch")
print(f"installed at {pkg}; greedy answer equals the CLI's: {text!r}")
PY
echo "Python wheel: ok ($(( $(date +%s) - start )) s)"
