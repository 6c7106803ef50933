# shellcheck shell=bash disable=SC2086
# scripts/gpu/phases_core.sh — the phases of scripts/gpu/run.sh that build, test and benchmark one tree on one GPU.
# Each phase_NAME is one word of `run.sh NAME`; run.sh's header lists them with their variables.

phase_env() {
  env_report() {
    nvidia-smi
    nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,temperature.gpu --format=csv
    nvcc --version | tail -2
    g++ --version | head -1
    cmake --version | head -1
    command -v ninja compute-sanitizer cuobjdump ncu
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())'
    echo "cores $(nproc); $(free -g | awk '/Mem:/ {print $2 " GB host memory"}'); NCCL: $(nccl_root || echo none)"
    ls "$ROOT/build/gpu-debs" > /dev/null 2>&1 && echo "build/gpu-debs carried" || echo "no build/gpu-debs carried"
    git -C "$ROOT" log --oneline -3 || true
  }
  STEP_TAIL=0 step env 60 env_report
  say "gpu: $(gpu_line)"
}

# configure (warnings as errors, ptxas resources in the log) and build cuda_all (BUILD_TARGETS), then the kernels'
# resources (fails on ptxas's C75xx "wgmma serialized" advisories) and the Hopper kernel's self-check alone (if it
# crashes the process, the later phases run with TESSERA_PREFILL_KERNEL=mma).
phase_build() {
  touch_sources "$SRC/src" "$SRC/tests" "$SRC/bench"
  step configure 150 configure "$BUILD_DIR" "$SRC" -DTESSERA_CUDA_PTXAS_VERBOSE=ON || return 1
  grep -hE "^-- tessera: (building|.* off:|cuDNN)" "$LOGS/configure.log" | head -5 | tee -a "$SUMMARY"
  step build 420 cmake --build "$BUILD_DIR" -j "$JOBS" --target ${BUILD_TARGETS:-cuda_all} || {
    grep -E "error|FAILED" "$LOGS/build.log" | head -20 | tee -a "$SUMMARY"
    return 1
  }
  resources() {
    local blog=$LOGS/build.log lib=$BUILD_DIR/src/attention/cuda/libtessera_cuda.a
    grep -E "Compiling entry|Used [0-9]+ registers|spill" "$blog" | sed 's/ptxas info    : //' | grep -B1 -E "[1-9][0-9]* bytes spill" | head -20
    echo "HGMMA instructions in $lib: $(cuobjdump -sass "$lib" 2> /dev/null | grep -c HGMMA)"
    if grep -qE "\(C75[0-9][0-9]\)" "$blog"; then
      echo "wgmma serialised by ptxas:"
      grep -E "\(C75[0-9][0-9]\)" "$blog" | head -10
      return 5
    fi
  }
  [ "${BUILD_TARGETS:-cuda_all}" = cuda_all ] && STEP_TAIL=3 step resources 40 resources
  local t
  t=$(bin attention_gpu_test)
  if [ -n "$t" ]; then
    STEP_TAIL=4 step wgmma_probe 60 "$t" --gtest_filter='CudaAttention.*SelfCheck'
    if [ $? -gt 1 ] || grep -q "self-check error: CUDA error" "$LOGS/wgmma_probe.log"; then
      export TESSERA_PREFILL_KERNEL=mma
      say "wgmma_probe: the Hopper kernel crashed: TESSERA_PREFILL_KERNEL=mma for the later phases"
    fi
  fi
}

# ctest -L gpu (every GPU test program against the CPU references), JUnit XML in the logs; failures in the summary.
phase_test() {
  need attention_gpu_test engine_gpu_test || return 1
  models
  STEP_TAIL=0 step test "${TEST_S:-300}" ctest --test-dir "$BUILD_DIR" -L gpu -j "${CTEST_JOBS:-4}" --timeout 300 \
    --output-on-failure --output-junit "$LOGS/ctest.xml"
  grep -E "tests passed|tests failed|\*\*\*(Failed|Exception|Timeout)|Total Test time" "$LOGS/test.log" | tail -12 |
    tee -a "$SUMMARY"
  say "test: skipped $(grep -c '\*\*\*Skipped' "$LOGS/test.log")"
}

# compute-sanitizer on small cases: racecheck of the top-k (any hazard fails), memcheck (MEMCHECK_ALL=1: with leak
# check over every test of the attention and engine test programs, SHARDS in parallel, cuDNN's own three cudnnCreate
# allocations not counted), synccheck, racecheck of the mma.sync and Hopper kernels (the Hopper kernel's mbarrier
# handoff is a class racecheck cannot follow: reported, known).
phase_sanitize() {
  need attention_gpu_test engine_gpu_test oom_serial_test || return 1
  local T E F
  T=$(bin attention_gpu_test)
  E=$(bin engine_gpu_test)
  F='Cases/ExecutorTest.MatchesReference/dense_win37_s100_d64_f16_t64:Cases/ExecutorTest.MatchesReference/mixed_win70_s130_d128_bf16:Cases/ExecutorTest.MatchesReference/mixed_s100_d64_f16_t64:Cases/ExecutorTest.MatchesReference/mixed_s1000_d128_bf16:Cases/ExecutorTest.MatchesReference/mixed_s300_d256_f16_t64:Cases/ExecutorTest.MatchesReference/mixed_chunk_q777_s333_tail50:Cases/ExecutorTest.MatchesReference/empty_vs_s200:Cases/DeviceIndexTest.IdenticalToCpuLowering/mixed_s1000:Cases/DeviceEstimateTest.*/s100_d64_bf16:Cases/EndToEndTest.MatchesReferenceOnItsOwnIndex/mixed_s1000_bf16:CudaAttention.*'
  racecheck_topk() {
    compute-sanitizer --tool racecheck --racecheck-report hazard "$1" \
      --gtest_filter='Cases/DeviceEstimateTest.*/s100_d64_bf16:Cases/DeviceEstimateTest.*/s1000_d64_f16:Cases/DeviceEstimateTest.*/s40_short'
    local rc=$?
    grep -qE "RACECHECK SUMMARY: [1-9][0-9]* hazard" "$LOGS/sanitizer_racecheck_topk.log" && return 4
    return $rc
  }
  memcheck_all() {
    local shards=${SHARDS:-8} rc=0 b i errors third ours f
    for b in "$1" "$2"; do
      for ((i = 0; i < shards; i++)); do
        GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i compute-sanitizer --tool memcheck --leak-check full \
          --error-exitcode 3 "$b" > "$LOGS/memcheck_$(basename "$b")_$i.log" 2>&1 &
      done
      wait
    done
    compute-sanitizer --tool memcheck --leak-check full --report-api-errors no --error-exitcode 3 "$3" \
      > "$LOGS/memcheck_oom_serial_test_0.log" 2>&1
    for f in "$LOGS"/memcheck_*_*.log; do
      errors=$(grep -oE "ERROR SUMMARY: [0-9]+" "$f" | tail -1 | grep -oE "[0-9]+$")
      third=$(awk '/^========= Leaked/ {leak = 1; next} leak && /cudnnCreate/ {n++; leak = 0} /^========= $/ {leak = 0} END {print n + 0}' "$f")
      ours=$((${errors:-1} - third))
      echo "$(basename "$f" .log): memcheck errors ${errors:-?} ($third cuDNN-internal leaks, $ours ours)"
      if [ "$ours" -ne 0 ] || grep -q "^\[  FAILED  \]" "$f" || ! grep -q "^\[  PASSED  \]" "$f"; then rc=1; fi
    done
    return $rc
  }
  STEP_TAIL=3 step sanitizer_racecheck_topk 60 racecheck_topk "$T"
  if [ "${MEMCHECK_ALL:-0}" = 1 ]; then
    STEP_TAIL=20 step sanitizer_memcheck_all "${MEMCHECK_ALL_S:-420}" memcheck_all "$T" "$E" "$(bin oom_serial_test)"
  else
    STEP_TAIL=2 step sanitizer_memcheck 100 compute-sanitizer --tool memcheck --error-exitcode 3 "$T" --gtest_filter="$F"
  fi
  STEP_TAIL=2 step sanitizer_synccheck 60 compute-sanitizer --tool synccheck --error-exitcode 3 "$T" --gtest_filter="$F"
  STEP_TAIL=2 step sanitizer_racecheck 90 compute-sanitizer --tool racecheck --error-exitcode 3 "$T" \
    --gtest_filter='Cases/ExecutorTest.MatchesReference/mixed_s100_d64_f16_t64:Cases/ExecutorTest.MatchesReference/dense_s100_d64_f16_t64:Cases/DeviceEstimateTest.*/s40_short:Cases/DeviceIndexTest.IdenticalToCpuLowering/bs_s1000:Cases/DeviceIndexTest.IdenticalToCpuLowering/vs_s1000:DeviceEstimateMixed.*'
  STEP_TAIL=2 step sanitizer_racecheck_wgmma 60 compute-sanitizer --tool racecheck --error-exitcode 3 "$T" \
    --gtest_filter='Cases/ExecutorTest.MatchesReference/mixed_s1_d128_bf16'
}

# The CPU suite under ASan + UBSan on the lent machine's cores (what CI's scripts/test.sh runs), a quick check.
phase_asan() {
  asan() {
    cmake --preset asan $TESSERA_DEPS_CMAKE_ARGS && cmake --build build/asan -j "$JOBS" &&
      TESSERA_ALLOW_MISSING_MODELS=1 ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:allocator_may_return_null=1 \
        UBSAN_OPTIONS=print_stacktrace=1 ctest --test-dir build/asan -LE gpu -j "$JOBS" --timeout 900 --output-on-failure
  }
  STEP_TAIL=0 step asan "${ASAN_S:-500}" asan
  grep -E "tests passed|tests failed|\*\*\*Failed|runtime error|ERROR: (Address|Leak)Sanitizer" "$LOGS/asan.log" |
    sort | uniq -c | head -20 | tee -a "$SUMMARY"
}

# attention_gpu_bench, Llama-3-8B attention shapes, one layer: BENCH_ARGS (default RoPE inputs 8K-128K, every pattern)
# then model-like inputs at 32K / 128K (BENCH_MODEL_ARGS; "" skips), short prompts (BENCH_SHORT=1) and torch SDPA
# (SDPA=1); SAMPLE_CLOCKS=1 samples the SM clock and power every 50 ms meanwhile.
phase_bench() {
  need attention_gpu_bench || return 1
  local B smi=""
  B=$(bin attention_gpu_bench)
  if [ "${SAMPLE_CLOCKS:-0}" = 1 ]; then
    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv \
      -lms 50 > "$LOGS/clocks.csv" 2>&1 &
    smi=$!
  fi
  STEP_TAIL=40 step bench "${BENCH_S:-150}" "$B" ${BENCH_ARGS:-} --csv "$CSV/attention.csv"
  [ "${BENCH_MODEL_ARGS-x}" = "" ] || STEP_TAIL=12 step bench_model 90 "$B" \
    ${BENCH_MODEL_ARGS:---inputs model --seq 32768,131072 --patterns dense,vs,bs,vsa90 --reps 3} --csv "$CSV/attention_model.csv"
  [ "${BENCH_SHORT:-0}" = 1 ] && STEP_TAIL=12 step bench_short 40 "$B" --seq 1024,2048,4096 --patterns dense,vs,bs \
    --kernel auto --csv "$CSV/attention_short.csv"
  [ -n "$smi" ] && kill "$smi"
  [ "${SDPA:-0}" = 1 ] && step sdpa 90 python3 "$ROOT/bench/gpu/sdpa_reference.py" ${SDPA_ARGS:-} --csv "$CSV/sdpa.csv"
  return 0
}

# ttft_bench (the GPU engine, Llama-3-8B shapes, random weights): TTFT_ARGS (default 128K, 32K, 8K, best of 2), then
# --weights local (VS at a realistic index density; TTFT_LOCAL_ARGS), the transformers + SDPA reference (HF=1) and
# `tessera bench --device cuda` on the real SmolLM2 when build/models holds it.
phase_ttft() {
  need ttft_bench tessera || return 1
  local T
  T=$(bin ttft_bench)
  STEP_TAIL=20 step ttft "${TTFT_S:-230}" "$T" ${TTFT_ARGS:---seq 131072,32768,8192 --reps 2} --csv "$CSV/ttft.csv" \
    --max-seconds $(($(left) - 60))
  [ "${TTFT_LOCAL_ARGS-x}" = "" ] || STEP_TAIL=6 step ttft_local 120 "$T" --weights local \
    ${TTFT_LOCAL_ARGS:---seq 131072 --reps 1} --csv "$CSV/ttft_local.csv" --policies \
    "dense;vs:v=1000,s=6096;trianglemix:start=16,inner=vs,v=1000,s=6096,sink=64,local=512,last=64;vs_adaptive:gamma=0.9"
  [ "${HF:-0}" = 1 ] && STEP_TAIL=12 step hf 150 python3 "$ROOT/bench/gpu/hf_ttft_reference.py" ${HF_ARGS:-} \
    --csv "$CSV/hf_ttft.csv"
  models
  local m=$ROOT/build/models/smollm2-135m-instruct-q4_1.gguf
  if [ -f "$m" ]; then
    STEP_TAIL=12 step cli 90 "$(bin tessera)" bench -m "$m" --device cuda -d 1024,4096 --decode 8 \
      --attn "trianglemix;ashape:sink=64,local=1024"
  fi
  return 0
}

# The batched engine: batch_gpu_test, then decode_bench (DECODE_ARGS: contexts, batches, KV budget; MOA_PLAN adds
# --moa-plan), then HF=1 transformers' decode on the same shapes (bench/gpu/hf_decode_reference.py, HF_DECODE_ARGS).
phase_decode() {
  need batch_gpu_test decode_bench || return 1
  models
  STEP_TAIL=8 step batch_test 300 "$(bin batch_gpu_test)"
  STEP_TAIL=30 step decode "${DECODE_S:-240}" "$(bin decode_bench)" \
    ${DECODE_ARGS:---ctx 8192,32768,131072 --batch 1,8,32 --kv-gb 40 --steps 20} \
    ${MOA_PLAN:+--moa-plan "$MOA_PLAN"} --csv "$CSV/decode.csv"
  [ "${HF:-0}" = 1 ] && STEP_TAIL=12 step hf_decode 300 python3 "$ROOT/bench/gpu/hf_decode_reference.py" \
    ${HF_DECODE_ARGS:---ctx 8192,32768,131072 --batch 1,2,8 --steps 16} --csv "$CSV/hf_decode.csv"
  return 0
}

# The Python module: built with the CUDA backend (build/py-cuda), its CUDA tests (PYTEST_ALL=1: all of tests/python),
# the ops against the C++ bench (binding overhead; OPS_SEQ) and a patched transformers Llama-3-8B-shaped model's TTFT
# against SDPA (TTFT_SEQ, TTFT_ATTN; SKIP_PY_TTFT=1 skips), through scripts/gpu/python_bench.py.
phase_python() {
  local P=$ROOT/build/py-cuda
  py_build() {
    cmake -S "$SRC" -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTESSERA_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a \
      -DTESSERA_PYTHON=ON -DTESSERA_BUILD_TESTS=OFF -DTESSERA_BUILD_BENCH=ON -DPython_EXECUTABLE="$(command -v python3)" \
      $TESSERA_DEPS_CMAKE_ARGS && cmake --build "$1" -j "$JOBS" --target _tessera attention_gpu_bench &&
      PYTHONPATH=$1/python python3 -c "import tessera; assert tessera.built_with_cuda; print(tessera._tessera.__file__)"
  }
  touch_sources "$SRC/src" "$SRC/tests" "$SRC/bench"
  step py_build 400 py_build "$P" || return 1
  export PYTHONPATH=$P/python
  local tests=tests/python/test_cuda.py
  [ "${PYTEST_ALL:-0}" = 1 ] && tests=tests/python
  STEP_TAIL=8 step pytest 150 env TESSERA_ALLOW_MISSING_MODELS=1 python3 -m pytest -q -p no:cacheprovider "$SRC/$tests" -rs
  STEP_TAIL=4 step ops_cpp 90 "$P/bench/gpu/attention_gpu_bench" --seq "${OPS_SEQ:-32768,131072}" \
    --patterns dense,ashape,triangle,vs,bs --inputs random --kernel auto --reps 5 --csv "$CSV/ops_cpp.csv"
  STEP_TAIL=16 step ops 120 python3 scripts/gpu/python_bench.py ops --seq "${OPS_SEQ:-32768,131072}" \
    --cpp-csv "$CSV/ops_cpp.csv" --md "$LOGS/ops.md" --csv "$CSV/ops_python.csv"
  [ "${SKIP_PY_TTFT:-0}" = 1 ] || STEP_TAIL=10 step py_ttft 300 python3 scripts/gpu/python_bench.py ttft \
    --seq "${TTFT_SEQ:-32768,131072}" --attn "${TTFT_ATTN:-dense,vs,trianglemix}" --layers 0 --reps 2 \
    --md "$LOGS/py_ttft.md" --csv "$CSV/py_ttft.csv"
  return 0
}

# The planners on the GPU: plan_gradients_gpu_test (GPU against the CPU on the tiny models), then
# plan_gradients_bench (PLAN_ARGS, default 8K, 32 layers f32 and TF32, one layer on the CPU) and, with MINFERENCE=1,
# MInference's search forward.
phase_plan() {
  need plan_gradients_gpu_test plan_gradients_bench || return 1
  STEP_TAIL=10 step plan_test 240 "$(bin plan_gradients_gpu_test)"
  STEP_TAIL=20 step plan_bench 300 "$(bin plan_gradients_bench)" ${PLAN_ARGS:---seq 8192 --reps 2 --cpu-layers 1}
  [ "${MINFERENCE:-0}" = 1 ] && STEP_TAIL=20 step plan_minference 300 "$(bin plan_gradients_bench)" --minference \
    ${MINFERENCE_ARGS:---seq 8192 --reps 2 --cpu-layers 1}
  return 0
}

# Adaptive budgets (vs_adaptive, bs_adaptive): their GPU tests, racecheck / memcheck on one case each, the bench.
phase_adaptive() {
  need attention_gpu_test attention_gpu_bench || return 1
  local T
  T=$(bin attention_gpu_test)
  STEP_TAIL=6 step adaptive_test 240 "$T" --gtest_filter='*Adaptive*:*vs_adaptive*:*bs_adaptive*:DeviceLoweringOnHost*'
  local tool
  for tool in racecheck memcheck; do
    STEP_TAIL=2 step "adaptive_$tool" 120 compute-sanitizer --tool "$tool" --error-exitcode 3 "$T" \
      --gtest_filter='*DeviceEstimateTest.AdaptiveVerticalSlashReachesGammaMinimally/s1000_d128_bf16:*DeviceEstimateTest.AdaptiveBlockSparseReachesGammaMinimally/s1000_d128_bf16'
  done
  STEP_TAIL=20 step adaptive_bench 300 "$(bin attention_gpu_bench)" --seq 32768,131072 \
    --patterns dense,vs,bs,vsa90,vsa95,bsa90,bsa95 --inputs model --reps 5 --kernel auto --csv "$CSV/adaptive.csv"
}

# The accuracy runs on the GPU engine (docs/accuracy/<name>-gpu): EVAL_MODEL (a file under build/models), the needle
# grid at EVAL_LENGTHS (SAMPLES per cell), the six RULER tasks at EVAL_TASK_LENGTHS (e.g. 4096,16384; unset: none),
# the policies of scripts/eval_accuracy.sh; report.md comes back in logs.tgz.
phase_eval() {
  need tessera || return 1
  models
  local m=$ROOT/build/models/${EVAL_MODEL:-smollm2-135m-instruct-q4_1.gguf} d=$WORK/eval
  [ -f "$m" ] || { say "eval: no $m (carry it: run.sh parts)"; return 1; }
  local P="vs:v=256,s=1024;bs:top_k=16;ashape:sink=64,local=1024;triangle:sink=64,local=1024,last=64;trianglemix;moa:alpha=512,beta=0.25,sink=64"
  STEP_TAIL=4 step eval_niah "$(left)" "$(bin tessera)" eval -m "$m" --device cuda --haystack "${HAYSTACK:-kjv}" \
    --tasks niah_single --lengths "${EVAL_LENGTHS:-4096,8192}" --depths 0,25,50,75,100 --samples "${SAMPLES:-1}" \
    --attn "$P" -o "$d" --resume
  [ -n "${EVAL_TASK_LENGTHS:-}" ] && STEP_TAIL=4 step eval_tasks "$(left)" "$(bin tessera)" eval -m "$m" --device cuda \
    --haystack "${HAYSTACK:-kjv}" --tasks niah_multikey,niah_multivalue,passkey,variable_tracking,common_words,frequent_words \
    --lengths "$EVAL_TASK_LENGTHS" --depths 50 --attn "$P" -o "$d" --resume
  cp "$d/report.md" "$LOGS/eval_report.md" 2> /dev/null; cp "$d/results.json" "$LOGS/eval_results.json" 2> /dev/null
}

# Nsight Compute on attention_gpu_bench (PROFILE_ARGS, default VS and BS, model inputs, 128K, one rep):
#   PROFILE=times     GPU time of every kernel launched, summed per kernel name (default)
#   PROFILE=details   the full set of sections of the first Hopper-kernel launch after its self-check (PROFILE_KERNEL)
#   PROFILE=nsys      Nsight Systems over NSYS_CMD (default: batch_step_bench on SmolLM2, a 6,000-token prompt in
#                     512-token steps beside 8 decoders, mixed step on): the CUDA API calls' host time and the
#                     kernels' GPU time summed per name (what of a prefill chunk is host work, what GPU work)
phase_profile() {
  [ -n "${NCU_CMD:-}" ] && models
  if [ "${PROFILE:-times}" = nsys ]; then
    local nsys cmd
    nsys=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2> /dev/null | head -1)
    [ -n "$nsys" ] || { say "profile: no nsys"; return 1; }
    need batch_step_bench || return 1
    models
    cmd=${NSYS_CMD:-$(bin batch_step_bench) $ROOT/build/models/smollm2-135m-instruct-q4_1.gguf --device cuda --decoders 8 --long 6000 --budgets 512 --mixed on}
    STEP_TAIL=30 step nsys_run 240 "$nsys" profile --force-overwrite true -o "$LOGS/chunk" --trace cuda,osrt \
      --sample none --cpuctxsw none $cmd
    STEP_TAIL=80 step nsys_stats 120 "$nsys" stats --force-export true --report cuda_api_sum,cuda_gpu_kern_sum \
      --format table "$LOGS/chunk.nsys-rep"
    rm -f "$LOGS"/chunk.nsys-rep "$LOGS"/chunk.sqlite
    return
  fi
  [ -n "${NCU_CMD:-}" ] || need attention_gpu_bench || return 1
  local ncu B args
  ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2> /dev/null | head -1)
  [ -n "$ncu" ] || { say "profile: no ncu"; return 1; }
  B=$(bin attention_gpu_bench)
  args=${PROFILE_ARGS:---inputs model --seq 131072 --patterns vs,bs --reps 1 --warmup 0 --kernel auto}
  if [ "${PROFILE:-times}" = details ]; then
    STEP_TAIL=60 step ncu_details 300 "$ncu" --kernel-name "${PROFILE_KERNEL:-regex:hopper_prefill}" --launch-skip 1 \
      --launch-count 1 --set full --import-source no --page details --print-units base "$B" $args
    return
  fi
  # NCU_CMD: another program to profile (e.g. batch_step_bench's mixed steps), instead of attention_gpu_bench
  STEP_TAIL=0 step ncu_times 300 "$ncu" --metrics gpu__time_duration.sum --csv --page raw --print-units base \
    ${NCU_CMD:-"$B" $args}
  python3 - "$LOGS/ncu_times.log" << 'PY' | tee -a "$SUMMARY"
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1])))
start = next((i for i, r in enumerate(rows) if r and r[0] == "ID"), None)
if start is None:
    sys.exit("profile: no ncu table")
hdr = rows[start]
ix = {h: i for i, h in enumerate(hdr)}
tot = collections.OrderedDict()
for r in rows[start + 1:]:
    if len(r) != len(hdr):
        continue
    try:
        t = float(r[ix["gpu__time_duration.sum"]].replace(",", ""))
    except ValueError:
        continue
    full, depth, base = r[ix.get("Kernel Name", 4)].split("(")[0], 0, ""
    for ch in full:
        depth += ch == "<"
        base += ch if depth == 0 else ""
        depth -= ch == ">"
    name = base.replace("void ", "").split("::")[-1].strip()
    n, s = tot.get(name, (0, 0.0))
    tot[name] = (n + 1, s + t)
total = sum(s for _, s in tot.values()) or 1.0
for name, (n, s) in tot.items():
    print(f"{name[:60]:60s} {n:6d} launches {s / 1e3:12.1f} us {s / total * 100:6.1f}%")
PY
}
