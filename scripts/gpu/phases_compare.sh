# shellcheck shell=bash disable=SC2086
# scripts/gpu/phases_compare.sh — an older commit beside this tree on one GPU machine (phases of run.sh): the
# acceptance run of a change that must keep behaviour and speed.
#
# Here: `bash scripts/gpu/run.sh old COMMIT` (git archive into build/old-src, without docs/ and tests/) and, to test a
# commit rather than the working tree, `bash scripts/gpu/run.sh new COMMIT` (build/new-src). Carry ["build/gpu-debs",
# "build/old-src"] (and "build/new-src"). A warm machine keeps both builds between calls.
#
#   compare  COMPARE_STEPS (default build,test,bench):
#            build   both trees in parallel (old: the benches only; new: cuda_all, warnings as errors)
#            test    the new tree's GPU test programs, one process each, side by side (TESTS; oom_serial_test after)
#            bench   ROUNDS (2) rounds alternating old / new of each of PAIRS (default "attn ttft"):
#                    attn    attention_gpu_bench (ATTN_ARGS; default model inputs, 32K and 128K, five patterns)
#                    ttft    ttft_bench at 128K, local weights (TTFT_ARGS), TTFT_POLICIES (dense / VS / TriangleMix+VS /
#                            A-shape; recipe: adaptive VS instead of A-shape)
#                    decode  decode_bench 32K / 128K, batch 1 / 8 (DECODE_ARGS)
#                    stream  stream_bench 128K, dense and streamingllm, STREAM_DECODE (32) decode steps
#                    then one table per pair (scripts/compare_results.py: medians, new / old)
#            cycles  Nsight Compute at its base clock: cycles of the Hopper kernel, old and new, on CYCLE_ROWS
#                    (pattern:seq[:dense backend]): the comparison the SM clock does not move
#   recipe   compare with PAIRS="decode stream ttft" and STREAM_DECODE=128 (issue 32's run: the layer recipe's CUDA
#            backend against the loops it replaced)

CMP=$WORK/cmp
OLD_SRC=$ROOT/build/old-src
OLD_BUILD=$ROOT/build/cmp-old
NEW_BUILD=$ROOT/build/cmp-new

new_src() { [ -f "$ROOT/build/new-src/CMakeLists.txt" ] && echo "$ROOT/build/new-src" || echo "$ROOT"; }

# OLD_ARGS: the old tree's CMake arguments: this tree's packages (deps.sh), or for trees from before scripts/gpu/deps.sh
# (up to 0e6bebe) the dependency pack they carried (`cd build/old-src && bash scripts/gpu/engine_check.sh --pack-deps`).
old_args() {
  read -r -a OLD_ARGS <<< "${TESSERA_DEPS_CMAKE_ARGS:-}"
  [ -f "$OLD_SRC/scripts/gpu/deps.sh" ] || [ ! -f "$OLD_SRC/build/gpu-deps-engine.tar.xz" ] && return 0
  local d=$OLD_SRC/build/gpu-deps-engine
  [ -d "$d" ] || tar -C "$OLD_SRC/build" -xJf "$OLD_SRC/build/gpu-deps-engine.tar.xz"
  OLD_ARGS=("-DCMAKE_CXX_FLAGS=-isystem $d/include" "-DCMAKE_EXE_LINKER_FLAGS=-Wl,-rpath-link,$d/lib -Wl,-rpath,$d/lib"
    "-DBLAS_openblas_LIBRARY=$d/lib/libopenblas.so" "-DPCRE2_INCLUDE_DIR=$d/include" "-DPCRE2_LIBRARY=$d/lib/libpcre2-8.so"
    "-DGTest_DIR=$d/lib/x86_64-linux-gnu/cmake/GTest" "-Dnlohmann_json_DIR=$d/share/cmake/nlohmann_json"
    "-DCLI11_DIR=$d/share/cmake/CLI11")
  export LD_LIBRARY_PATH="$d/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

# The old tree's targets: the benches PAIRS (and cycles) run.
pair_targets() {
  local p t=""
  for p in ${PAIRS:-attn ttft}; do
    case $p in attn) t+=" attention_gpu_bench" ;; ttft) t+=" ttft_bench" ;; decode) t+=" decode_bench" ;; stream) t+=" stream_bench" ;; esac
  done
  has_step "${COMPARE_STEPS:-build,test,bench}" cycles && t+=" attention_gpu_bench"
  echo $t
}

cmp_build() {
  local half=$((JOBS / 2)) old_rc=0 new_rc=0 src
  src=$(new_src)
  [ -f "$OLD_SRC/CMakeLists.txt" ] || { echo "no build/old-src (run.sh old COMMIT here, carry it)"; return 1; }
  touch_sources "$src/src" "$src/tests" "$src/bench" "$OLD_SRC/src" "$OLD_SRC/bench"
  old_args
  (cmake -S "$OLD_SRC" -B "$OLD_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTESSERA_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90a -DTESSERA_BUILD_TESTS=OFF "${OLD_ARGS[@]}" &&
    cmake --build "$OLD_BUILD" -j"$half" --target ${OLD_TARGETS:-$(pair_targets)}) \
    > "$LOGS/build_old.log" 2>&1 &
  local pid=$!
  trap 'kill $pid 2> /dev/null' TERM EXIT  # a step cut by its time limit stops the old tree's build too
  (configure "$NEW_BUILD" "$src" -DTESSERA_CUDA_PTXAS_VERBOSE=ON && cmake --build "$NEW_BUILD" -j"$half" --target cuda_all) \
    > "$LOGS/build_new.log" 2>&1 || new_rc=$?
  wait $pid || old_rc=$?
  echo "build: old rc $old_rc, new rc $new_rc ($src)"
  [ $old_rc -ne 0 ] && tail -30 "$LOGS/build_old.log"
  [ $new_rc -ne 0 ] && { grep -E "error|FAILED" "$LOGS/build_new.log" | head -20; tail -20 "$LOGS/build_new.log"; }
  return $((old_rc + new_rc))
}

# The new tree's GPU test programs, each one process, side by side on the one GPU; the out-of-memory test after.
cmp_test() {
  local t rc=0 pids=() f
  for t in ${TESTS:-attention_gpu_test engine_gpu_test batch_gpu_test stream_gpu_test fp8_gemm_test stream_decide_test plan_gradients_gpu_test}; do
    f=$(BUILD_DIR=$NEW_BUILD bin "$t")
    [ -n "$f" ] || { echo "$t: not built"; continue; }
    timeout 240 "$f" > "$LOGS/cmp_test_$t.log" 2>&1 &
    pids+=($!)
  done
  for t in "${pids[@]}"; do wait "$t" || rc=1; done
  f=$(BUILD_DIR=$NEW_BUILD bin oom_serial_test)
  [ -n "$f" ] && { timeout 90 "$f" > "$LOGS/cmp_test_oom_serial_test.log" 2>&1 || rc=1; }
  for f in "$LOGS"/cmp_test_*.log; do
    echo "$(basename "$f" .log | sed 's/cmp_test_//'): $(grep -E "^\[  PASSED  \]|^\[  FAILED  \] [0-9]+ test|^\[  SKIPPED \] [0-9]+ test" "$f" | tr '\n' ' ')"
  done
  grep -hE "^\[  FAILED  \] [A-Za-z]|Failure$|Expected|Which is" "$LOGS"/cmp_test_*.log | head -20
  return $rc
}

# pair NAME BIN ARGS...: old then new, each round; CSVs $CMP/NAME_{old,new}_ROUND.csv.
pair() {
  local name=$1 b=$2 r tag dir extra
  shift 2
  for r in $(seq 1 "${ROUNDS:-2}"); do
    for tag in old new; do
      [ "$(left)" -lt 30 ] && { say "$name $tag round $r SKIPPED (budget spent)"; continue; }
      [ "$tag" = old ] && dir=$OLD_BUILD || dir=$NEW_BUILD
      extra=""
      # the 13-variant trees of before issue 15 time every variant unless told not to
      [ "$tag" = old ] && [ "$b" = attention_gpu_bench ] && grep -q -- '"--variants"' "$OLD_SRC/bench/gpu/attention_gpu_bench.cu" 2> /dev/null &&
        extra="--variants off"
      timeout 300 "$dir/bench/gpu/$b" "$@" $extra --csv "$CMP/${name}_${tag}_$r.csv" > "$LOGS/${name}_${tag}_$r.log" 2>&1 ||
        say "$name $tag round $r failed: $(tail -2 "$LOGS/${name}_${tag}_$r.log" | tr '\n' ' ')"
    done
  done
  python3 "$ROOT/scripts/compare_results.py" --title "$name ($b $*)" "$CMP/${name}_old_"*.csv -- "$CMP/${name}_new_"*.csv \
    > "$LOGS/compare_$name.md" 2>&1
  cat "$LOGS/compare_$name.md" | tee -a "$SUMMARY"
}

cmp_bench() {
  local p
  gpu_line | tee -a "$SUMMARY"
  for p in ${PAIRS:-attn ttft}; do
    case $p in
      attn) pair attn attention_gpu_bench ${ATTN_ARGS:---inputs model --seq 32768,131072 --patterns dense,vs,bs,ashape,triangle --kernel auto --reps 5} ;;
      ttft) pair ttft ttft_bench ${TTFT_ARGS:---seq 131072 --weights local --reps 1} --policies \
        "${TTFT_POLICIES:-dense;vs:v=1000,s=6096;trianglemix:start=16,inner=vs,v=1000,s=6096,sink=64,local=512,last=64;ashape:sink=128,local=4096}" ;;
      decode) pair decode decode_bench ${DECODE_ARGS:---ctx 32768,131072 --batch 1,8 --steps 20} ;;
      stream) pair stream stream_bench --seq 131072 --methods streamingllm --dense 131072 --decode "${STREAM_DECODE:-32}" ;;
      *) say "compare: PAIRS has $p, not one of attn ttft decode stream" ;;
    esac
  done
}

cmp_cycles() {
  local ncu row pat seq backend tag dir kname
  ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2> /dev/null | head -1)
  [ -n "$ncu" ] || { echo "cycles: no ncu"; return 1; }
  for row in ${CYCLE_ROWS:-vs:131072 bs:131072 ashape:131072 triangle:131072 dense:32768:ours}; do
    IFS=: read -r pat seq backend <<< "$row"
    for tag in old new; do
      [ "$tag" = old ] && dir=$OLD_BUILD || dir=$NEW_BUILD
      kname='regex:hopper_prefill_kernel<__nv_bfloat16>'
      [ "$tag" = old ] && [ ! -f "$OLD_SRC/src/attention/cuda/hopper/prefill_kernel.cuh" ] &&
        kname='regex:sparse_prefill_wgmma_tma_kernel<__nv_bfloat16, \(int\)6, \(bool\)1, \(bool\)1, \(int\)8, \(bool\)1, \(int\)0, \(bool\)1>'
      timeout 150 "$ncu" --kernel-name-base demangled --kernel-name "$kname" --launch-skip 1 --launch-count 1 \
        --metrics sm__cycles_elapsed.avg,gpu__time_duration.sum --csv --page raw --print-units base \
        "$dir/bench/gpu/attention_gpu_bench" --inputs model --seq "$seq" --patterns "$pat" --kernel auto --reps 1 \
        --warmup 0 --dense-backend "${backend:-auto}" > "$LOGS/ncu_${pat}_${seq}_$tag.csv" 2>&1
      python3 - "$LOGS/ncu_${pat}_${seq}_$tag.csv" "$tag $pat $seq" << 'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
start = next((i for i, r in enumerate(rows) if r and r[0] == "ID"), None)
val = [] if start is None else [r for r in rows[start + 1:] if len(r) == len(rows[start]) and r[0].isdigit()]
if not val:
    sys.exit(f"{sys.argv[2]}: no kernel measured")
v = dict(zip(rows[start], val[-1]))
g = lambda k: float(v.get(k, "nan").replace(",", ""))
print(f"{sys.argv[2]}: {g('sm__cycles_elapsed.avg') / 1e6:.3f} M cycles, {g('gpu__time_duration.sum') / 1e6:.3f} ms at base clock")
PY
    done
  done
}

phase_compare() {
  local steps=${COMPARE_STEPS:-build,test,bench}
  mkdir -p "$CMP"
  say "compare: old $(cat "$OLD_SRC/.commit" 2> /dev/null || echo build/old-src), new $(cat "$(new_src)/.commit" 2> /dev/null || echo "this tree")"
  if has_step "$steps" build; then
    STEP_TAIL=6 step cmp_build 480 cmp_build || return 1
  fi
  has_step "$steps" test && STEP_TAIL=12 step cmp_test 300 cmp_test
  has_step "$steps" bench && cmp_bench
  has_step "$steps" cycles && STEP_TAIL=12 step cmp_cycles "$(left)" cmp_cycles
  cp "$CMP"/*.csv "$CSV/" 2> /dev/null
  return 0
}

phase_recipe() {
  PAIRS=${PAIRS:-decode stream ttft} STREAM_DECODE=${STREAM_DECODE:-128} ROUNDS=${ROUNDS:-1} \
    TTFT_POLICIES=${TTFT_POLICIES:-dense;vs:v=1000,s=6096;trianglemix:start=16,inner=vs,v=1000,s=6096,sink=64,local=512,last=64;vs_adaptive:gamma=0.9} \
    phase_compare
}
