#!/usr/bin/env bash
# scripts/gpu/check.sh — configure, build, test, sanitize and benchmark tessera's CUDA backend and GPU engine on a
# GPU machine, in one call.
#
#   here (Debian 12), once:  bash scripts/gpu/deps.sh download    (the packages the GPU image lacks: build/gpu-debs)
#   there:                   bash scripts/gpu/check.sh            (device call with carry ["build/gpu-debs"])
#
# Steps (logs in build/gpu-check/logs/<step>.log); a failing step does not stop the later ones, and each step's
# time is capped so that the whole run stays within CHECK_BUDGET_S seconds (default 540, for a 600 s call):
#   env        nvidia-smi, nvcc, compilers, cmake, torch, which dependencies the image has, cuDNN
#   deps       scripts/gpu/deps.sh unpack, when build/gpu-debs was carried (CMake arguments, LD_LIBRARY_PATH)
#   configure  cmake --preset cuda -DTESSERA_WERROR=ON -DTESSERA_CUDA_PTXAS_VERBOSE=ON (+ the deps' arguments)
#   build      cmake --build build/cuda --target cuda_all (tessera_cuda, tessera_runtime_cuda, GPU tests, benches)
#   resources  ptxas registers / spills per kernel, cuobjdump -res-usage, HGMMA count; FAILS on ptxas's C75xx
#              advisories (wgmma serialised: 30-40% of a kernel's speed)
#   wgmma_probe the Hopper kernel's self-check alone (CudaAttention.*SelfCheck); if it crashed the process, the
#              later steps run with TESSERA_PREFILL_KERNEL=mma
#   test       ctest -L gpu: the attention backend (tests/gpu) and the GPU engine (tests/gpu/engine_tests) against
#              the CPU references; output of failures, JUnit XML in $OUT/ctest.xml
#   cudnn_diag which libcudnn the tests load, its sub-libraries' dependencies, one CudnnDenseTest case with cuDNN's log
#   bench, bench_short, bench_model, bench_local   attention_gpu_bench (Llama-3-8B shapes; CSVs): 8K-128K RoPE
#              inputs; 1K-4K (cuDNN and the dense fallback); model-like inputs at 32K/128K (VS and BS at a realistic
#              index density); local/sink inputs at 128K
#   sanitizer_racecheck_topk, sanitizer_memcheck, sanitizer_synccheck, sanitizer_racecheck, sanitizer_racecheck_wgmma
#              compute-sanitizer on small cases (any top-k hazard fails; racecheck last: it gets what is left);
#              with MEMCHECK_ALL=1, sanitizer_memcheck_all instead of sanitizer_memcheck: memcheck (with leak check)
#              over every test of both GPU test programs, MEMCHECK_SHARDS (8) shards in parallel
#   ttft, ttft_local, hf, cli   with TTFT=1: ttft_bench (GPU engine, Llama-3-8B shapes, random weights; 128K/32K/8K
#              and --weights local), the transformers + SDPA reference, `tessera bench --device cuda` on the real
#              SmolLM2 when TESSERA_MODEL_DIR holds it
#   sdpa       bench/gpu/sdpa_reference.py (torch SDPA backends)
# $OUT receives summary.txt, ctest.xml, the CSVs of bench, bench_model and ttft, and check.tgz (every log and CSV).
# Environment: OUT, JOBS (16), CTEST_JOBS (4), CHECK_BUDGET_S, BENCH_ARGS, BENCH_SHORT_ARGS, BENCH_MODEL_ARGS,
# BENCH_LOCAL_ARGS, SDPA_ARGS, TTFT_ARGS, TTFT_LOCAL_ARGS, HF_ARGS, SKIP_TEST=1, SKIP_BENCH=1, SKIP_SANITIZER=1,
# SKIP_SDPA=1, TTFT=1, MEMCHECK_ALL=1 (MEMCHECK_SHARDS, MEMCHECK_ALL_S), BUILD_ONLY=1 (configure and build alone, e.g. for the ncu scripts), TESSERA_MODEL_DIR.
set -u
set -o pipefail
cd "$(dirname "$0")/../.." || exit 1
ROOT=$PWD
WORK=$ROOT/build/gpu-check
LOGS=$WORK/logs
OUT=${OUT:-$WORK/out}
BUILD_DIR=$ROOT/build/cuda
export PATH=$PATH:/usr/local/cuda/bin  # compute-sanitizer, cuobjdump when the image does not put them on PATH
rm -rf "$LOGS"
mkdir -p "$OUT" "$LOGS"
exec > >(tee "$LOGS/check.log") 2>&1
JOBS=${JOBS:-16}
BUDGET=${CHECK_BUDGET_S:-540}
START=$(date +%s)
SUMMARY=$LOGS/summary.txt
: > "$SUMMARY"
if [ "${BUILD_ONLY:-0}" = 1 ]; then
  SKIP_TEST=1 SKIP_BENCH=1 SKIP_SANITIZER=1 SKIP_SDPA=1 TTFT=0
fi
# The device tool copies the tree with the sender's modification times: on a machine kept warm between calls,
# an object built by the previous call can look newer than a changed source, and ninja would keep it (two
# stale runs on 2026-11-22). Every source is touched so that the build reflects the tree it was given.
# NO_TOUCH=1 skips this for a second call on the same tree (e.g. MEMCHECK_ALL=1 after a first full call).
[ "${NO_TOUCH:-0}" = 1 ] || find "$ROOT/src" "$ROOT/tests" "$ROOT/bench" -type f -exec touch {} +

# run_step NAME MAX_SECONDS CMD...: runs CMD with its output in $LOGS/NAME.log, at most MAX_SECONDS and at most
# what is left of the budget; records status and time.
run_step() {
  local name=$1 max=$2
  shift 2
  local left cap rc t0 status=ok
  left=$((BUDGET - ($(date +%s) - START)))
  cap=$max
  [ "$left" -lt "$cap" ] && cap=$left
  if [ "$cap" -lt 5 ]; then
    echo "$name SKIPPED (budget spent)" | tee -a "$SUMMARY"
    return 99
  fi
  t0=$(date +%s)
  # Shell functions run in a child bash (exported below), so that timeout can stop them.
  if declare -F "$1" > /dev/null; then
    timeout -k 10 "$cap" bash -c '"$@"' _ "$@" > "$LOGS/$name.log" 2>&1
  else
    timeout -k 10 "$cap" "$@" > "$LOGS/$name.log" 2>&1
  fi
  rc=$?
  [ $rc -eq 124 ] && status="TIMEOUT after ${cap}s"
  [ $rc -ne 0 ] && [ $rc -ne 124 ] && status="FAILED rc=$rc"
  echo "$name $status ($(( $(date +%s) - t0 ))s)" | tee -a "$SUMMARY"
  return $rc
}

env_report() {
  nvidia-smi
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,temperature.gpu --format=csv
  nvcc --version
  g++ --version | head -1
  cmake --version | head -1
  command -v ninja compute-sanitizer cuobjdump ncu
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(), torch.cuda.get_device_name(0))'
  python3 -c 'import site; print("\n".join(site.getsitepackages()))' | while read -r d; do
    ls "$d"/nvidia/cudnn/lib/libcudnn.so* "$d"/nvidia/cudnn/include/cudnn_graph.h 2> /dev/null
  done
  nproc
  free -g
  for f in /usr/include/gtest/gtest.h /usr/include/nlohmann/json.hpp /usr/include/CLI/CLI.hpp /usr/include/pcre2.h \
    /usr/include/x86_64-linux-gnu/openblas-pthread/cblas.h /usr/local/cuda/include/cudnn_graph.h; do
    [ -e "$f" ] && echo "have $f" || echo "missing $f"
  done
  ls "$ROOT/build/gpu-debs" 2> /dev/null || echo "no build/gpu-debs carried"
  git -C "$ROOT" log --oneline -3 || true
  return 0
}
export ROOT LOGS OUT JOBS BUILD_DIR
export -f env_report
run_step env 60 env_report

# The carried packages: unpacked, and their CMake arguments and LD_LIBRARY_PATH taken into this shell.
TESSERA_DEPS_CMAKE_ARGS=""
if [ -d "$ROOT/build/gpu-debs" ] && run_step deps 60 bash "$ROOT/scripts/gpu/deps.sh" unpack; then
  . "$ROOT/build/gpu-sysroot/deps.env"
fi
export TESSERA_DEPS_CMAKE_ARGS

configure() {
  # shellcheck disable=SC2086
  cmake --preset cuda -B "$BUILD_DIR" -DTESSERA_WERROR=ON -DTESSERA_CUDA_PTXAS_VERBOSE=ON $TESSERA_DEPS_CMAKE_ARGS
}
resources() {
  # ptxas: registers, shared memory, spills per kernel (the build log has them with TESSERA_CUDA_PTXAS_VERBOSE).
  local blog=$LOGS/build.log lib
  grep -E "Compiling entry|Used [0-9]+ registers|spill" "$blog" | sed 's/ptxas info    : //' | head -200
  lib=$BUILD_DIR/src/attention/cuda/libtessera_cuda.a
  cuobjdump -res-usage "$lib" | grep -E "Function|REG" | head -200
  # The Hopper kernel must show HGMMA (warpgroup MMA) in its SASS, not only HMMA.
  echo "HGMMA instructions in $lib: $(cuobjdump -sass "$lib" | grep -c HGMMA)"
  # ptxas's C75xx advisories ("wgmma.mma_async instructions are serialized due to ...") cost 30-40% of a kernel's
  # speed (the first items-streamed pair kernel: C7511, 33.5 M cycles against 24.1 M) and are not warnings: fail.
  if grep -qE "\(C75[0-9][0-9]\)" "$blog"; then
    echo "resources: wgmma serialised by ptxas:"
    grep -E "\(C75[0-9][0-9]\)" "$blog" | sed 's/ptxas info    : //' | head -10
    return 5
  fi
}
racecheck_topk() {
  compute-sanitizer --tool racecheck --racecheck-report hazard "$TEST_BIN" \
    --gtest_filter='Cases/DeviceEstimateTest.*/s100_d64_bf16:Cases/DeviceEstimateTest.*/s1000_d64_f16:Cases/DeviceEstimateTest.*/s40_short'
  local rc=$?
  if grep -qE "RACECHECK SUMMARY: [1-9][0-9]* hazard" "$LOGS/sanitizer_racecheck_topk.log"; then
    echo "racecheck_topk: hazards reported (block_topk.cuh / estimate_cuda.cu)"
    return 4
  fi
  return $rc
}
# cuDNN: which libcudnn the test binary loads, whether its sub-libraries (engines, heuristics) and their
# dependencies resolve, and one small CudnnDenseTest case with cuDNN's own log (why each engine refuses the graph).
cudnn_diag() {
  local lib dir
  ldd "$TEST_BIN" | grep -iE "cudnn|not found"
  lib=$(ldd "$TEST_BIN" | awk '/libcudnn\.so/ {print $3; exit}')
  if [ -n "$lib" ]; then
    dir=$(dirname "$(readlink -f "$lib")")
    echo "libcudnn: $lib -> $dir"
    for f in "$dir"/libcudnn_engines_*.so.9 "$dir"/libcudnn_heuristic.so.9 "$dir"/libcudnn_graph.so.9; do
      [ -e "$f" ] && { echo "ldd $f:"; ldd "$f" | grep -E "not found|nvrtc|cublas|cudart"; }
    done
  fi
  CUDNN_LOGLEVEL_DBG=2 CUDNN_LOGDEST_DBG="$LOGS/cudnn_dbg.log" "$TEST_BIN" \
    --gtest_filter='Cases/CudnnDenseTest.MatchesReference/s100_d64_f16'
  local rc=$?
  grep -iE "warn|error|not_supported|reason|fail" "$LOGS/cudnn_dbg.log" 2> /dev/null | cut -c1-400 | head -40
  return $rc
}
cli_check() {
  local model=${TESSERA_MODEL_DIR:-}/smollm2-135m-instruct-q4_1.gguf
  [ -f "$model" ] || { echo "no $model: skipped"; return 0; }
  "$BUILD_DIR/src/tessera" bench -m "$model" --device cuda -d 1024,4096 --attn "trianglemix;ashape:sink=64,local=1024" \
    --decode 8 && "$BUILD_DIR/src/tessera" run -m "$model" --device cuda -p "The capital of France is" -n 16
}
# memcheck over the whole GPU test suite (both test programs, every test), in MEMCHECK_SHARDS parallel shards
# (gtest sharding; the GPU is shared, compute-sanitizer makes each shard CPU-bound). Fails on any memcheck error
# or leak, or a test failing under it; the per-shard ERROR SUMMARY lines and the failures go to the log.
memcheck_all() {
  local shards=${MEMCHECK_SHARDS:-8} rc=0 bin i
  for bin in "$TEST_BIN" "$ENGINE_TEST_BIN"; do
    for ((i = 0; i < shards; i++)); do
      GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i compute-sanitizer --tool memcheck --leak-check full \
        --error-exitcode 3 "$bin" > "$LOGS/memcheck_$(basename "$bin")_$i.log" 2>&1 &
    done
    for ((i = 0; i < shards; i++)); do wait -n || true; done  # (exit codes: judged from the logs below)
  done
  # The out-of-memory test alone (it fills the device), without API-error reports: its failed cudaMallocs are the
  # point of the test; access errors and leaks still count.
  compute-sanitizer --tool memcheck --leak-check full --report-api-errors no --error-exitcode 3 "$OOM_TEST_BIN" \
    > "$LOGS/memcheck_oom_serial_test_0.log" 2>&1
  # cuDNN keeps three small allocations made inside cudnnCreate until after the CUDA context is gone (25,344 + 4 + 4
  # bytes, also when its handle is destroyed at exit): reported as leaks, not ours. Every other report fails.
  local errors third ours
  for f in "$LOGS"/memcheck_*_*.log; do
    errors=$(grep -oE "ERROR SUMMARY: [0-9]+" "$f" | tail -1 | grep -oE "[0-9]+$")
    third=$(awk '/^========= Leaked/ {leak = 1; next} leak && /cudnnCreate/ {n++; leak = 0} /^========= $/ {leak = 0} END {print n + 0}' "$f")
    ours=$(( ${errors:-1} - third ))
    echo "$(basename "$f" .log): $(grep -E "^\[  (PASSED|FAILED) " "$f" | tr '\n' ' ') memcheck errors ${errors:-?} ($third cuDNN-internal leaks, $ours ours)"
    if [ "$ours" -ne 0 ] || grep -q "^\[  FAILED  \]" "$f" || ! grep -q "^\[  PASSED  \]" "$f"; then
      rc=1
      grep -E "^\[  FAILED  \]|Invalid|Leaked|Program hit" "$f" | head -5
    fi
  done
  echo "memcheck over the whole GPU suite: $(cat "$LOGS"/memcheck_*_*.log | grep -c "^\[       OK \]") tests passed; $( [ $rc = 0 ] && echo "no errors of ours" || echo "ERRORS (above)")"
  return $rc
}
TEST_BIN=$BUILD_DIR/tests/gpu/attention_gpu_test
ENGINE_TEST_BIN=$BUILD_DIR/tests/gpu/engine_gpu_test
OOM_TEST_BIN=$BUILD_DIR/tests/gpu/oom_serial_test
BENCH=$BUILD_DIR/bench/gpu/attention_gpu_bench
TTFT_BIN=$BUILD_DIR/bench/gpu/ttft_bench
export TEST_BIN ENGINE_TEST_BIN OOM_TEST_BIN LOGS
export -f configure resources racecheck_topk cudnn_diag cli_check memcheck_all

built=no
run_step configure 120 configure && run_step build 330 cmake --build "$BUILD_DIR" -j"$JOBS" --target cuda_all && built=yes
if [ "$built" = yes ] && [ "${BUILD_ONLY:-0}" != 1 ]; then
  run_step resources 30 resources
  # The Hopper kernel's self-check alone first. A numeric failure is handled in-process (kAuto falls back to
  # mma.sync); a crash (a sticky CUDA error poisons the process) would take every later test with it, so then
  # the Hopper kernel is switched off for the steps after this.
  run_step wgmma_probe 60 "$TEST_BIN" --gtest_filter='CudaAttention.*SelfCheck'
  probe_rc=$?
  if [ $probe_rc -gt 1 ] || grep -q "self-check error: CUDA error" "$LOGS/wgmma_probe.log"; then
    export TESSERA_PREFILL_KERNEL=mma
    echo "wgmma_probe: the Hopper kernel crashed (rc $probe_rc): TESSERA_PREFILL_KERNEL=mma for the later steps" >> "$SUMMARY"
  fi
  if [ "${SKIP_TEST:-0}" != 1 ]; then
    run_step test 240 ctest --test-dir "$BUILD_DIR" -L gpu -j "${CTEST_JOBS:-4}" --timeout 300 -V --output-on-failure \
      --output-junit "$LOGS/ctest.xml"
    run_step cudnn_diag 40 cudnn_diag
  fi
  if [ "${SKIP_BENCH:-0}" != 1 ]; then
    # shellcheck disable=SC2086
    run_step bench 150 "$BENCH" ${BENCH_ARGS:-} --csv "$LOGS/bench.csv"
    # shellcheck disable=SC2086
    run_step bench_short 40 "$BENCH" --seq 1024,2048,4096 --patterns dense,vs,bs --kernel auto ${BENCH_SHORT_ARGS:-} \
      --csv "$LOGS/bench_short.csv"
    # shellcheck disable=SC2086
    run_step bench_model 75 "$BENCH" --inputs model --seq 32768,131072 --patterns dense,vs,bs --reps 3 \
      ${BENCH_MODEL_ARGS:-} --csv "$LOGS/bench_model.csv"
  fi
  if [ "${SKIP_SANITIZER:-0}" != 1 ]; then
    run_step sanitizer_racecheck_topk 60 racecheck_topk
    SAN_FILTER='Cases/ExecutorTest.MatchesReference/dense_win37_s100_d64_f16_t64:Cases/ExecutorTest.MatchesReference/mixed_win70_s130_d128_bf16:Cases/ExecutorTest.MatchesReference/mixed_s100_d64_f16_t64:Cases/ExecutorTest.MatchesReference/mixed_s1000_d128_bf16:Cases/ExecutorTest.MatchesReference/mixed_s300_d256_f16_t64:Cases/ExecutorTest.MatchesReference/mixed_chunk_q777_s333_tail50:Cases/ExecutorTest.MatchesReference/empty_vs_s200:Cases/DeviceIndexTest.IdenticalToCpuLowering/mixed_s1000:Cases/DeviceEstimateTest.*/s100_d64_bf16:Cases/EndToEndTest.MatchesReferenceOnItsOwnIndex/mixed_s1000_bf16:CudaAttention.*'
    if [ "${MEMCHECK_ALL:-0}" = 1 ]; then
      run_step sanitizer_memcheck_all "${MEMCHECK_ALL_S:-420}" memcheck_all
    else
      run_step sanitizer_memcheck 100 compute-sanitizer --tool memcheck --error-exitcode 3 "$TEST_BIN" --gtest_filter="$SAN_FILTER"
    fi
    run_step sanitizer_synccheck 60 compute-sanitizer --tool synccheck --error-exitcode 3 "$TEST_BIN" --gtest_filter="$SAN_FILTER"
  fi
  if [ "${SKIP_BENCH:-0}" != 1 ]; then
    # shellcheck disable=SC2086
    run_step bench_local 45 "$BENCH" --inputs local --seq 131072 --patterns dense,vs,bs --reps 3 ${BENCH_LOCAL_ARGS:-} \
      --csv "$LOGS/bench_local.csv"
  fi
  if [ "${TTFT:-0}" = 1 ]; then
    # 128K first (the rows that matter most if the budget runs out); best of 2 (the first prefill of a new length
    # also builds cuDNN's plan for it). Then local-attention weights: VS at a realistic index density.
    # shellcheck disable=SC2086
    run_step ttft 230 "$TTFT_BIN" --seq 131072,32768,8192 --reps 2 --csv "$LOGS/ttft.csv" --max-seconds 170 ${TTFT_ARGS:-}
    # shellcheck disable=SC2086
    run_step ttft_local 100 "$TTFT_BIN" --weights local --seq 131072,32768 --reps 1 \
      --policies "dense;vs:v=1000,s=6096;trianglemix:start=16,inner=vs,v=1000,s=6096,sink=64,local=512,last=64" \
      --csv "$LOGS/ttft_local.csv" --max-seconds 75 ${TTFT_LOCAL_ARGS:-}
    # shellcheck disable=SC2086
    run_step hf 150 env PYTHONUNBUFFERED=1 python3 "$ROOT/bench/gpu/hf_ttft_reference.py" --csv "$LOGS/hf_ttft.csv" ${HF_ARGS:-}
    run_step cli 60 cli_check
  fi
fi
if [ "${SKIP_SDPA:-0}" != 1 ]; then
  # shellcheck disable=SC2086
  run_step sdpa 90 env PYTHONUNBUFFERED=1 python3 "$ROOT/bench/gpu/sdpa_reference.py" ${SDPA_ARGS:-} --csv "$LOGS/sdpa.csv"
fi
# Shared-memory race checks last: slow, so they get what is left of the budget. The one-row case through both
# kernels separately: racecheck may not model the async proxy (wgmma reading what TMA / cp.async wrote).
if [ "$built" = yes ] && [ "${SKIP_SANITIZER:-0}" != 1 ]; then
  run_step sanitizer_racecheck 90 compute-sanitizer --tool racecheck --error-exitcode 3 "$TEST_BIN" \
    --gtest_filter='Cases/ExecutorTest.MatchesReference/mixed_s100_d64_f16_t64:Cases/ExecutorTest.MatchesReference/dense_s100_d64_f16_t64:Cases/DeviceEstimateTest.*/s40_short:Cases/DeviceIndexTest.IdenticalToCpuLowering/bs_s1000:Cases/DeviceIndexTest.IdenticalToCpuLowering/vs_s1000:DeviceEstimateMixed.*'
  run_step sanitizer_racecheck_wgmma 60 compute-sanitizer --tool racecheck --error-exitcode 3 "$TEST_BIN" \
    --gtest_filter='Cases/ExecutorTest.MatchesReference/mixed_s1_d128_bf16'
fi

# show STEP TITLE REGEX [MAX]: the matching lines of a step's log (ctest's "NN: " prefixes removed).
show() {
  [ -s "$LOGS/$1.log" ] || return 0
  echo "--- $2:"
  sed -E 's/^[0-9]+: //' "$LOGS/$1.log" | grep -E "$3" | cut -c1-3000 | head -"${4:-40}"
}
{
  echo
  echo "==================== scripts/gpu/check.sh summary ($(( $(date +%s) - START ))s, $BUILD_DIR) ===================="
  cat "$SUMMARY"
  grep -hE "^-- tessera: (building|.* off:|cuDNN|TESSERA_CUDNN|the prebuilt GTest|building GTest)" "$LOGS/configure.log" 2> /dev/null
  for step in deps configure build; do
    if grep -qE "^$step (FAILED|TIMEOUT)" "$SUMMARY"; then
      echo "--- $step (errors, then the last 25 lines):"
      grep -E "error|Error|FAILED" "$LOGS/$step.log" | head -15
      tail -n 25 "$LOGS/$step.log"
    fi
  done
  if [ -s "$LOGS/resources.log" ]; then
    echo "--- kernels with spills or local memory (ptxas), HGMMA count, C75xx advisories:"
    grep -B1 -E "[1-9][0-9]* bytes spill|[1-9][0-9]* bytes stack" "$LOGS/resources.log" | head -20
    grep -E "HGMMA instructions|serialised|C75" "$LOGS/resources.log"
    echo "--- registers of the prefill kernels:"
    grep -A2 -E "Compiling entry.*prefill|Function.*prefill" "$LOGS/resources.log" | grep -E "Compiling|Function|Used|REG" | head -40
  fi
  show wgmma_probe "wgmma_probe" "self-check|PASSED|FAILED|SKIPPED|error" 12
  show test "test: failures and numbers" "tests passed|tests failed|\*\*\*(Failed|Exception|Timeout|Not Run)|Failure$|Expected|Which is|^\[ wgmma self-check \]" 60
  if [ -s "$LOGS/test.log" ]; then
    echo "skipped: $(grep -c '\*\*\*Skipped' "$LOGS/test.log")"
    echo "cuDNN / dense paths:"
    sed -E 's/^[0-9]+: //' "$LOGS/test.log" | grep -E "^\[ (cudnn|layer|fallback) " | sort -u | head -20
    echo "worst relative errors (case, kernel, error):"
    sed -E 's/^[0-9]+: //' "$LOGS/test.log" | grep -E "^\[ (executor|end2end) \]" | awk '{print $4, $5, $7}' | sort -k3 -g -r | head -8
    sed -E 's/^[0-9]+: //' "$LOGS/test.log" | grep -E "^\[engine\]" | head -40
  fi
  show cudnn_diag "cudnn_diag (library, sub-libraries, cuDNN's log)" "^([^[]|\[ *(FAILED|SKIPPED|PASSED))" 70
  for s in sanitizer_memcheck sanitizer_synccheck sanitizer_racecheck_topk sanitizer_racecheck sanitizer_racecheck_wgmma; do
    show $s $s "ERROR SUMMARY|RACECHECK SUMMARY|Invalid|Race|hazard|PASSED|FAILED" 15
  done
  show sanitizer_memcheck_all "memcheck over the whole GPU suite" "." 60
  show bench "bench" "^\||device|shape|cuDNN|rror|self-check|index seq|dense backends|fallback seq" 200
  show bench_model "bench, model inputs" "^\||shape|rror|index seq|dense backends|fallback seq" 100
  show bench_local "bench, local inputs" "^\||shape|rror|index seq|dense backends|fallback seq" 100
  show bench_short "bench, short prompts" "^\||rror|dense backends|fallback seq" 60
  show ttft "ttft_bench" "." 60
  show ttft_local "ttft_bench --weights local" "." 30
  [ -s "$LOGS/hf.log" ] && { echo "--- transformers reference:"; tail -n 12 "$LOGS/hf.log"; }
  [ -s "$LOGS/cli.log" ] && { echo "--- cli:"; tail -n 20 "$LOGS/cli.log"; }
  show sdpa "sdpa" "^\||device|unavailable|rror" 60
} > "$LOGS/summary_full.txt" 2>&1
cat "$LOGS/summary_full.txt"
cp "$LOGS/summary_full.txt" "$OUT/summary.txt"
for f in ctest.xml bench.csv bench_model.csv ttft.csv; do
  [ -f "$LOGS/$f" ] && cp "$LOGS/$f" "$OUT/"
done
tar -C "$WORK" -czf "$OUT/check.tgz" logs
exit 0
