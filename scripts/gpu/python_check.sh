#!/usr/bin/env bash
# scripts/gpu/python_check.sh — the Python module on a GPU machine, in one call: build it with the CUDA backend,
# run the Python tests (the CUDA ones included), time the ops against the C++ bench (binding overhead), and time a
# patched Hugging Face Llama-3-8B-shaped model's prefill (TTFT) against unpatched SDPA.
#
#   here (Debian 12), once:  bash scripts/gpu/deps.sh download          (build/gpu-debs, ~15 MB)
#   there:                   bash scripts/gpu/python_check.sh          (device call, carry ["build/gpu-debs"],
#                                                                       timeout 600)
# The image has torch, transformers, nanobind and pytest; the build dependencies it lacks come from build/gpu-debs.
# Steps (logs in build/py-gpu/logs/<step>.log, packed into $OUT/logs.tgz at the end; a failing step does not stop
# the later ones; every step is capped so that the whole run stays within PY_CHECK_BUDGET_S, default 570 s):
#   build    cmake (Release, CUDA sm_90a, TESSERA_PYTHON=ON, benches on) + targets _tessera, attention_gpu_bench
#   pytest   tests/python/test_cuda.py (PYTEST_ALL=1: all of tests/python; the engine-vs-CLI tests skip there)
#   ops      attention_gpu_bench --inputs random --kernel auto (C++) and scripts/gpu/python_bench.py ops (the same
#            shapes and patterns through tessera.ops.sparse_attention and through the raw binding): a table of
#            C++ total ms, Python ms and their ratio (goal: within 1.03)
#   ttft     scripts/gpu/python_bench.py ttft: Llama-3.1-8B config, random bf16 weights, TTFT at 32K and 128K:
#            unpatched SDPA, then tessera.hf.patch with each of TTFT_ATTN (default "dense,vs,trianglemix"); best of
#            TTFT_REPS (2: the first call of a new length also builds tessera's per-shape plans, e.g. cuDNN's)
# Environment: OUT (default build/py-gpu/out), JOBS (16), OPS_SEQ (32768,131072), TTFT_SEQ (32768,131072), TTFT_ATTN,
# TTFT_LAYERS (0: all 32), SKIP_PYTEST=1, PYTEST_ALL=1, SKIP_OPS=1, SKIP_TTFT=1, NO_TOUCH=1.
# Prints, at the end, summary.txt: one line per step (ok / FAILED / TIMEOUT and seconds, the tail of a failed step's
# log), the ops table and the TTFT table. $OUT gets 7 files: summary.txt, ops.md, ttft.md, ops_cpp.csv,
# ops_python.csv, ttft.csv, logs.tgz.
set -u
set -o pipefail
cd "$(dirname "$0")/../.." || exit 1
ROOT=$PWD
OUT=${OUT:-$ROOT/build/py-gpu/out}
LOGS=$ROOT/build/py-gpu/logs
BUILD=$ROOT/build/py-cuda
JOBS=${JOBS:-16}
BUDGET=${PY_CHECK_BUDGET_S:-570}
START=$(date +%s)
rm -rf "$LOGS"
mkdir -p "$OUT" "$LOGS"
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
export PATH=$PATH:/usr/local/cuda/bin
export PYTHONUNBUFFERED=1
# The tree arrives with the sender's modification times: touch the sources so that a warm machine rebuilds them
# (NO_TOUCH=1 skips this for a second call on the same tree, e.g. SKIP_PYTEST=1 SKIP_OPS=1 after a first call).
[ "${NO_TOUCH:-0}" = 1 ] || find "$ROOT/src" "$ROOT/bench" -type f -exec touch {} +

step() {  # step NAME MAX_SECONDS CMD...
  local name=$1 max=$2 left cap rc t0 status=ok
  shift 2
  left=$((BUDGET - ($(date +%s) - START)))
  cap=$max
  [ "$left" -lt "$cap" ] && cap=$left
  if [ "$cap" -lt 10 ]; then
    echo "$name SKIPPED (budget spent)" | tee -a "$SUMMARY"
    return 99
  fi
  t0=$(date +%s)
  timeout -k 10 "$cap" "$@" > "$LOGS/$name.log" 2>&1
  rc=$?
  [ $rc -eq 124 ] && status="TIMEOUT after ${cap}s"
  [ $rc -ne 0 ] && [ $rc -ne 124 ] && status="FAILED rc=$rc (tail of $name.log below)"
  echo "$name $status ($(( $(date +%s) - t0 ))s)" | tee -a "$SUMMARY"
  [ $rc -ne 0 ] && { tail -n 25 "$LOGS/$name.log"; echo; } | sed 's/^/    /' | tee -a "$SUMMARY"
  return $rc
}

{
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
  python3 -c 'import torch, transformers, nanobind; print("torch", torch.__version__, "transformers", transformers.__version__, "nanobind", nanobind.__version__)'
  # The module compiles against the interpreter's headers (Python.h): say where they are, or that they are missing.
  python3 -c 'import os, sys, sysconfig; i = sysconfig.get_paths()["include"]; print(sys.executable, sys.version.split()[0], "headers", i, "ok" if os.path.exists(os.path.join(i, "Python.h")) else "MISSING (Python.h)")'
} 2>&1 | tee -a "$SUMMARY"

TESSERA_DEPS_CMAKE_ARGS=""
if [ -d "$ROOT/build/gpu-debs" ]; then
  bash scripts/gpu/deps.sh unpack > "$LOGS/deps.log" 2>&1 && . "$ROOT/build/gpu-sysroot/deps.env"
else
  echo "no build/gpu-debs carried: the build needs nlohmann_json, PCRE2 and OpenBLAS from the image" | tee -a "$SUMMARY"
fi
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}

build() {
  # shellcheck disable=SC2086
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTESSERA_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a \
    -DTESSERA_PYTHON=ON -DTESSERA_BUILD_TESTS=OFF -DTESSERA_BUILD_BENCH=ON -DPython_EXECUTABLE="$(command -v python3)" \
    $TESSERA_DEPS_CMAKE_ARGS &&
    cmake --build "$BUILD" -j "$JOBS" --target _tessera attention_gpu_bench &&
    python3 -c "import sys; sys.path.insert(0, '$BUILD/python'); import tessera; assert tessera.built_with_cuda, 'built without CUDA'; print('tessera module:', tessera._tessera.__file__)"
}
export -f build
export ROOT BUILD JOBS TESSERA_DEPS_CMAKE_ARGS
if step build 330 bash -c build; then
  export PYTHONPATH=$BUILD/python
  if [ "${SKIP_PYTEST:-0}" != 1 ]; then
    # The CUDA tests (ops against masked SDPA, steps, stream, zero-copy, torch.compile; the GPU engine against the
    # CPU engine); the CPU tests run in CI (PYTEST_ALL=1: all of tests/python here too).
    tests=tests/python/test_cuda.py
    [ "${PYTEST_ALL:-0}" = 1 ] && tests=tests/python
    TESSERA_ALLOW_MISSING_MODELS=1 step pytest 150 python3 -m pytest -q -p no:cacheprovider "$tests" -rs
  fi
  if [ "${SKIP_OPS:-0}" != 1 ]; then
    step ops_cpp 90 "$BUILD/bench/gpu/attention_gpu_bench" --seq "${OPS_SEQ:-32768,131072}" \
      --patterns dense,ashape,triangle,vs,bs --inputs random --kernel auto --reps 5 --csv "$OUT/ops_cpp.csv"
    step ops 120 python3 scripts/gpu/python_bench.py ops --seq "${OPS_SEQ:-32768,131072}" --cpp-csv "$OUT/ops_cpp.csv" \
      --md "$OUT/ops.md" --csv "$OUT/ops_python.csv"
  fi
  if [ "${SKIP_TTFT:-0}" != 1 ]; then
    step ttft 300 python3 scripts/gpu/python_bench.py ttft --seq "${TTFT_SEQ:-32768,131072}" \
      --attn "${TTFT_ATTN:-dense,vs,trianglemix}" --layers "${TTFT_LAYERS:-0}" --reps "${TTFT_REPS:-2}" \
      --md "$OUT/ttft.md" --csv "$OUT/ttft.csv"
  fi
fi
tar czf "$OUT/logs.tgz" -C "$LOGS" . 2> /dev/null
echo
echo "== summary ($(( $(date +%s) - START )) s) =="
cat "$SUMMARY"
for f in ops.md ttft.md; do
  [ -f "$OUT/$f" ] && { echo; cat "$OUT/$f"; }
done
exit 0
