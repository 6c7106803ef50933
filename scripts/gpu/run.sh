#!/usr/bin/env bash
# scripts/gpu/run.sh PHASE... — everything tessera runs on a lent GPU machine, in one device call: the phases run in
# the order given, within one time budget (RUN_BUDGET_S, default 540 s for a 600 s call; a step that would pass it
# is cut, later ones are skipped), each step's log in build/gpu-run/logs, one line per step in $OUT/summary.txt,
# every log and CSV in $OUT/logs.tgz (and the CSVs themselves when there are at most 6). A failing step does not
# stop the later ones; the exit code is 1 if any step failed.
#
# Here (Debian 12, which reaches Debian's registry), before the call:
#   bash scripts/gpu/run.sh download        the Debian packages the GPU image lacks (build/gpu-debs, ~19 MB): carry
#                                           ["build/gpu-debs"] with every call (scripts/gpu/deps.sh says which)
#   bash scripts/gpu/run.sh parts MODEL...  a model too big for one call's 64 MiB carry, split into parts of <= 40 MB
#                                           (build/parts-<name>-<i>, one carry each, calls to the same warm machine;
#                                           joined and checked there), and the KJV haystack (build/kjv)
#   bash scripts/gpu/run.sh old COMMIT      that commit's tree in build/old-src (compare, recipe); `new COMMIT`: the
#                                           new side from a commit (build/new-src) rather than the working tree (for
#                                           every phase with SRC=build/new-src: other work in progress stays out)
#   bash scripts/gpu/run.sh tp-data         MInference's and MoA's Llama-3-8B configs in build/tp-data (tp)
#   bash scripts/gpu/run.sh bins TARGET...  binaries built here (`cmake --preset cuda-ci && ninja -C build/cuda-ci
#                                           TARGET...`; BINS_FROM overrides the folder), stripped, into build/gpu-bin
#                                           with the libraries they link that the image lacks (CBC): carry it, and
#                                           the phases use them instead of building (no device time for a build)
#
# Phases (on the device; variables in the phase's comment in scripts/gpu/phases_*.sh):
#   env        nvidia-smi, nvcc, compilers, torch, NCCL, what was carried
#   build      configure build/cuda (cuda preset, warnings as errors) and build cuda_all (BUILD_TARGETS); the kernels'
#              ptxas resources (fails on wgmma serialisation); the Hopper kernel's self-check
#   test       ctest -L gpu: the attention backend and the GPU engine against the CPU references
#   sanitize   compute-sanitizer racecheck / memcheck / synccheck on small cases (MEMCHECK_ALL=1: the whole suite)
#   check      env build test bench sanitize (what scripts/gpu/check.sh was)
#   bench      attention_gpu_bench: one layer, RoPE inputs 8K-128K (BENCH_ARGS), model inputs (BENCH_MODEL_ARGS)
#   ttft       ttft_bench: time to first token, Llama-3-8B shapes, plain and local weights; HF=1: transformers
#   decode     batch_gpu_test, decode_bench (DECODE_ARGS); HF=1: transformers' decode
#   stream     stream_bench: STREAM=1m (128K-1M), check (device vs host decisions), ltri (scorings, 1M)
#   fp8        FP8 GEMMs: FP8_STEPS=test,bench,stream,real
#   real       the real models past their context (REAL_MODEL, REAL_STEPS=trace,serve,plan,eval)
#   tp         tensor parallelism (2+ GPUs): tp_gpu_test, tp_bench (TP_STEPS=placements,overlap,scaling,big,model)
#   serve      `tessera serve` under scripts/gpu/serve_probe.py, one GPU and --gpus 2
#   prefix     the prefix cache on a multi-turn workload (bench/server/prefix_turns.py; Gemma-3-270M at ~28K tokens)
#   itl        issue 34's latency bar: 32 clients, mixed prompt lengths, clients' ITL beside the server's own (bench/server/itl_load.sh)
#   structured structured output on the GPU engines: tests/server/test_structured.py with --device cuda (phases_structured.sh)
#   openai     OpenAI's client on the GPU engines: tests/server/test_sampling.py, test_openai_api.py (OPENAI_TESTS) with
#              --device cuda: penalties, min_p, logit_bias, logprobs, echo, n > 1 (phases_openai.sh)
#   python     the Python module with CUDA: its tests, ops against the C++ bench, patched transformers TTFT
#   plan       the planners' reverse mode and MInference's search on the GPU
#   adaptive   vs_adaptive / bs_adaptive: GPU tests, sanitizers, bench
#   eval       accuracy runs on the GPU engine (EVAL_MODEL, EVAL_LENGTHS)
#   profile    Nsight Compute: kernel times (PROFILE=times) or the Hopper kernel's details (PROFILE=details)
#   asan       the CPU suite under ASan + UBSan on the machine's cores
#   compare    an old commit beside this tree: COMPARE_STEPS=build,test,bench[,cycles], PAIRS, ROUNDS
#   recipe     compare with the decode / stream / TTFT benches (PAIRS="decode stream ttft")
#
# Examples (device calls, carry ["build/gpu-debs"] unless said):
#   bash scripts/gpu/run.sh check                                     the GPU test suite, benches and sanitizers
#   TTFT_ARGS="--seq 131072 --reps 3" bash scripts/gpu/run.sh build ttft
#   ROUNDS=3 COMPARE_STEPS=build,test,bench,cycles bash scripts/gpu/run.sh compare        carry + "build/old-src"
#   SEQS=1048576 bash scripts/gpu/run.sh build stream                 streamingllm at 1M (one GPU, no host memory)
#   STREAM=ltri HOST_BUDGET=230e9 bash scripts/gpu/run.sh stream      kind nvidia-h200-x2 (136 GB pinned at 1M)
#   TP_STEPS=placements,scaling,overlap,big,model bash scripts/gpu/run.sh build tp    kind nvidia-h200-x4, + build/tp-data
#   REAL_MODEL=gemma-3-270m-q4_k_m.gguf LENGTHS="65536 131072" DEPTHS=50 EXTRA_EVAL="--stream-index-ratio 20" \
#     bash scripts/gpu/run.sh real                                    after the calls that carried its parts
#   BUILD_DIR=build/cuda-ci PREBUILT=1 bash scripts/gpu/run.sh stream binaries built here (ninja -C build/cuda-ci
#                                                                     stream_bench stream_gpu_test) and carried
#
# What the scripts before run.sh became: check.sh -> check (BUILD_ONLY=1 -> build); compare_commits.sh build|test|
# bench|cycles -> compare with COMPARE_STEPS; recipe_check.sh -> recipe; fp8_check.sh -> fp8; stream_1m.sh -> stream;
# stream_check.sh -> STREAM=check stream; ltri_1m.sh -> STREAM=ltri stream; tp_check.sh -> tp; tp_x4.sh -> tp with
# TP_STEPS (its serve phase -> serve); smollm2_gpu.sh, gemma_gpu.sh -> parts here, then real; python_check.sh ->
# python; batch_check.sh -> decode; adaptive_check.sh -> adaptive; plan_check.sh -> plan; eval_gpu.sh -> eval;
# asan_cpu.sh -> asan; kernel_times.sh, profile_prefill.sh -> profile; prefill_limits.sh -> SAMPLE_CLOCKS=1 bench and
# PROFILE=details profile; nccl.sh, step.sh, bench_tools.sh -> lib.sh; compare_table.py -> scripts/compare_results.py.
set -uo pipefail
. "$(dirname "$0")/lib.sh"
for f in "$ROOT"/scripts/gpu/phases_*.sh; do . "$f"; done

here_parts() {  # parts MODEL...: <= PART_BYTES (default 40 MB: the tree itself is ~16 MB of a call's 64 MiB) parts,
  # one folder per carry
  local m name sum n i size
  local part=${PART_BYTES:-40000000}
  for m in "$@"; do
    name=$(basename "$m")
    sum=$(sha256sum "$m" | cut -d' ' -f1)
    size=$(stat -c %s "$m")
    n=$(((size + part - 1) / part))
    rm -rf "$ROOT"/build/parts-"$name"-*
    for ((i = 0; i < n; i++)); do
      local d=$ROOT/build/parts-$name-$i
      mkdir -p "$d"
      tail -c +$((i * part + 1)) "$m" | head -c "$part" > "$d/$name.part$(printf %02d "$i")"
      echo "$name" > "$d/name"
      echo "$n" > "$d/parts"
      echo "$sum" > "$d/sha256"
      echo "build/parts-$name-$i: $(du -h "$d/$name.part"* | cut -f1)"
    done
  done
  mkdir -p "$ROOT/build/kjv"
  [ -f /usr/lib/bible.data ] && cp /usr/lib/bible.data "$ROOT/build/kjv/" && echo "build/kjv/bible.data (the KJV haystack)"
}

here_bins() {  # bins TARGET...: stripped copies of built binaries and their CBC libraries, in build/gpu-bin
  local from=${BINS_FROM:-$ROOT/build/cuda-ci} t f so path
  mkdir -p "$ROOT/build/gpu-bin/lib"
  for t in "$@"; do
    f=$(find "$from" -name "$t" -type f -perm -u+x | head -1)
    [ -n "$f" ] || { echo "bins: no $t in $from"; return 1; }
    cp "$f" "$ROOT/build/gpu-bin/$t" && strip "$ROOT/build/gpu-bin/$t"
    ldd "$f" | awk '$3 ~ /^\// {print $1, $3}' | while read -r so path; do
      case $so in libCbc* | libCgl* | libOsi* | libClp* | libCoinUtils* | libbz2* | liblapack* | libcpp-httplib* | libopenblas* | libgfortran* | libquadmath* | libbrotli* | libpcre2*) cp -L "$path" "$ROOT/build/gpu-bin/lib/$so" ;; esac
    done
  done
  du -sh "$ROOT/build/gpu-bin"
}

here_tree() {  # old|new COMMIT: git archive into build/old-src or build/new-src
  local d=$ROOT/build/$1-src
  rm -rf "$d"
  mkdir -p "$d"
  git -C "$ROOT" archive "$2" | tar -x -C "$d" || return 1
  rm -rf "$d/docs"
  [ "$1" = old ] && rm -rf "$d/tests"
  git -C "$ROOT" rev-parse --short "$2" > "$d/.commit"
  du -sh "$d"
}

case "${1:-help}" in
  help | -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  download) exec bash "$ROOT/scripts/gpu/deps.sh" download ;;
  parts) shift; here_parts "$@"; exit ;;
  bins) shift; here_bins "$@"; exit ;;
  old | new) here_tree "$1" "$2"; exit ;;
  tp-data)
    mkdir -p "$ROOT/build/tp-data"
    cp ../shared/data/minference-configs/Llama_3_8B_Instruct_262k_kv_out_v32_fit_o_best_pattern.json \
      ../shared/data/moa-configs/Llama-3-8B-Instruct-262k_moa_alpha_beta.json "$ROOT/build/tp-data/" && du -sh "$ROOT/build/tp-data"
    exit
    ;;
esac

lib_init
deps_env || say "deps: unpacking build/gpu-debs failed (log above)"
failed=0
phases=()
for phase in "$@"; do
  if [ "$phase" = check ]; then phases+=(env build test bench sanitize); else phases+=("$phase"); fi
done
for phase in "${phases[@]}"; do
  if ! declare -F "phase_$phase" > /dev/null; then
    say "run.sh: no phase '$phase' (bash scripts/gpu/run.sh help)"
    failed=1
    continue
  fi
  say "== $phase"
  "phase_$phase" || failed=1
done
grep -qE " (FAILED|TIMEOUT)" "$SUMMARY" && failed=1
lib_finish
exit $failed
