#!/usr/bin/env bash
# scripts/gpu/recipe_check.sh — issue 32's GPU check of the layer recipe's CUDA backend (runtime/cuda/gpu_ops.h): this
# tree against an older commit on one GPU machine, each phase one device call (a cold machine builds again first).
#
# Here (nothing is committed; docs/ and the old tree's tests/ are not needed, and the 64 MiB a call carries is tight):
#   git archive OLD_COMMIT | (mkdir -p build/old-src && tar -x -C build/old-src) && rm -rf build/old-src/{docs,tests}
#   (issue 32's run: OLD_COMMIT ca04620, whose CUDA build misses 81c4e34's GpuEngine::memory() override: its
#   gpu_engine.h was patched as 758bd10 has it, GpuMemoryStats = EngineMemory and memory() const override)
#   git archive NEW_COMMIT | (mkdir -p build/new-src && tar -x -C build/new-src) && rm -rf build/new-src/docs
#   bash scripts/gpu/deps.sh download
# (build/new-src: a commit rather than the working tree, which may hold other work in progress; without it, this
# tree is the new one.) There, carrying ["build/gpu-debs", "build/old-src", "build/new-src"]:
#   bash scripts/gpu/recipe_check.sh test     builds both trees (this one: cuda_all; the old one: its benches), then
#                                             the GPU test programs of this tree ($OUT/test.log), then the decode
#                                             benches (below)
#   bash scripts/gpu/recipe_check.sh bench    builds what is missing, then stream_bench and ttft_bench, old / new
# Benchmarks, alternating old / new (random weights of Llama-3-8B shapes):
#   decode   decode_bench --ctx 32768,131072 --batch 1,8 (the batched engine's CUDA-graph step)
#   stream   stream_bench --seq 131072 --methods streamingllm --dense 131072 --decode 32 (the single-sequence engine:
#            TTFT and decode tokens/s at 128K, dense and streamed)
#   ttft     ttft_bench --seq 131072 --weights local: dense (with --decode 32), VS, TriangleMix+VS, adaptive VS
# $OUT: summary.txt (the rows side by side), test.log, bench.log (every bench's output, in order) and
# logs.tgz (every log and CSV).
# Environment: OUT (default build/recipe-check/out), JOBS (16), ROUNDS (1), PHASES (decode for `test`; stream ttft
# for `bench`), BUDGET_S (520: no benchmark starts after that many seconds), TEST_TIMEOUT_S (240 per program), TESTS
# (the test programs; default: every GPU test program but oom_serial_test, which runs after them), STREAM_DECODE
# (stream_bench decode steps, 32).
set -u
set -o pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OLD_SRC=$ROOT/build/old-src
NEW_SRC=$ROOT/build/new-src
[ -d "$NEW_SRC/src" ] || NEW_SRC=$ROOT
OLD_BUILD=$ROOT/build/cmp-old
NEW_BUILD=$ROOT/build/cmp-new
OUT=${OUT:-$ROOT/build/recipe-check/out}
WORK=$ROOT/build/recipe-check  # every log and CSV (a tar of them comes back in $OUT)
JOBS=${JOBS:-16}
ROUNDS=${ROUNDS:-1}
mkdir -p "$OUT" "$WORK"
export PATH=$PATH:/usr/local/cuda/bin
START=$(date +%s)
: > "$OUT/summary.txt"
say() { echo "[$(( $(date +%s) - START ))s] $*" | tee -a "$OUT/summary.txt"; }

deps() {
  if [ -d "$ROOT/build/gpu-debs" ]; then
    [ -f "$ROOT/build/gpu-sysroot/deps.env" ] || bash "$ROOT/scripts/gpu/deps.sh" unpack > "$WORK/deps.log" 2>&1
    # shellcheck disable=SC1091
    . "$ROOT/build/gpu-sysroot/deps.env"
  fi
}

build() {
  local half=$((JOBS / 2)) old_rc=0 new_rc=0
  if [ ! -x "$OLD_BUILD/bench/gpu/ttft_bench" ] || [ ! -x "$NEW_BUILD/tests/gpu/engine_gpu_test" ]; then
    # The device tool copies files with the sender's times: touch every source so that ninja rebuilds what changed.
    find "$NEW_SRC/src" "$NEW_SRC/tests" "$NEW_SRC/bench" "$OLD_SRC/src" "$OLD_SRC/bench" -type f -exec touch {} +
  fi
  # shellcheck disable=SC2086
  (
    cmake -S "$OLD_SRC" -B "$OLD_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTESSERA_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90a -DTESSERA_BUILD_TESTS=OFF ${TESSERA_DEPS_CMAKE_ARGS:-} &&
      cmake --build "$OLD_BUILD" -j"$half" --target decode_bench stream_bench ttft_bench
  ) > "$WORK/build_old.log" 2>&1 &
  local old_pid=$!
  # shellcheck disable=SC2086
  (
    cd "$NEW_SRC" && cmake --preset cuda -B "$NEW_BUILD" -DTESSERA_WERROR=ON ${TESSERA_DEPS_CMAKE_ARGS:-} &&
      cmake --build "$NEW_BUILD" -j"$half" --target cuda_all
  ) > "$WORK/build_new.log" 2>&1 || new_rc=$?
  wait $old_pid || old_rc=$?
  say "build: old rc $old_rc, new rc $new_rc"
  [ $old_rc -ne 0 ] && tail -30 "$WORK/build_old.log"
  [ $new_rc -ne 0 ] && { grep -E "error|FAILED" "$WORK/build_new.log" | head -20; tail -20 "$WORK/build_new.log"; }
  return $((old_rc + new_rc))
}

# The GPU test programs of this tree, each one process (gtest runs its cases in order; ctest would start one process
# per case), side by side on the one GPU; the out-of-memory test alone afterwards (it fills the device).
run_tests() {
  local t rc=0 pids=()
  : > "$WORK/test.log"
  for t in ${TESTS:-engine_gpu_test batch_gpu_test stream_gpu_test tp_gpu_test fp8_gemm_test stream_decide_test \
    plan_gradients_gpu_test attention_gpu_test}; do
    [ -x "$NEW_BUILD/tests/gpu/$t" ] || { say "test $t: not built"; continue; }
    timeout "${TEST_TIMEOUT_S:-240}" "$NEW_BUILD/tests/gpu/$t" > "$WORK/test_$t.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  [ -x "$NEW_BUILD/tests/gpu/oom_serial_test" ] &&
    timeout 90 "$NEW_BUILD/tests/gpu/oom_serial_test" > "$WORK/test_oom_serial_test.log" 2>&1
  for f in "$WORK"/test_*.log; do
    t=$(basename "$f" .log)
    say "${t#test_}: $(grep -E "^\[  PASSED  \]|^\[  FAILED  \] [0-9]+ test|^\[  SKIPPED \] [0-9]+ test" "$f" | tr '\n' ' ') $(grep -qE "^\[  PASSED  \]" "$f" || echo "(no PASSED line: $(tail -2 "$f" | tr '\n' ' '))")"
    { echo "===== $t"; cat "$f"; } >> "$WORK/test.log"
  done
  grep -hE "^\[  FAILED  \] [A-Za-z]|Failure$|Expected|Which is|error:" "$WORK"/test_*.log | head -40 | tee -a "$OUT/summary.txt"
  cp "$WORK/test.log" "$OUT/" 2> /dev/null
  return $rc
}

# bench NAME ARGS...: old then new, ROUNDS times, output in bench.log, the rows in summary.txt.
bench_pair() {
  local name=$1 bin=$2
  shift 2
  local r tag dir
  for r in $(seq 1 "$ROUNDS"); do
    for tag in old new; do
      if [ $(( $(date +%s) - START )) -gt "${BUDGET_S:-520}" ]; then
        say "$name $tag round $r SKIPPED (budget spent)"
        continue
      fi
      [ "$tag" = old ] && dir=$OLD_BUILD || dir=$NEW_BUILD
      echo "=== $name $tag round $r: $bin $*" >> "$OUT/bench.log"
      timeout 300 "$dir/bench/gpu/$bin" "$@" --csv "$WORK/${name}_${tag}_$r.csv" > "$WORK/${name}_${tag}_$r.log" 2>&1 ||
        say "$name $tag round $r failed: $(tail -3 "$WORK/${name}_${tag}_$r.log")"
      cat "$WORK/${name}_${tag}_$r.log" >> "$OUT/bench.log"
      say "--- $name $tag round $r"
      grep -E "^\|" "$WORK/${name}_${tag}_$r.log" | tee -a "$OUT/summary.txt" > /dev/null
    done
  done
}

phase() {
  case "$1" in
    decode) bench_pair decode decode_bench --ctx 32768,131072 --batch 1,8 --steps 20 ;;
    stream) bench_pair stream stream_bench --seq 131072 --methods streamingllm --dense 131072 --decode "${STREAM_DECODE:-32}" ;;
    ttft)
      bench_pair ttft ttft_bench --seq 131072 --weights local --reps 1 --decode 32 --policies \
        "dense;vs:v=1000,s=6096;trianglemix:start=16,inner=vs,v=1000,s=6096,sink=64,local=512,last=64;vs_adaptive:gamma=0.9"
      ;;
  esac
}

deps
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu --format=csv |
  tee -a "$OUT/summary.txt"
echo "new tree: $NEW_SRC, old tree: $OLD_SRC" | tee -a "$OUT/summary.txt"
build || { say "build failed"; cp "$WORK"/build_*.log "$OUT/" 2> /dev/null; exit 1; }
case "${1:-}" in
  test)
    run_tests
    for p in ${PHASES:-decode}; do phase "$p"; done
    ;;
  bench)
    for p in ${PHASES:-stream ttft}; do phase "$p"; done
    ;;
  *)
    echo "usage: recipe_check.sh test|bench" >&2
    exit 2
    ;;
esac
say "done"
tar -C "$WORK" -czf "$OUT/logs.tgz" --exclude=out --exclude=gpu-sysroot . 2> /dev/null
cat "$OUT/summary.txt"
