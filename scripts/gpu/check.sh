#!/usr/bin/env bash
# scripts/gpu/check.sh — build, test, sanitize and benchmark tessera's CUDA backend on a GPU machine, in one call.
#
#   bash scripts/gpu/check.sh              on the GPU machine; logs and CSVs under $OUT (default build/gpu-check)
#   bash scripts/gpu/check.sh --pack-deps  on a build machine that has them: copies GTest (headers, static libs,
#                                          CMake config, and the googletest sources) and nlohmann_json into
#                                          build/gpu-deps, to carry to a GPU machine without those packages
#
# Steps, each logged to $OUT/<step>.log; a failing step does not stop the later ones, and every step's time is
# capped so that the whole run stays within CHECK_BUDGET_S seconds (default 540, for a 600 s device call):
#   env        nvidia-smi, nvcc, compilers, cmake, torch; which of GTest / nlohmann_json the machine has; the
#              cuDNN libraries (pip nvidia-cudnn-*) CMake will look for
#   configure  cmake --preset cuda -B build/cuda -DTESSERA_WERROR=ON -DTESSERA_CUDA_PTXAS_VERBOSE=ON
#              (+ -DCMAKE_PREFIX_PATH=build/gpu-deps when carried)
#   build      cmake --build build/cuda -j$JOBS --target tessera_cuda attention_gpu_test attention_gpu_bench
#   fallback   only if configure or build failed (the full project may need packages the GPU image lacks,
#              e.g. OpenBLAS, CLI11, fmt): a generated standalone project of core + attention + attention/cuda +
#              tests/gpu + bench/gpu in build/gpu-standalone, GTest built from build/gpu-deps/src if needed
#   resources  ptxas registers / spills (from the build log) and cuobjdump -res-usage of the kernels
#   wgmma_probe the wgmma kernel's self-check alone (CudaAttention.WgmmaSelfCheck); if it crashed the process,
#              the later steps run with TESSERA_PREFILL_KERNEL=mma (wgmma switched off)
#   test       attention_gpu_test (every GPU test; gtest XML in $OUT/test.xml): executor (sliding-window cases
#              included), index (warp- and thread-per-tile builds), estimators, end to end, cuDNN dense
#              (CudnnDenseTest: skipped with the reason when cuDNN is absent), the layer's dense paths
#              (LayerDensePaths: dense backend, dense fallback rule)
#   cudnn_diag which libcudnn the test loads, its sub-libraries and their unresolved dependencies, and one
#              CudnnDenseTest case with CUDNN_LOGLEVEL_DBG=2 (cuDNN's log in $OUT/cudnn_dbg.log)
#   memcheck   compute-sanitizer memcheck on a subset of small cases (window cases included)
#   racecheck_topk compute-sanitizer racecheck (hazard report) on the VS/BS estimators' block top-k only: fails if
#              any hazard is reported (the 64 warnings of the second H200 run were a real race, fixed)
#   bench      attention_gpu_bench (Llama-3-8B shapes at 8K, 32K, 128K; CSV in $OUT/bench.csv): each row runs the
#              engine's path (dense rows on cuDNN where it is faster, sparse rows with the dense fallback), the
#              kAuto kernel and the mma.sync kernel timed and compared; "dense backends" lines: ours vs cuDNN
#   bench_short the same at 1K, 2K, 4K (dense, vs): where cuDNN and the dense fallback start to pay
#   bench_model the same with --inputs model (bench/gpu/model_inputs.h: scores that fall with distance plus a sink,
#              as in real models; the CPU twin picks the nearest diagonals: VS density 0.36 at 32K, 0.098 at 128K)
#              at 32K and 128K, dense/vs/bs: the VS and BS costs at a realistic index density
#   bench_local the same with --inputs local (the older local/sink inputs) at 128K, dense/vs/bs
#   sdpa       bench/gpu/sdpa_reference.py (torch SDPA cuDNN / flash / efficient; CSV in $OUT/sdpa.csv)
#   racecheck  compute-sanitizer racecheck on tiny executor / estimator cases, the VS and BS index builds (per-warp
#              bitmaps) and a mixed VS layer (last: it gets what is left of the budget), then
#              on one tiny case through the wgmma kernel (sanitizer_racecheck_wgmma)
#   summary    one line per step (status, seconds), the tail of each failure, the two result tables
# Run order after the build: test, bench, bench_short, bench_model, racecheck_topk, memcheck, bench_local, sdpa, racecheck,
# racecheck_wgmma (the later ones get what is left of the budget; a second call on the same machine reuses the
# build: e.g. SKIP_TEST=1 SKIP_BENCH=1 for the sanitizers alone).
# Environment: OUT, JOBS (default 16), CHECK_BUDGET_S, BENCH_ARGS (e.g. "--seq 8192,32768 --reps 3"), BENCH_MODEL_ARGS, BENCH_LOCAL_ARGS,
# BENCH_SHORT_ARGS, SDPA_ARGS, SKIP_TEST=1, SKIP_SANITIZER=1, SKIP_BENCH=1, SKIP_SDPA=1, CHECK_STANDALONE=1 (skip
# the preset build).
set -u
set -o pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
DEPS=$ROOT/build/gpu-deps

if [ "${1:-}" = "--pack-deps" ]; then
  set -ex
  rm -rf "$DEPS"
  mkdir -p "$DEPS/include" "$DEPS/lib/x86_64-linux-gnu/cmake" "$DEPS/share/cmake" "$DEPS/src"
  cp -r /usr/include/gtest /usr/include/gmock /usr/include/nlohmann "$DEPS/include/"
  cp /usr/lib/x86_64-linux-gnu/libgtest*.a /usr/lib/x86_64-linux-gnu/libgmock*.a "$DEPS/lib/x86_64-linux-gnu/"
  cp -r /usr/lib/x86_64-linux-gnu/cmake/GTest "$DEPS/lib/x86_64-linux-gnu/cmake/"
  cp -r /usr/share/cmake/nlohmann_json "$DEPS/share/cmake/"
  cp -r /usr/src/googletest "$DEPS/src/googletest"
  du -sh "$DEPS"
  echo "carry build/gpu-deps with the call that runs scripts/gpu/check.sh"
  exit 0
fi

OUT=${OUT:-$ROOT/build/gpu-check}
export PATH=$PATH:/usr/local/cuda/bin  # compute-sanitizer, cuobjdump when the image does not put them on PATH
mkdir -p "$OUT"
exec > >(tee "$OUT/check.log") 2>&1
set -x

JOBS=${JOBS:-16}
BUDGET=${CHECK_BUDGET_S:-540}
START=$(date +%s)
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
# The device tool copies the tree with the sender's modification times: on a machine kept warm between calls,
# an object built by the previous call can look newer than a changed source, and ninja would keep it (two
# stale runs on 2026-11-22). Every source is touched so that the build reflects the tree it was given.
find "$ROOT/src" "$ROOT/tests" "$ROOT/bench" -type f -exec touch {} +

# run_step NAME MAX_SECONDS CMD...: runs CMD with its output in $OUT/NAME.log, at most MAX_SECONDS and at most
# what is left of the budget (keeping RESERVE seconds for the steps after it); records status and time.
run_step() {
  local name=$1 max=$2
  shift 2
  local now left cap rc t0
  now=$(date +%s)
  left=$((BUDGET - (now - START)))
  cap=$max
  [ "$left" -lt "$cap" ] && cap=$left
  if [ "$cap" -lt 5 ]; then
    echo "$name SKIPPED (budget spent)" >> "$SUMMARY"
    return 99
  fi
  t0=$(date +%s)
  # Shell functions run in a child bash (exported below), so that timeout can stop them.
  if declare -F "$1" > /dev/null; then
    timeout -k 10 "$cap" bash -c '"$@"' _ "$@" > "$OUT/$name.log" 2>&1
  else
    timeout -k 10 "$cap" "$@" > "$OUT/$name.log" 2>&1
  fi
  rc=$?
  local status=ok
  [ $rc -eq 124 ] && status="TIMEOUT after ${cap}s"
  [ $rc -ne 0 ] && [ $rc -ne 124 ] && status="FAILED rc=$rc"
  echo "$name $status ($(( $(date +%s) - t0 ))s)" >> "$SUMMARY"
  return $rc
}

env_report() {
  nvidia-smi
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,temperature.gpu --format=csv
  nvcc --version
  command -v g++ && g++ --version | head -1
  cmake --version | head -1
  command -v ninja && ninja --version
  command -v compute-sanitizer cuobjdump
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(), torch.cuda.get_device_name(0))'
  python3 -c 'import site; print("\n".join(site.getsitepackages()))' | while read -r d; do
    ls "$d"/nvidia/cudnn/lib/libcudnn.so* "$d"/nvidia/cudnn/include/cudnn_graph.h 2>/dev/null
  done
  ls /usr/local/cuda/include/cudnn_graph.h 2>/dev/null || echo "no cudnn_graph.h in /usr/local/cuda/include"
  nproc
  free -g
  for f in /usr/include/gtest/gtest.h /usr/include/nlohmann/json.hpp /usr/lib/x86_64-linux-gnu/cmake/GTest/GTestConfig.cmake; do
    [ -e "$f" ] && echo "have $f" || echo "missing $f"
  done
  [ -d "$DEPS" ] && echo "carried deps: $DEPS" && ls "$DEPS"
  git -C "$ROOT" log --oneline -3 || true
  return 0
}
export ROOT DEPS OUT JOBS
export -f env_report
run_step env 60 env_report

PREFIX_ARG=""
[ -d "$DEPS" ] && PREFIX_ARG=-DCMAKE_PREFIX_PATH=$DEPS
TARGETS="tessera_cuda attention_gpu_test attention_gpu_bench"
BUILD_DIR=$ROOT/build/cuda
export ROOT DEPS OUT JOBS PREFIX_ARG TARGETS BUILD_DIR

configure_preset() {
  # shellcheck disable=SC2086
  cmake --preset cuda -B "$BUILD_DIR" -DTESSERA_WERROR=ON -DTESSERA_CUDA_PTXAS_VERBOSE=ON $PREFIX_ARG
}
build_targets() {
  # shellcheck disable=SC2086
  cmake --build "$1" -j"$JOBS" --target $TARGETS
}

# A standalone project of the layers the GPU backend needs, for machines where the full configure fails.
write_standalone() {
  local dir=$ROOT/build/gpu-standalone/src
  mkdir -p "$dir"
  cat > "$dir/CMakeLists.txt" <<EOF
cmake_minimum_required(VERSION 3.25)
project(tessera_gpu_standalone LANGUAGES CXX CUDA)
set(CMAKE_CXX_STANDARD 20)
set(CMAKE_CXX_STANDARD_REQUIRED ON)
set(CMAKE_CXX_EXTENSIONS OFF)
set(ROOT "$ROOT")
set(DEPS "$DEPS")
set(TESSERA_HAS_CUDA ON)
option(TESSERA_WERROR "" ON)
option(TESSERA_BUILD_BENCH "" ON)
find_package(Threads REQUIRED)
find_package(nlohmann_json 3.10 QUIET)
if(NOT nlohmann_json_FOUND)
  add_library(tessera_nlohmann_json INTERFACE)
  target_include_directories(tessera_nlohmann_json INTERFACE \${DEPS}/include)
  add_library(nlohmann_json::nlohmann_json ALIAS tessera_nlohmann_json)
endif()
add_library(tessera_warnings INTERFACE)
target_compile_options(tessera_warnings INTERFACE
  \$<\$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wno-unused-parameter -Werror -march=x86-64-v3>)
file(GLOB CORE_SOURCES \${ROOT}/src/core/*.cpp)
add_library(tessera_core \${CORE_SOURCES})
target_include_directories(tessera_core PUBLIC \${ROOT}/src)
target_link_libraries(tessera_core PUBLIC Threads::Threads PRIVATE tessera_warnings)
file(GLOB ATTENTION_SOURCES \${ROOT}/src/attention/pattern/*.cpp \${ROOT}/src/attention/index/*.cpp \${ROOT}/src/attention/cpu/*.cpp)
add_library(tessera_attention \${ATTENTION_SOURCES})
target_link_libraries(tessera_attention PUBLIC tessera_core nlohmann_json::nlohmann_json PRIVATE tessera_warnings)
file(GLOB AVX512_SOURCES \${ROOT}/src/attention/cpu/*_avx512.cpp)
if(AVX512_SOURCES)
  set_source_files_properties(\${AVX512_SOURCES} PROPERTIES COMPILE_OPTIONS "-mavx512f;-mavx512bw;-mavx512vl;-mavx512dq;-mfma")
endif()
add_subdirectory(\${ROOT}/src/attention/cuda attention_cuda)
enable_testing()
find_package(GTest QUIET)
if(NOT GTest_FOUND)
  set(INSTALL_GTEST OFF CACHE BOOL "" FORCE)
  add_subdirectory(\${DEPS}/src/googletest googletest EXCLUDE_FROM_ALL)
  add_library(GTest::gtest_main ALIAS gtest_main)
endif()
include(GoogleTest)
add_subdirectory(\${ROOT}/tests/gpu tests_gpu)
EOF
  echo "$dir"
}
configure_standalone() {
  local src
  src=$(write_standalone)
  # shellcheck disable=SC2086
  cmake -S "$src" -B "$ROOT/build/gpu-standalone/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_ARCHITECTURES=90a -DTESSERA_CUDA_PTXAS_VERBOSE=ON $PREFIX_ARG
}

export -f configure_preset build_targets write_standalone configure_standalone

built=no
if [ "${CHECK_STANDALONE:-0}" != 1 ] && run_step configure 120 configure_preset &&
  run_step build 330 build_targets "$BUILD_DIR"; then
  built=yes
else
  BUILD_DIR=$ROOT/build/gpu-standalone/build
  if run_step fallback_configure 90 configure_standalone && run_step fallback_build 330 build_targets "$BUILD_DIR"; then
    built=yes
  fi
fi

TEST_BIN=$BUILD_DIR/tests/gpu/attention_gpu_test
[ -x "$TEST_BIN" ] || TEST_BIN=$BUILD_DIR/tests_gpu/attention_gpu_test
BENCH_BIN=$BUILD_DIR/bench/gpu/attention_gpu_bench

resources() {
  # ptxas: registers, shared memory, spills per kernel (the build log has them with TESSERA_CUDA_PTXAS_VERBOSE).
  local blog=$OUT/build.log
  [ -s "$OUT/fallback_build.log" ] && blog=$OUT/fallback_build.log
  grep -E "Compiling entry|Used [0-9]+ registers|spill" "$blog" | sed 's/ptxas info    : //' | head -200
  local lib
  lib=$(find "$BUILD_DIR" -name libtessera_cuda.a | head -1)
  [ -n "$lib" ] && cuobjdump -res-usage "$lib" | grep -E "Function|REG" | head -200
  # The wgmma kernel must show HGMMA (warpgroup MMA) in its SASS, not only HMMA.
  [ -n "$lib" ] && echo "HGMMA instructions in $lib: $(cuobjdump -sass "$lib" | grep -c HGMMA)"
  # ptxas's C75xx advisories ("wgmma.mma_async instructions are serialized due to ...") cost 30-40% of a kernel's
  # speed (the first items-streamed pair kernel: C7511, 33.5 M cycles against 24.1 M) and are not warnings: fail.
  if grep -qE "\(C75[0-9][0-9]\)" "$blog"; then
    echo "resources: wgmma serialised by ptxas:"
    grep -E "\(C75[0-9][0-9]\)" "$blog" | sed 's/ptxas info    : //' | head -10
    return 5
  fi
  return 0
}

racecheck_topk() {
  local log=$OUT/racecheck_topk.raw
  compute-sanitizer --tool racecheck --racecheck-report hazard "$TEST_BIN" \
    --gtest_filter='Cases/DeviceEstimateTest.*/s100_d64_bf16:Cases/DeviceEstimateTest.*/s1000_d64_f16:Cases/DeviceEstimateTest.*/s40_short' \
    > "$log" 2>&1
  local rc=$?
  cat "$log"
  grep -E "RACECHECK SUMMARY" "$log"
  if grep -qE "RACECHECK SUMMARY: [1-9][0-9]* hazard" "$log"; then
    echo "racecheck_topk: hazards reported (block_topk.cuh / estimate_cuda.cu)"
    grep -E "block_topk|estimate_cuda" "$log" | sort | uniq -c | sort -rn | head -10
    return 4
  fi
  return $rc
}

# cuDNN: which libcudnn the test binary loads, whether its sub-libraries (engines, heuristics) and their
# dependencies resolve (a sub-library that fails to load leaves the heuristics with no engine), and one small
# CudnnDenseTest case with cuDNN's own log at warning level (why each engine refuses the graph).
cudnn_diag() {
  local lib dir
  ldd "$TEST_BIN" | grep -iE "cudnn|not found"
  lib=$(ldd "$TEST_BIN" | awk '/libcudnn\.so/ {print $3; exit}')
  if [ -n "$lib" ]; then
    dir=$(dirname "$(readlink -f "$lib")")
    echo "libcudnn: $lib -> $dir"
    ls "$dir"/libcudnn*.so* 2>/dev/null
    for f in "$dir"/libcudnn_engines_*.so.9 "$dir"/libcudnn_heuristic.so.9 "$dir"/libcudnn_graph.so.9; do
      [ -e "$f" ] && { echo "ldd $f:"; ldd "$f" | grep -E "not found|nvrtc|cublas|cudart"; }
    done
  fi
  CUDNN_LOGLEVEL_DBG=2 CUDNN_LOGDEST_DBG="$OUT/cudnn_dbg.log" "$TEST_BIN" \
    --gtest_filter='Cases/CudnnDenseTest.MatchesReference/s100_d64_f16'
  local rc=$?
  echo "cuDNN log ($OUT/cudnn_dbg.log, $(wc -l < "$OUT/cudnn_dbg.log" 2>/dev/null || echo 0) lines), first warnings/errors:"
  grep -iE "warn|error|not_supported|reason|fail" "$OUT/cudnn_dbg.log" 2>/dev/null | cut -c1-400 | head -40
  return $rc
}

export TEST_BIN
export -f resources racecheck_topk cudnn_diag
if [ "$built" = yes ]; then
  run_step resources 30 resources
  # The wgmma kernel's self-check alone first. A numeric failure is handled in-process (kAuto falls back to
  # mma.sync; tests that ask for wgmma fail with the report). A crash (a sticky CUDA error poisons the process)
  # would take every later test with it, so then the wgmma kernel is switched off for the steps after this.
  run_step wgmma_probe 60 "$TEST_BIN" --gtest_filter=CudaAttention.WgmmaSelfCheck
  probe_rc=$?
  if [ $probe_rc -gt 1 ] || grep -q "wgmma self-check error: CUDA error" "$OUT/wgmma_probe.log"; then
    export TESSERA_PREFILL_KERNEL=mma
    echo "wgmma_probe: the wgmma kernel crashed (rc $probe_rc): TESSERA_PREFILL_KERNEL=mma for the later steps" >> "$SUMMARY"
  fi
  # Order: what the run is for first (tests, then the benchmark and the short-prompt benchmark), then the
  # sanitizers; every step is capped by what is left of the budget.
  [ "${SKIP_TEST:-0}" != 1 ] && run_step test 200 "$TEST_BIN" --gtest_output=xml:"$OUT/test.xml"
  [ "${SKIP_TEST:-0}" != 1 ] && run_step cudnn_diag 40 cudnn_diag
  if [ "${SKIP_BENCH:-0}" != 1 ]; then
    # shellcheck disable=SC2086
    run_step bench 150 "$BENCH_BIN" ${BENCH_ARGS:-} --csv "$OUT/bench.csv"
    # Short prompts: cuDNN against ours, and the dense fallback, where prompts are cheap.
    # shellcheck disable=SC2086
    run_step bench_short 40 "$BENCH_BIN" --seq 1024,2048,4096 --patterns dense,vs,bs --variants off --kernel auto \
      ${BENCH_SHORT_ARGS:-} --csv "$OUT/bench_short.csv"
    # Model-like inputs (VS picks the diagonals nearest the diagonal, as on real models): VS and BS at a realistic
    # density. 3 reps: about 30 s.
    # shellcheck disable=SC2086
    run_step bench_model 75 "$BENCH_BIN" --inputs model --seq 32768,131072 --patterns dense,vs,bs --variants off \
      --reps 3 ${BENCH_MODEL_ARGS:-} --csv "$OUT/bench_model.csv"
  fi
  if [ "${SKIP_SANITIZER:-0}" != 1 ]; then
    # The block top-k of the VS/BS estimators alone, every hazard reported: any hazard fails the step.
    run_step sanitizer_racecheck_topk 60 racecheck_topk
    SAN_FILTER='Cases/ExecutorTest.MatchesReference/dense_win37_s100_d64_f16_t64:Cases/ExecutorTest.MatchesReference/mixed_win70_s130_d128_bf16:Cases/ExecutorTest.MatchesReference/mixed_s100_d64_f16_t64:Cases/ExecutorTest.MatchesReference/mixed_s1000_d128_bf16:Cases/ExecutorTest.MatchesReference/mixed_s300_d256_f16_t64:Cases/ExecutorTest.MatchesReference/mixed_chunk_q777_s333_tail50:Cases/ExecutorTest.MatchesReference/empty_vs_s200:Cases/DeviceIndexTest.IdenticalToCpuLowering/mixed_s1000:Cases/DeviceEstimateTest.*/s100_d64_bf16:Cases/EndToEndTest.MatchesReferenceOnItsOwnIndex/mixed_s1000_bf16:CudaAttention.*'
    run_step sanitizer_memcheck 100 compute-sanitizer --tool memcheck --error-exitcode 3 "$TEST_BIN" --gtest_filter="$SAN_FILTER"
  fi
  if [ "${SKIP_BENCH:-0}" != 1 ]; then
    # Local/sink-structured inputs (VS slashes near the diagonal, as real models give).
    # shellcheck disable=SC2086
    run_step bench_local 45 "$BENCH_BIN" --inputs local --seq 131072 --patterns dense,vs,bs --variants off --reps 3 \
      ${BENCH_LOCAL_ARGS:-} --csv "$OUT/bench_local.csv"
  fi
fi
if [ "${SKIP_SDPA:-0}" != 1 ]; then
  # shellcheck disable=SC2086
  run_step sdpa 90 env PYTHONUNBUFFERED=1 python3 "$ROOT/bench/gpu/sdpa_reference.py" ${SDPA_ARGS:-} --csv "$OUT/sdpa.csv"
fi

# Shared-memory race check last: slow, so it gets what is left of the budget.
if [ "$built" = yes ] && [ "${SKIP_SANITIZER:-0}" != 1 ]; then
  run_step sanitizer_racecheck 90 compute-sanitizer --tool racecheck --error-exitcode 3 "$TEST_BIN" \
    --gtest_filter='Cases/ExecutorTest.MatchesReference/mixed_s100_d64_f16_t64:Cases/ExecutorTest.MatchesReference/dense_s100_d64_f16_t64:Cases/DeviceEstimateTest.*/s40_short:Cases/DeviceIndexTest.IdenticalToCpuLowering/bs_s1000:Cases/DeviceIndexTest.IdenticalToCpuLowering/vs_s1000:DeviceEstimateMixed.*'
  # The wgmma kernel (its self-check, then a one-row case through both kernels), separately: racecheck may
  # not model the async proxy (wgmma reading what cp.async wrote), so a report here needs reading, and a slow
  # run must not cost the check above.
  run_step sanitizer_racecheck_wgmma 60 compute-sanitizer --tool racecheck --error-exitcode 3 "$TEST_BIN" \
    --gtest_filter='Cases/ExecutorTest.MatchesReference/mixed_s1_d128_bf16'
fi

set +x
{
  echo
  echo "==================== scripts/gpu/check.sh summary ($(( $(date +%s) - START ))s, build dir $BUILD_DIR) ===================="
  cat "$SUMMARY"
  if [ -s "$OUT/resources.log" ]; then
    echo "--- kernels with spills or local memory (ptxas):"
    grep -B1 -E "[1-9][0-9]* bytes spill|[1-9][0-9]* bytes stack" "$OUT/resources.log" | head -20 || true
    grep -E "HGMMA instructions" "$OUT/resources.log" || true
    echo "--- registers of the sparse prefill kernels (mma.sync and wgmma):"
    grep -A2 -E "sparse_prefill_kernel|sparse_prefill_wgmma_kernel" "$OUT/resources.log" | grep -E "Compiling|Function|Used|REG" | head -40 || true
  fi
  for step in configure build fallback_configure fallback_build; do
    if grep -q "^$step FAILED\|^$step TIMEOUT" "$SUMMARY"; then
      echo "--- $step (last 25 lines):"
      grep -E "error|Error|FAILED" "$OUT/$step.log" | head -15
      tail -n 25 "$OUT/$step.log"
    fi
  done
  if [ -s "$OUT/test.log" ]; then
    [ -s "$OUT/wgmma_probe.log" ] && { echo "--- wgmma_probe:"; grep -E "self-check|^wgmma|PASSED|FAILED|error" "$OUT/wgmma_probe.log" | head -12; }
    echo "--- test: failures and numbers"
    grep -E "^\[  SKIPPED \] [0-9]+ test" "$OUT/test.log"
    grep -E "^\[  FAILED|^\[  PASSED|Failure|Expected|Which is|actual|error" "$OUT/test.log" | head -60
    grep -E "^\[ wgmma self-check \]|^wgmma " "$OUT/test.log"
    echo "cuDNN / dense paths:"
    grep -E "tessera: cuDNN|tessera: TESSERA_CUDNN" "$OUT/configure.log" "$OUT/fallback_configure.log" 2>/dev/null | head -2
    grep -E "^\[ (cudnn|layer|fallback) " "$OUT/test.log" | head -20
    grep -E "CudnnDense.*(SKIPPED|FAILED)|cuDNN (unavailable|has no|built no)" "$OUT/test.log" | cut -c1-3000 | head -10
    echo "sliding-window cases (worst):"
    grep -E "^\[ executor \] [a-z]+_win" "$OUT/test.log" | awk '{print $4, $5, $7}' | sort -k3 -g -r | head -4
    echo "worst relative errors (case, kernel, error):"
    grep -E "^\[ (executor|end2end) \]" "$OUT/test.log" | awk '{print $4, $5, $7}' | sort -k3 -g -r | head -8
  fi
  [ -s "$OUT/cudnn_diag.log" ] && { echo "--- cudnn_diag (library, sub-libraries, cuDNN's log):"; grep -vE "^\[ (RUN|      OK) " "$OUT/cudnn_diag.log" | cut -c1-3000 | head -70; }
  for s in sanitizer_memcheck sanitizer_racecheck_topk sanitizer_racecheck sanitizer_racecheck_wgmma; do
    [ -s "$OUT/$s.log" ] && { echo "--- $s:"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Invalid|Race|hazard|PASSED|FAILED" "$OUT/$s.log" | head -15; }
  done
  [ -s "$OUT/bench.log" ] && { echo "--- bench:"; grep -E "^\||device|shape|cuDNN|rror|self-check|^wgmma|variant seq|index seq|dense backends|fallback seq" "$OUT/bench.log"; }
  [ -s "$OUT/bench_model.log" ] && { echo "--- bench, model inputs:"; grep -E "^\||shape|rror|index seq|dense backends|fallback seq" "$OUT/bench_model.log"; }
  [ -s "$OUT/bench_local.log" ] && { echo "--- bench, local inputs:"; grep -E "^\||shape|rror|self-check|index seq|dense backends|fallback seq" "$OUT/bench_local.log"; }
  [ -s "$OUT/bench_short.log" ] && { echo "--- bench, short prompts:"; grep -E "^\||rror|dense backends|fallback seq" "$OUT/bench_short.log"; }
  [ -s "$OUT/sdpa.log" ] && { echo "--- sdpa:"; grep -E "^\||device|unavailable|rror" "$OUT/sdpa.log"; }
} | tee "$OUT/summary_full.txt"
exit 0
