#!/usr/bin/env bash
# scripts/gpu/compare_commits.sh — an older commit and this tree built side by side on one GPU machine: the GPU tests of
# this tree, and the attention and time-to-first-token benchmarks of both, alternating old / new, in one table (the
# acceptance run of a change that must keep behaviour and speed, e.g. issue 15's restructuring of the CUDA wing).
#
# Here (this machine reaches Debian's registry; nothing is committed):
#   git archive OLD_COMMIT | (mkdir -p build/old-src && tar -x -C build/old-src)
#   bash scripts/gpu/deps.sh download                                     # this tree's deps (build/gpu-debs)
# An old tree from before scripts/gpu/deps.sh (up to 0e6bebe) builds with its own deps pack instead:
#   (cd build/old-src && bash scripts/gpu/engine_check.sh --pack-deps && rm -rf build/gpu-deps-engine)
# There, carrying build/old-src and build/gpu-debs; each phase fits one device call, and a warm machine keeps the
# build folders between calls:
#   bash scripts/gpu/compare_commits.sh build    both trees, in parallel (logs in $OUT/build_{old,new}.log)
#   bash scripts/gpu/compare_commits.sh test     ctest -L gpu on this tree ($OUT/test.log, JUnit in $OUT/ctest.xml)
#   bash scripts/gpu/compare_commits.sh bench    ROUNDS (default 2) rounds of: attention bench old, new; TTFT old, new
#                                                ($OUT/*.csv, the table in $OUT/compare.md)
#   bash scripts/gpu/compare_commits.sh cycles   Nsight Compute at its locked base clock: cycles of the Hopper prefill
#                                                kernel (old: the self-check's first choice, variant 0) on CYCLE_ROWS
#                                                (pattern:seq[:backend]), old and new: wall time moves with the SM
#                                                clock under the 700 W cap, cycles do not
# Environment: OUT (default build/compare), JOBS (16), ROUNDS (2), ATTN_ARGS (default: model inputs, 32K and 128K,
# dense vs bs ashape triangle, 5 reps), TTFT_ARGS (default: 128K, local weights, dense / VS / TriangleMix+VS / A-shape).
set -u
set -o pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OLD_SRC=$ROOT/build/old-src
OLD_BUILD=$ROOT/build/cmp-old
NEW_BUILD=$ROOT/build/cmp-new
OUT=${OUT:-$ROOT/build/compare}
JOBS=${JOBS:-16}
ROUNDS=${ROUNDS:-2}
mkdir -p "$OUT"
export PATH=$PATH:/usr/local/cuda/bin
ATTN_ARGS=${ATTN_ARGS:---inputs model --seq 32768,131072 --patterns dense,vs,bs,ashape,triangle --kernel auto --reps 5}
TTFT_ARGS=${TTFT_ARGS:---seq 131072 --weights local --reps 1}
TTFT_POLICIES="dense;vs:v=1000,s=6096;trianglemix:start=16,inner=vs,v=1000,s=6096,sink=64,local=512,last=64;ashape:sink=128,local=4096"

# This tree's dependencies (scripts/gpu/deps.sh), and the old tree's own pack (its engine_check.sh layout).
new_deps() {
  if [ -d "$ROOT/build/gpu-debs" ]; then
    [ -f "$ROOT/build/gpu-sysroot/deps.env" ] || bash "$ROOT/scripts/gpu/deps.sh" unpack > "$OUT/deps.log" 2>&1
    # shellcheck disable=SC1091
    . "$ROOT/build/gpu-sysroot/deps.env"
  fi
}
old_deps_args() {
  if [ -f "$OLD_SRC/scripts/gpu/deps.sh" ]; then  # a tree of the same build layout: this tree's packages
    new_deps
    read -r -a OLD_ARGS <<< "${TESSERA_DEPS_CMAKE_ARGS:-}"
    return
  fi
  local deps=$OLD_SRC/build/gpu-deps-engine
  [ -d "$deps" ] || tar -C "$OLD_SRC/build" -xJf "$OLD_SRC/build/gpu-deps-engine.tar.xz"
  OLD_ARGS=("-DCMAKE_CXX_FLAGS=-isystem $deps/include"
    "-DCMAKE_EXE_LINKER_FLAGS=-Wl,-rpath-link,$deps/lib -Wl,-rpath,$deps/lib"
    "-DBLAS_openblas_LIBRARY=$deps/lib/libopenblas.so"
    "-DPCRE2_INCLUDE_DIR=$deps/include" "-DPCRE2_LIBRARY=$deps/lib/libpcre2-8.so"
    "-DGTest_DIR=$deps/lib/x86_64-linux-gnu/cmake/GTest" "-Dnlohmann_json_DIR=$deps/share/cmake/nlohmann_json"
    "-DCLI11_DIR=$deps/share/cmake/CLI11")
  export LD_LIBRARY_PATH="$deps/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

# The 13-variant benches time every variant unless told not to.
old_bench_extra() {
  grep -q -- '"--variants"' "$OLD_SRC/bench/gpu/attention_gpu_bench.cu" && echo "--variants off"
}

build() {
  old_deps_args
  new_deps
  # The device tool copies files with the sender's times: touch every source so that ninja rebuilds what changed.
  find "$ROOT/src" "$ROOT/tests" "$ROOT/bench" "$OLD_SRC/src" "$OLD_SRC/tests" "$OLD_SRC/bench" -type f -exec touch {} +
  local half=$((JOBS / 2))
  (
    cmake -S "$OLD_SRC" -B "$OLD_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTESSERA_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90a "${OLD_ARGS[@]}" &&
      cmake --build "$OLD_BUILD" -j"$half" --target attention_gpu_bench ttft_bench
  ) > "$OUT/build_old.log" 2>&1 &
  local old_pid=$!
  # shellcheck disable=SC2086
  (
    cmake --preset cuda -B "$NEW_BUILD" -DTESSERA_WERROR=ON -DTESSERA_CUDA_PTXAS_VERBOSE=ON ${TESSERA_DEPS_CMAKE_ARGS:-} &&
      cmake --build "$NEW_BUILD" -j"$half"
  ) > "$OUT/build_new.log" 2>&1
  local new_rc=$?
  wait $old_pid
  local old_rc=$?
  echo "build: old rc $old_rc, new rc $new_rc"
  [ $old_rc -ne 0 ] && tail -30 "$OUT/build_old.log"
  [ $new_rc -ne 0 ] && { grep -E "error|FAILED" "$OUT/build_new.log" | head -20; tail -30 "$OUT/build_new.log"; }
  grep -E "spill|C75[0-9][0-9]" "$OUT/build_new.log" | grep -v " 0 bytes spill" | head
  echo "prefill kernel entry points compiled: old $(grep -c 'sparse_prefill.*_kernel' "$OUT/build_old.log" || true) (no -v there), new $(grep -cE "Compiling entry function '.*(mma|hopper)_prefill_kernel" "$OUT/build_new.log")"
  return $((old_rc + new_rc))
}

run_tests() {
  new_deps
  ctest --test-dir "$NEW_BUILD" -L gpu --output-on-failure --output-junit "$OUT/ctest.xml" -j1 --timeout 300 \
    > "$OUT/test.log" 2>&1
  local rc=$?
  grep -E "tests passed|tests failed|Failed|\*\*\*|Total Test time" "$OUT/test.log" | tail -20
  grep -E "^\[ wgmma self-check \]|^wgmma " "$OUT/test.log" | head -4
  return $rc
}

bench() {
  old_deps_args
  new_deps
  local r tag bin
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu --format=csv
  for r in $(seq 1 "$ROUNDS"); do
    for tag in old new; do
      [ "$tag" = old ] && bin=$OLD_BUILD || bin=$NEW_BUILD
      local extra=""
      [ "$tag" = old ] && extra=$(old_bench_extra)
      # shellcheck disable=SC2086
      "$bin/bench/gpu/attention_gpu_bench" $ATTN_ARGS $extra --csv "$OUT/attn_${tag}_$r.csv" \
        > "$OUT/attn_${tag}_$r.log" 2>&1 || echo "attention bench $tag round $r failed: $(tail -3 "$OUT/attn_${tag}_$r.log")"
    done
    for tag in old new; do
      [ "$tag" = old ] && bin=$OLD_BUILD || bin=$NEW_BUILD
      # shellcheck disable=SC2086
      "$bin/bench/gpu/ttft_bench" $TTFT_ARGS --policies "$TTFT_POLICIES" --csv "$OUT/ttft_${tag}_$r.csv" \
        > "$OUT/ttft_${tag}_$r.log" 2>&1 || echo "ttft bench $tag round $r failed: $(tail -3 "$OUT/ttft_${tag}_$r.log")"
    done
  done
  python3 "$ROOT/scripts/gpu/compare_table.py" "$OUT" "$ROUNDS" | tee "$OUT/compare.md"
}

# Cycles of one launch of the Hopper kernel (the first after its self-check) in attention_gpu_bench.
cycles() {
  old_deps_args
  new_deps
  local ncu row pat seq backend tag bin kname
  ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  [ -n "$ncu" ] || { echo "cycles: no ncu"; return 1; }
  : > "$OUT/cycles.txt"
  for row in ${CYCLE_ROWS:-vs:131072 bs:131072 ashape:131072 triangle:131072 dense:32768:ours}; do
    IFS=: read -r pat seq backend <<< "$row"
    for tag in old new; do
      if [ "$tag" = old ] && [ -f "$OLD_SRC/src/attention/cuda/hopper/prefill_kernel.cuh" ]; then
        bin=$OLD_BUILD
        kname='regex:hopper_prefill_kernel<__nv_bfloat16>'
      elif [ "$tag" = old ]; then  # the 13-variant trees: variant 0, the self-check's choice
        bin=$OLD_BUILD
        kname='regex:sparse_prefill_wgmma_tma_kernel<__nv_bfloat16, \(int\)6, \(bool\)1, \(bool\)1, \(int\)8, \(bool\)1, \(int\)0, \(bool\)1>'
      else
        bin=$NEW_BUILD
        kname='regex:hopper_prefill_kernel<__nv_bfloat16>'
      fi
      local extra=""
      [ "$tag" = old ] && extra=$(old_bench_extra)
      # shellcheck disable=SC2086
      timeout 150 "$ncu" --kernel-name-base demangled --kernel-name "$kname" --launch-skip 1 --launch-count 1 \
        --metrics sm__cycles_elapsed.avg,gpu__time_duration.sum --csv --page raw --print-units base \
        "$bin/bench/gpu/attention_gpu_bench" --inputs model --seq "$seq" --patterns "$pat" --kernel auto --reps 1 \
        --warmup 0 --dense-backend "${backend:-auto}" $extra > "$OUT/ncu_${pat}_${seq}_$tag.csv" 2>&1
      python3 - "$OUT/ncu_${pat}_${seq}_$tag.csv" "$tag $pat $seq" <<'PY' | tee -a "$OUT/cycles.txt"
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
start = next((i for i, r in enumerate(rows) if r and r[0] == "ID"), None)
val = [] if start is None else [r for r in rows[start + 1:] if len(r) == len(rows[start]) and r[0].isdigit()]
if not val:
    print(f"{sys.argv[2]}: no kernel measured ({open(sys.argv[1]).read()[-300:]!r})")
    sys.exit()
v = dict(zip(rows[start], val[-1]))
g = lambda k: float(v.get(k, "nan").replace(",", ""))
print(f"{sys.argv[2]}: {g('sm__cycles_elapsed.avg') / 1e6:.3f} M cycles, {g('gpu__time_duration.sum') / 1e6:.3f} ms at base clock")
PY
    done
  done
}

case "${1:-}" in
  cycles) cycles ;;
  build) build ;;
  test) run_tests ;;
  bench) bench ;;
  *)
    echo "usage: compare_commits.sh build|test|bench" >&2
    exit 2
    ;;
esac
