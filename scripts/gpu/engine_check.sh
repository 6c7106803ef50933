#!/usr/bin/env bash
# scripts/gpu/engine_check.sh — build and check the GPU engine (src/runtime_cuda) on a GPU machine, in one call.
#
#   bash scripts/gpu/engine_check.sh --pack-deps   on a build machine that has the packages: copies what the full
#                                                  runtime needs and a GPU image lacks (GTest, nlohmann_json, CLI11,
#                                                  PCRE2, OpenBLAS + libgfortran) into build/gpu-deps-engine and packs
#                                                  it as build/gpu-deps-engine.tar.xz (carry that one file)
#   bash scripts/gpu/engine_check.sh               on the GPU machine; results in $OUT (default build/engine-check)
#
# Steps (logs in build/engine-check/logs/<step>.log; a failing step does not stop the later ones; each step is
# capped so that the whole run stays within ENGINE_BUDGET_S seconds, default 520):
#   env        nvidia-smi, nvcc, cmake, torch, transformers; which dependencies are present
#   configure  cmake --preset cuda -B build/cuda-engine -DTESSERA_WERROR=ON, with the carried deps when present
#   build      tessera_runtime_cuda engine_gpu_test ttft_bench tessera
#   test       engine_gpu_test (GPU vs CPU engine on every tiny fixture, executor vs simple kernel, Llama-3-8B
#              shapes with 2 layers, the real models when TESSERA_MODEL_DIR holds them; ctest label gpu)
#   ttft       ttft_bench: Llama-3-8B shapes, random weights, 128K/32K/8K (best of 2) x dense, VS, TriangleMix (dense / VS
#              inner), A-shape (TTFT_ARGS adds or overrides arguments)
#   ttft_local ttft_bench --weights local (the same shapes, weights shaped so that attention is local with a sink as in
#              real LLMs: VS at a realistic index density instead of the plain weights' worst case), 128K and 32K, one
#              rep: dense, VS, TriangleMix with VS inner (TTFT_LOCAL_ARGS adds or overrides arguments)
#   hf         bench/gpu/hf_ttft_reference.py: transformers + SDPA on the same shapes (HF_ARGS likewise)
#   cli        tessera bench --device cuda on the real SmolLM2 when TESSERA_MODEL_DIR holds it
# $OUT receives (5 files): summary.txt (step status and the result tables), ttft.csv, ttft_local.csv, hf_ttft.csv and
# engine_logs.tar.gz (every step's log and the test XML).
# Environment: OUT, JOBS (default 16), ENGINE_BUDGET_S, TTFT_ARGS, TTFT_LOCAL_ARGS, HF_ARGS, SKIP_HF=1, SKIP_TTFT=1
# (both TTFT steps), ENGINE_USE_DEPS=0
# (ignore carried deps), ENGINE_BUILD_DIR (default build/cuda-engine),
# TESSERA_MODEL_DIR (real models), TESSERA_PREFILL_KERNEL (passed through to the attention backend).
set -u
set -o pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
DEPS=$ROOT/build/gpu-deps-engine
PACK=$ROOT/build/gpu-deps-engine.tar.xz

if [ "${1:-}" = "--pack-deps" ]; then
  set -ex
  rm -rf "$DEPS" "$PACK"
  A=/usr/lib/x86_64-linux-gnu
  mkdir -p "$DEPS/include" "$DEPS/lib/x86_64-linux-gnu/cmake" "$DEPS/share/cmake"
  # GTest and nlohmann_json as scripts/gpu/check.sh packs them (same layout, so their CMake configs resolve).
  cp -r /usr/include/gtest /usr/include/gmock /usr/include/nlohmann /usr/include/CLI "$DEPS/include/"
  cp $A/libgtest*.a $A/libgmock*.a "$DEPS/lib/x86_64-linux-gnu/"
  cp -r $A/cmake/GTest "$DEPS/lib/x86_64-linux-gnu/cmake/"
  cp -r /usr/share/cmake/nlohmann_json /usr/share/cmake/CLI11 "$DEPS/share/cmake/"
  # PCRE2 (tokenizers) and OpenBLAS (the CPU runtime's GEMMs; the CPU engine is the tests' reference).
  cp /usr/include/pcre2.h "$DEPS/include/"
  cp /usr/include/x86_64-linux-gnu/openblas-pthread/*.h "$DEPS/include/"
  cp -P $A/libpcre2-8.so* "$DEPS/lib/"
  cp $A/openblas-pthread/libopenblasp-r0.3.21.so "$DEPS/lib/libopenblas.so.0"
  ln -s libopenblas.so.0 "$DEPS/lib/libopenblas.so"
  cp -P $A/libgfortran.so.5* $A/libquadmath.so.0* "$DEPS/lib/"
  du -sh "$DEPS"
  tar -C "$ROOT/build" -cJf "$PACK" gpu-deps-engine
  ls -la "$PACK"
  echo "carry build/gpu-deps-engine.tar.xz with the call that runs scripts/gpu/engine_check.sh"
  exit 0
fi

OUT=${OUT:-$ROOT/build/engine-check}
WORK=$ROOT/build/engine-check
LOGS=$WORK/logs
mkdir -p "$OUT" "$LOGS"
export PATH=$PATH:/usr/local/cuda/bin
JOBS=${JOBS:-16}
BUDGET=${ENGINE_BUDGET_S:-520}
START=$(date +%s)
SUMMARY=$LOGS/summary.txt
: > "$SUMMARY"
BUILD_DIR=${ENGINE_BUILD_DIR:-$ROOT/build/cuda-engine}

# run_step NAME MAX_SECONDS CMD...: CMD's output in $LOGS/NAME.log, at most MAX_SECONDS and at most what is left.
run_step() {
  local name=$1 max=$2
  shift 2
  local now left cap rc t0 status
  now=$(date +%s)
  left=$((BUDGET - (now - START)))
  cap=$max
  [ "$left" -lt "$cap" ] && cap=$left
  if [ "$cap" -lt 5 ]; then
    echo "$name SKIPPED (budget spent)" | tee -a "$SUMMARY"
    return 99
  fi
  t0=$(date +%s)
  if declare -F "$1" > /dev/null; then
    timeout -k 10 "$cap" bash -c '"$@"' _ "$@" > "$LOGS/$name.log" 2>&1
  else
    timeout -k 10 "$cap" "$@" > "$LOGS/$name.log" 2>&1
  fi
  rc=$?
  status=ok
  [ $rc -eq 124 ] && status="TIMEOUT after ${cap}s"
  [ $rc -ne 0 ] && [ $rc -ne 124 ] && status="FAILED rc=$rc"
  echo "$name $status ($(( $(date +%s) - t0 ))s)" | tee -a "$SUMMARY"
  return $rc
}

# Carried dependencies: the packed archive (or an unpacked folder), and check.sh's build/gpu-deps.
if [ -f "$PACK" ] && [ ! -d "$DEPS" ]; then
  tar -C "$ROOT/build" -xJf "$PACK"
fi
PREFIX=""
if [ "${ENGINE_USE_DEPS:-1}" = 1 ]; then
  for d in "$DEPS" "$ROOT/build/gpu-deps"; do
    [ -d "$d" ] && PREFIX="${PREFIX:+$PREFIX;}$d"
  done
fi
CONFIG_ARGS=()
if [ -n "$PREFIX" ]; then
  CONFIG_ARGS+=("-DCMAKE_PREFIX_PATH=$PREFIX")
fi
if [ "${ENGINE_USE_DEPS:-1}" = 1 ] && [ -d "$DEPS" ]; then
  export LD_LIBRARY_PATH="$DEPS/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  CONFIG_ARGS+=("-DCMAKE_CXX_FLAGS=-isystem $DEPS/include"
    "-DCMAKE_EXE_LINKER_FLAGS=-Wl,-rpath-link,$DEPS/lib -Wl,-rpath,$DEPS/lib"
    "-DBLAS_openblas_LIBRARY=$DEPS/lib/libopenblas.so"
    "-DPCRE2_INCLUDE_DIR=$DEPS/include" "-DPCRE2_LIBRARY=$DEPS/lib/libpcre2-8.so"
    "-DGTest_DIR=$DEPS/lib/x86_64-linux-gnu/cmake/GTest" "-Dnlohmann_json_DIR=$DEPS/share/cmake/nlohmann_json"
    "-DCLI11_DIR=$DEPS/share/cmake/CLI11")
fi

env_report() {
  nvidia-smi
  nvcc --version
  cmake --version | head -1
  command -v ninja && ninja --version
  g++ --version | head -1
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, torch.cuda.get_device_name(0))'
  nproc
  free -g
  for f in /usr/include/gtest/gtest.h /usr/include/nlohmann/json.hpp /usr/include/CLI/CLI.hpp /usr/include/pcre2.h \
    /usr/include/x86_64-linux-gnu/openblas-pthread/cblas.h /usr/local/cuda/include/cublas_v2.h; do
    [ -e "$f" ] && echo "have $f" || echo "missing $f"
  done
  ls /usr/local/cuda/lib64 | grep -E "cublas" || true
  echo "carried deps: ${PREFIX:-none}"
  git -C "$ROOT" log --oneline -3 || true
  return 0
}
# The configure command, written out with its arguments quoted (arrays do not cross into run_step's child).
{
  printf 'exec cmake --preset cuda -B %q -DTESSERA_WERROR=ON' "$BUILD_DIR"
  for a in "${CONFIG_ARGS[@]}"; do printf ' %q' "$a"; done
  printf '\n'
} > "$WORK/configure.sh"

build() {
  cmake --build "$BUILD_DIR" -j"$JOBS" --target tessera_runtime_cuda engine_gpu_test ttft_bench tessera
}
run_tests() {
  local bin=$BUILD_DIR/tests/gpu/engine_gpu_test
  "$bin" --gtest_output=xml:"$LOGS/engine_test.xml"
  local rc=$?
  # The same tests through ctest (label gpu), listed only: shows that discovery works.
  ctest --test-dir "$BUILD_DIR" -N -L gpu -R 'Fixtures|HeadDims|GpuEngine' | tail -3
  return $rc
}
cli_check() {
  local model=${TESSERA_MODEL_DIR:-}/smollm2-135m-instruct-q4_1.gguf
  if [ -z "${TESSERA_MODEL_DIR:-}" ] || [ ! -f "$model" ]; then
    echo "no $model: skipped"
    return 0
  fi
  "$BUILD_DIR/tessera" bench -m "$model" --device cuda -d 1024,4096 --attn "trianglemix;ashape:sink=64,local=1024" \
    --decode 8 && "$BUILD_DIR/tessera" run -m "$model" --device cuda -p "The capital of France is" -n 16
}
export ROOT DEPS OUT LOGS JOBS BUILD_DIR WORK
export -f env_report build run_tests cli_check

run_step env 60 env_report
built=no
if run_step configure 120 bash "$WORK/configure.sh" && run_step build 330 build; then
  built=yes
fi
if [ "$built" = yes ]; then
  run_step test 120 run_tests
  if [ "${SKIP_TTFT:-0}" != 1 ]; then
    # shellcheck disable=SC2086
    # 128K first (the rows that matter most if the budget runs out); best of 2 (the first prefill of a new length
    # also builds cuDNN's plan for it).
    run_step ttft 230 "$BUILD_DIR/bench/gpu/ttft_bench" --seq 131072,32768,8192 --reps 2 --csv "$LOGS/ttft.csv" \
      --max-seconds 170 ${TTFT_ARGS:-}
    # Local-attention weights: what VS and TriangleMix + VS cost at a realistic index density (about 30 s).
    # shellcheck disable=SC2086
    run_step ttft_local 100 "$BUILD_DIR/bench/gpu/ttft_bench" --weights local --seq 131072,32768 --reps 1 \
      --policies "dense;vs:v=1000,s=6096;trianglemix:start=16,inner=vs,v=1000,s=6096,sink=64,local=512,last=64" \
      --csv "$LOGS/ttft_local.csv" --max-seconds 75 ${TTFT_LOCAL_ARGS:-}
  fi
fi
if [ "${SKIP_HF:-0}" != 1 ]; then
  # shellcheck disable=SC2086
  run_step hf 150 env PYTHONUNBUFFERED=1 python3 "$ROOT/bench/gpu/hf_ttft_reference.py" --csv "$LOGS/hf_ttft.csv" \
    ${HF_ARGS:-}
fi
if [ "$built" = yes ]; then
  run_step cli 60 cli_check
fi

{
  echo
  echo "==================== scripts/gpu/engine_check.sh summary ($(( $(date +%s) - START ))s) ===================="
  cat "$SUMMARY"
  for step in configure build; do
    if grep -q "^$step FAILED\|^$step TIMEOUT" "$SUMMARY"; then
      echo "--- $step (errors, then the last 30 lines):"
      grep -E "error|Error" "$LOGS/$step.log" | head -20
      tail -n 30 "$LOGS/$step.log"
    fi
  done
  if [ -s "$LOGS/test.log" ]; then
    echo "--- test:"
    grep -E "^\[       OK|^\[  PASSED|^\[  FAILED|^\[  SKIPPED|Failure|Expected|Which is|actual|error|^\[engine\]" \
      "$LOGS/test.log" | head -150
  fi
  [ -s "$LOGS/ttft.log" ] && { echo "--- ttft_bench:"; grep -vE "^$" "$LOGS/ttft.log" | head -60; }
  [ -s "$LOGS/ttft_local.log" ] && { echo "--- ttft_bench --weights local:"; grep -vE "^$" "$LOGS/ttft_local.log" | head -30; }
  [ -s "$LOGS/hf.log" ] && { echo "--- transformers reference:"; tail -n 12 "$LOGS/hf.log"; }
  [ -s "$LOGS/cli.log" ] && { echo "--- cli:"; tail -n 20 "$LOGS/cli.log"; }
} | tee "$LOGS/summary_full.txt"
cp "$LOGS/summary_full.txt" "$OUT/summary.txt"
[ -f "$LOGS/ttft.csv" ] && cp "$LOGS/ttft.csv" "$OUT/ttft.csv"
[ -f "$LOGS/ttft_local.csv" ] && cp "$LOGS/ttft_local.csv" "$OUT/ttft_local.csv"
[ -f "$LOGS/hf_ttft.csv" ] && cp "$LOGS/hf_ttft.csv" "$OUT/hf_ttft.csv"
tar -C "$WORK" -czf "$OUT/engine_logs.tar.gz" logs
exit 0
