# shellcheck shell=bash disable=SC2086
# scripts/gpu/phases_stream.sh — streaming memory, FP8 GEMMs and the real models on the GPU (phases of run.sh).

has_step() { case ",$1," in *,"$2",*) return 0 ;; esac; return 1; }

# stream_bench NAME TIME_S ARGS...: one stream_bench run (Llama-3-8B shapes, random weights) into $CSV/NAME.csv, with
# the host's memory sampled every 5 s (pinned blocks show as MemAvailable falling).
stream_bench_run() {
  local name=$1 t=$2 sampler
  shift 2
  (while sleep 5; do echo "$(date +%s) $(grep -E 'MemTotal|MemAvailable' /proc/meminfo | tr -s ' ' | tr '\n' ' ')"; done) \
    > "$LOGS/$name.host_mem.txt" 2>&1 &
  sampler=$!
  STEP_TAIL=14 step "$name" "$t" "$(bin stream_bench)" --max-seconds $((t - 30)) --csv "$CSV/$name.csv" "$@"
  kill "$sampler" 2> /dev/null
}

# STREAM=1m (default): streamingllm from 128K to 1M beside the dense engine at 128K (SEQS, METHODS, CHUNK 2048,
#   DENSE, DECODE, HOST_BUDGET, GEMM, EXTRA, STREAM_TAG: the CSV's name; methods with "-fp8" or "-copy" suffixes as stream_bench takes them; ltri /
#   infllm rows up to LTRI_MAX). 1M streamingllm needs no host memory; ltri / infllm past ~512K need the 2-GPU
#   kind's 256 GiB (only GPU 0 is used).
# STREAM=check: stream_gpu_test, then ltri / infllm deciding on the device beside the host-decision baseline
#   (ltri-host, infllm-host up to HOST_MAX) and streamingllm, chunk 512 (SEQS 8192,32768,131072, DEVICE_MAX;
#   HEADS=N: a synthetic retrieval-heads file, query head 0 of N layers).
# STREAM=ltri: stream_decide_test and stream_gpu_test with each scoring (fused, gemm), then Ltri's scorings side by
#   side at CMP_SEQ (131072) with and without Ltri-LLM's retrieval heads (docs/streaming/ltri-llm-retrieval-heads.txt,
#   a stand-in on random weights), then ltri at 1M with them (LTRI_STEPS=tests,cmp,1m).
phase_stream() {
  need stream_bench stream_gpu_test || return 1
  export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
  local heads=$ROOT/docs/streaming/ltri-llm-retrieval-heads.txt
  case ${STREAM:-1m} in
    1m)
      stream_bench_run "${STREAM_TAG:-stream_1m}" "${STREAM_S:-330}" --seq "${SEQS:-131072,262144,524288,1048576}" \
        --methods "${METHODS:-streamingllm}" --method-max-seq "ltri=${LTRI_MAX:-32768},infllm=${LTRI_MAX:-32768},dense-fp8=131072" \
        --dense "${DENSE:-131072}" --decode "${DECODE:-16}" --chunk "${CHUNK:-2048}" --host-budget "${HOST_BUDGET:-100e9}" \
        --prepin ${GEMM:+--gemm "$GEMM"} ${EXTRA:-}
      ;;
    check)
      STEP_TAIL=10 step stream_test "${TEST_S:-150}" "$(bin stream_gpu_test)"
      local hargs=()
      if [ -n "${HEADS:-}" ]; then
        for ((l = 0; l < HEADS; ++l)); do echo "$l 0 0.5"; done > "$WORK/retrieval-heads.txt"
        hargs=(--retrieval-heads "$WORK/retrieval-heads.txt")
      fi
      stream_bench_run stream_check "${STREAM_S:-240}" "${hargs[@]}" --seq "${SEQS:-8192,32768,131072}" \
        --methods "${METHODS:-streamingllm,infllm,ltri,infllm-host,ltri-host}" \
        --method-max-seq "ltri=${DEVICE_MAX:-131072},infllm=${DEVICE_MAX:-131072},ltri-host=${HOST_MAX:-8192},infllm-host=${HOST_MAX:-8192}" \
        --dense "${DENSE:-131072}" --decode "${DECODE:-16}" --chunk "${CHUNK:-512}" --host-budget 100e9 --prepin
      ;;
    ltri)
      need stream_decide_test || return 1
      local s
      if has_step "${LTRI_STEPS:-tests,cmp,1m}" tests; then
        STEP_TAIL=6 step ltri_decide_test 120 "$(bin stream_decide_test)"
        for s in fused gemm; do
          STEP_TAIL=6 step "ltri_stream_test_$s" 150 env TESSERA_LTRI_SCORING=$s "$(bin stream_gpu_test)"
        done
      fi
      if has_step "${LTRI_STEPS:-tests,cmp,1m}" cmp; then
        stream_bench_run ltri_cmpheads 200 --seq "${CMP_SEQ:-131072}" --methods "${CMP_METHODS:-ltri-gemm,ltri-fused}" \
          --dense 0 --decode 8 --chunk 512 --host-budget "${HOST_BUDGET:-100e9}" --prepin --retrieval-heads "$heads"
        stream_bench_run ltri_cmp 200 --seq "${CMP_SEQ:-131072}" --methods "${CMP_METHODS:-ltri-gemm,ltri-fused}" \
          --dense 0 --decode 8 --chunk 512 --host-budget "${HOST_BUDGET:-100e9}" --prepin
      fi
      has_step "${LTRI_STEPS:-tests,cmp,1m}" 1m && stream_bench_run ltri_1m "$(left)" --seq 1048576 --methods ltri \
        --dense 0 --decode 8 --chunk 512 --host-budget "${HOST_BUDGET:-230e9}" --prepin --retrieval-heads "$heads"
      ;;
    *) say "stream: STREAM=$STREAM is not one of 1m, check, ltri"; return 2 ;;
  esac
  return 0
}

# FP8 GEMMs (--gemm fp8): FP8_STEPS=test,bench (default), stream, real
#   test    fp8_gemm_test (quantisation equal to the host's, products against the host reference, logits vs bf16)
#   bench   its throughput case: the Llama-3-8B layer GEMMs at m = 2048, bf16 vs FP8 per tensor / per row
#   stream  stream_bench at 128K (dense and streamingllm, bf16 and FP8) and, with ONE_M=1, streamingllm at 1M
#   real    the real SmolLM2 (build/models): perplexity (PPL_LENGTHS) and niah_single, bf16 vs FP8 per row / tensor
phase_fp8() {
  local steps=${FP8_STEPS:-test,bench} T
  export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
  if has_step "$steps" test || has_step "$steps" bench; then
    need fp8_gemm_test || return 1
    T=$(bin fp8_gemm_test)
    has_step "$steps" test && STEP_TAIL=10 step fp8_test 150 env CUBLASLT_LOG_MASK=13 "$T"
    has_step "$steps" bench && STEP_TAIL=16 step fp8_bench 60 env TESSERA_FP8_BENCH=1 "$T" --gtest_filter='*Throughput*'
  fi
  if has_step "$steps" stream; then
    need stream_bench || return 1
    stream_bench_run fp8_128k 150 --seq 131072 --methods streamingllm,streamingllm-fp8,dense-fp8 --dense 131072 \
      --decode 16 --chunk 2048 --prepin
    [ "${ONE_M:-0}" = 1 ] && stream_bench_run fp8_1m 200 --seq 1048576 --methods streamingllm-fp8,streamingllm \
      --dense 0 --decode 16 --chunk 2048 --prepin
  fi
  if has_step "$steps" real; then
    need tessera || return 1
    models
    local m=$ROOT/build/models/smollm2-135m-instruct-q4_1.gguf v gemm
    [ -f "$m" ] || { say "fp8 real: no $m (carry it: run.sh parts)"; return 1; }
    for v in bf16 fp8 fp8-tensor; do
      gemm=${v%-tensor}
      STEP_TAIL=3 step "fp8_ppl_$v" 150 env TESSERA_FP8_SCALING="$([ "$v" = fp8-tensor ] && echo tensor || echo row)" \
        "$(bin tessera)" eval -m "$m" --device cuda --gemm "$gemm" --tasks none --perplexity "${PPL_LENGTHS:-2048,8192}" \
        --haystack kjv --attn dense -o "$WORK/ppl_$v"
      STEP_TAIL=3 step "fp8_niah_$v" 150 env TESSERA_FP8_SCALING="$([ "$v" = fp8-tensor ] && echo tensor || echo row)" \
        "$(bin tessera)" eval -m "$m" --device cuda --gemm "$gemm" --tasks niah_single -l 4096,8192 --depths 10,50,90 \
        --samples 2 --attn dense --answer-tokens 16 -o "$WORK/niah_$v"
    done
  fi
  return 0
}

# The real models on the GPU (build/models, carried in parts: `run.sh parts MODEL` here), streaming past their
# context; REAL_MODEL (default smollm2-135m-instruct-q4_1.gguf), REAL_STEPS=trace,serve,plan,eval:
#   trace  the blocks retrieved on the GPU path against the CPU path's on one needle prompt (--stream-trace; ltri and
#          infllm at TRACE_LENGTH, 16384), identical block sets, mean Jaccard, last logits' relative L2 and argmax
#   serve  `tessera serve --stream ltri --device cuda`: a long completion equal to `tessera run --stream ltri`'s
#   plan   `tessera plan --device cuda` for trianglemix and minference against the committed CPU plans (SmolLM2)
#   eval   niah_single past the context for ltri / infllm / streamingllm (LENGTHS, DEPTHS; EXTRA_EVAL, e.g.
#          "--stream-index-ratio 20" for Gemma-3-270M)
phase_real() {
  need tessera || return 1
  models
  local m=$ROOT/build/models/${REAL_MODEL:-smollm2-135m-instruct-q4_1.gguf} TS steps=${REAL_STEPS:-trace,serve,plan,eval}
  [ -f "$m" ] || { say "real: no $m yet"; return 0; }
  TS=$(bin tessera)
  local sizes="--stream-sinks 64 --stream-local 1024 --stream-block 64 --stream-top-k 8 --stream-chunk 256 --stream-last-chunk 64"
  if has_step "$steps" trace; then
    local meth dev
    for meth in ${TRACE_METHODS:-ltri infllm}; do
      for dev in cuda cpu; do
        STEP_TAIL=4 step "trace_${meth}_$dev" "$(left)" "$TS" run -m "$m" --device "$dev" --needle "${TRACE_LENGTH:-16384}" \
          --chat -n 16 --stream "$meth" $sizes --stream-trace "$WORK/trace_${meth}_$dev.txt" \
          --logits-out "$WORK/logits_${meth}_$dev.f32"
      done
      python3 - "$WORK/trace_${meth}_cpu.txt" "$WORK/trace_${meth}_cuda.txt" "$WORK/logits_${meth}_cpu.f32" \
        "$WORK/logits_${meth}_cuda.f32" "$meth" << 'PY' 2>&1 | tee -a "$SUMMARY"
import sys, array, math
def load(p):
    out = {}
    for line in open(p):
        head, _, blocks = line.partition(":")
        out[tuple(head.split())] = frozenset(int(b) for b in blocks.split())
    return out
try:
    cpu, gpu = load(sys.argv[1]), load(sys.argv[2])
except OSError as e:
    sys.exit(f"  {sys.argv[5]} trace: {e}")
keys = [k for k in set(cpu) & set(gpu) if cpu[k] or gpu[k]]
same = sum(cpu[k] == gpu[k] for k in keys)
jac = [len(cpu[k] & gpu[k]) / len(cpu[k] | gpu[k]) for k in keys]
a = array.array("f"); a.frombytes(open(sys.argv[3], "rb").read())
b = array.array("f"); b.frombytes(open(sys.argv[4], "rb").read())
rel = math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b))) / math.sqrt(sum(x * x for x in a))
print(f"  {sys.argv[5]}: identical block sets {same}/{len(keys)}, mean Jaccard {sum(jac) / max(1, len(jac)):.3f}, "
      f"last logits rel L2 {rel:.2e}, argmax equal {max(range(len(a)), key=a.__getitem__) == max(range(len(b)), key=b.__getitem__)}")
PY
    done
  fi
  if has_step "$steps" serve; then
    python3 -c "print('The quick brown fox jumps over the lazy dog. ' * 300 + 'How many times did the fox jump? Answer:', end='')" \
      > "$WORK/serve_prompt.txt"
    STEP_TAIL=3 step serve_run 120 "$TS" run -m "$m" --device cuda -f "$WORK/serve_prompt.txt" -n 16 --stream ltri $sizes
    "$TS" serve -m "$m" --device cuda --port 18093 --stream ltri $sizes > "$LOGS/serve.log" 2>&1 &
    local pid=$!
    STEP_TAIL=2 step serve_request 150 python3 - "$WORK/serve_prompt.txt" "$LOGS/serve_run.log" << 'PY'
import json, re, sys, time, urllib.request
prompt, out = open(sys.argv[1]).read(), open(sys.argv[2]).read()
want = out[out.index("answer: ") + len("answer: "):re.search(r"\n\[[^\]]+\] prefill ", out).start()]
for _ in range(120):
    try:
        models = json.loads(urllib.request.urlopen("http://127.0.0.1:18093/v1/models", timeout=5).read())
        break
    except Exception:  # noqa: BLE001 - not listening yet
        time.sleep(1)
req = urllib.request.Request("http://127.0.0.1:18093/v1/completions", json.dumps(
    {"model": models["data"][0]["id"], "prompt": prompt, "max_tokens": 16, "temperature": 0}).encode(),
    {"Content-Type": "application/json"})
got = json.loads(urllib.request.urlopen(req, timeout=120).read())["choices"][0]["text"]
print(f"serve --stream ltri on the GPU: {got!r}; tessera run: {want!r}; equal: {got == want}")
sys.exit(0 if got == want else 1)
PY
    kill -TERM "$pid" 2> /dev/null
    wait "$pid"
  fi
  if has_step "$steps" plan && [ "${REAL_MODEL:-smollm2-135m-instruct-q4_1.gguf}" = smollm2-135m-instruct-q4_1.gguf ]; then
    STEP_TAIL=3 step plan_trianglemix "$(left)" "$TS" plan --method trianglemix -m "$m" --lengths 1024,2048 --samples 2 \
      --device cuda -o "$WORK/smollm2-trianglemix.json"
    STEP_TAIL=3 step plan_minference "$(left)" "$TS" plan --method minference -m "$m" --lengths 2048 --samples 2 \
      --budget 0.3 --device cuda -o "$WORK/smollm2-minference.json"
    python3 - docs/plans/smollm2-trianglemix.json "$WORK/smollm2-trianglemix.json" << 'PY' 2>&1 | tee -a "$SUMMARY"
import json, sys
cpu, gpu = (json.load(open(p)) for p in sys.argv[1:3])
print(f"  plan trianglemix: start layer cpu {cpu['trianglemix']['start_layer']} gpu {gpu['trianglemix']['start_layer']}")
PY
  fi
  if has_step "$steps" eval; then
    local L
    for L in ${LENGTHS:-16384 32768}; do
      STEP_TAIL=8 step "eval_$L" "$(left)" "$TS" eval -m "$m" --tasks niah_single -l "$L" --depths "${DEPTHS:-25,75}" \
        --attn dense --stream ltri,infllm,streamingllm $sizes ${EXTRA_EVAL:-} --answer-tokens 16 --device cuda \
        -o "$WORK/eval_$L"
    done
  fi
  return 0
}
