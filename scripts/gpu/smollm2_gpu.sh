#!/usr/bin/env bash
# scripts/gpu/smollm2_gpu.sh — the real SmolLM2-135M (8K native context) on one GPU machine, in phases (PHASES,
# default trace,serve,plan,eval):
#   trace  streaming memory's retrieved blocks on the GPU path against the CPU path's on one needle prompt past the
#          context (`tessera run --stream-trace`, ltri and infllm), the answers and the last logits;
#   serve  `tessera serve --stream ltri --device cuda`: a completion past the first eviction against `tessera run`;
#   plan   `tessera plan --device cuda` for trianglemix and minference with docs/plans/make_plans.sh's arguments,
#          compared with the committed CPU plans (docs/plans/smollm2-*.json);
#   eval   needle cases past the context for ltri / infllm / streamingllm on the GPU (tessera eval).
#
# The model (98 MB) does not fit one call's carry (64 MiB with the tree), so it comes in two halves
# (`bash scripts/gpu/tp_x4.sh prepare` makes build/smol-p0, build/smol-p1 here), over three calls to a warm host:
#   1. carry ["build/gpu-debs", "build/sr-src"]:  bash scripts/gpu/smollm2_gpu.sh   (deps, configure, build tessera;
#      build/sr-src: `rm -rf build/sr-src && mkdir -p build/sr-src && git archive HEAD | tar -x -C build/sr-src`)
#   2. carry ["build/smol-p0"]:   bash scripts/gpu/smollm2_gpu.sh        (the first half; the build is incremental)
#   3. carry ["build/smol-p1"]:   bash scripts/gpu/smollm2_gpu.sh        (joins the model, then the runs)
# Environment: LENGTHS (16384,32768,65536), DEPTHS (25,50,75), METHODS (ltri,infllm,streamingllm),
# TRACE_LENGTH (16384: the CPU-vs-GPU trace comparison; 0 skips it), TRACE_METHODS (ltri,infllm),
# BUDGET_S (560). Output: $OUT/stream-real/ (summary.txt, eval reports, traces' comparison, logs).
set -u
cd "$(dirname "$0")/../.." || exit 1
ROOT=$PWD
OUTD=${OUT:-$ROOT/build/sr-out}/smollm2-gpu
WORK=$ROOT/build/sr-work
LOGS=$OUTD/logs
BUILD_DIR=$ROOT/build/sr-cuda
mkdir -p "$OUTD" "$LOGS" "$WORK"
SUMMARY=$OUTD/summary.txt
touch "$SUMMARY"
START=$(date +%s)
BUDGET=${BUDGET_S:-560}
export PATH=$PATH:/usr/local/cuda/bin

STEP_TAIL=20
. "$ROOT/scripts/gpu/step.sh"  # step NAME MAX_SECONDS command...

if [ -d build/gpu-debs ] && [ ! -f build/gpu-sysroot/deps.env ]; then step deps 90 bash scripts/gpu/deps.sh unpack; fi
TESSERA_DEPS_CMAKE_ARGS=""
[ -f build/gpu-sysroot/deps.env ] && . build/gpu-sysroot/deps.env
# Sources: build/sr-src when it was carried (`git archive HEAD` made here: the committed tree, whatever else is
# being edited in the working tree; it stays on a warm host for the later calls), else this checkout.
SRC=$ROOT
[ -f build/sr-src/CMakeLists.txt ] && SRC=$ROOT/build/sr-src
if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
  step configure 120 bash -c "cd '$SRC' && cmake --preset cuda -B '$BUILD_DIR' $TESSERA_DEPS_CMAKE_ARGS" || exit 1
fi
step build 400 cmake --build "$BUILD_DIR" -j "${JOBS:-$(nproc)}" --target tessera || exit 1
TS=$BUILD_DIR/src/tessera
nvidia-smi -L | tee -a "$SUMMARY"

MODEL=$ROOT/build/models/smollm2-135m-instruct-q4_1.gguf
if [ ! -f "$MODEL" ] && [ -f build/smol-p0/smol.00 ] && [ -f build/smol-p1/smol.01 ]; then
  mkdir -p build/models
  cat build/smol-p0/smol.00 build/smol-p1/smol.01 > "$MODEL"
  if [ "$(sha256sum "$MODEL" | cut -d' ' -f1)" != "$(cat build/smol-p1/sha256)" ]; then
    echo "model parts do not join to the recorded sha256" | tee -a "$SUMMARY"
    rm -f "$MODEL"
  fi
fi
if [ ! -f "$MODEL" ]; then
  echo "model not assembled yet (build/smol-p0: $(ls build/smol-p0 2> /dev/null | tr '\n' ' '); build/smol-p1: $(ls build/smol-p1 2> /dev/null | tr '\n' ' '))" | tee -a "$SUMMARY"
  exit 0
fi

# docs/streaming.md's sizes for the 8K model (equal memory for the three methods: at most 1,856 keys per chunk).
SIZES=(--stream-sinks 64 --stream-local 1024 --stream-block 64 --stream-top-k 8 --stream-chunk 256 --stream-last-chunk 64)
left() { echo $((BUDGET - ($(date +%s) - START) - 10)); }

# 1. The GPU path against the CPU path on one real prompt: the blocks each layer retrieved after every chunk.
PHASES=${PHASES:-trace,serve,plan,eval}
has() { case ",$PHASES," in *,$1,*) return 0 ;; esac; return 1; }
TRACE_LENGTH=${TRACE_LENGTH:-16384}
if has trace; then
  for m in $(echo "${TRACE_METHODS:-ltri,infllm}" | tr ',' ' '); do
    for dev in cuda cpu; do
      step "trace_${m}_$dev" "$(left)" "$TS" run -m "$MODEL" --device "$dev" --needle "$TRACE_LENGTH" --chat -n 16 \
        --stream "$m" "${SIZES[@]}" --stream-trace "$WORK/trace_${m}_$dev.txt" --logits-out "$WORK/logits_${m}_$dev.f32"
      grep -E "^answer:|needle|^\[stream" "$LOGS/trace_${m}_$dev.log" | sed "s/^/  $m $dev: /" >> "$SUMMARY"
    done
    if [ -f "$WORK/trace_${m}_cpu.txt" ] && [ -f "$WORK/trace_${m}_cuda.txt" ]; then
      python3 - "$WORK/trace_${m}_cpu.txt" "$WORK/trace_${m}_cuda.txt" "$WORK/logits_${m}_cpu.f32" \
        "$WORK/logits_${m}_cuda.f32" "$m" >> "$SUMMARY" 2>&1 << 'PY'
import sys, array, math
def load(p):
    out = {}
    for line in open(p):
        head, _, blocks = line.partition(":")
        out[tuple(head.split())] = frozenset(int(b) for b in blocks.split())
    return out
cpu, gpu, m = load(sys.argv[1]), load(sys.argv[2]), sys.argv[5]
keys = sorted(set(cpu) & set(gpu), key=lambda k: (k[0] != "prefill", int(k[1]), int(k[2])))
retr = [k for k in keys if cpu[k] or gpu[k]]
same = sum(cpu[k] == gpu[k] for k in retr)
jac = [len(cpu[k] & gpu[k]) / len(cpu[k] | gpu[k]) for k in retr]
first = next((k for k in retr if cpu[k] != gpu[k]), None)
print(f"  {m} trace: {len(keys)} (step, layer) records on both ({len(cpu)} cpu, {len(gpu)} gpu); {len(retr)} with "
      f"retrieval; identical block sets {same}/{len(retr)}; mean Jaccard {sum(jac) / max(1, len(jac)):.4f}; "
      f"first difference {first}")
try:
    a = array.array("f"); a.frombytes(open(sys.argv[3], "rb").read())
    b = array.array("f"); b.frombytes(open(sys.argv[4], "rb").read())
    num = math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b))); den = math.sqrt(sum(x * x for x in a))
    print(f"  {m} last logits: relative L2 {num / den:.3e}; argmax cpu {max(range(len(a)), key=a.__getitem__)} "
          f"gpu {max(range(len(b)), key=b.__getitem__)}")
except Exception as e:  # noqa: BLE001
    print(f"  {m} logits: {e}")
PY
    fi
  done
fi

# 2. serve --stream on the GPU: a completion past the first eviction equals `tessera run --stream` on the GPU.
if has serve; then
  python3 -c "print('The quick brown fox jumps over the lazy dog. ' * 300 + 'How many times did the fox jump? Answer:', end='')" > "$WORK/serve_prompt.txt"
  step serve_run 120 "$TS" run -m "$MODEL" --device cuda -p "$(cat "$WORK/serve_prompt.txt")" -n 16 --stream ltri "${SIZES[@]}"
  "$TS" serve -m "$MODEL" --device cuda --port 18093 --stream ltri "${SIZES[@]}" > "$LOGS/serve.log" 2>&1 &
  SERVE_PID=$!
  step serve_request 120 python3 - "$WORK/serve_prompt.txt" "$LOGS/serve_run.log" << 'PY'
import json, re, sys, time, urllib.request
prompt = open(sys.argv[1]).read()
out = open(sys.argv[2]).read()
want = out[out.index("answer: ") + len("answer: "):re.search(r"\n\[[^\]]+\] prefill ", out).start()]
for _ in range(120):
    try:
        models = json.loads(urllib.request.urlopen("http://127.0.0.1:18093/v1/models", timeout=5).read())
        break
    except Exception:  # noqa: BLE001 - not listening yet
        time.sleep(1)
mid = models["data"][0]["id"]
req = urllib.request.Request("http://127.0.0.1:18093/v1/completions",
                             json.dumps({"model": mid, "prompt": prompt, "max_tokens": 16, "temperature": 0}).encode(),
                             {"Content-Type": "application/json"})
r = json.loads(urllib.request.urlopen(req, timeout=120).read())
got = r["choices"][0]["text"]
print(f"serve --stream ltri on the GPU: context_length {models['data'][0]['context_length']}, prompt "
      f"{r['usage']['prompt_tokens']} tokens; answer {got!r}; tessera run --stream: {want!r}; equal: {got == want}")
sys.exit(0 if got == want else 1)
PY
  grep "equal:" "$LOGS/serve_request.log" | sed 's/^/  /' >> "$SUMMARY"
  kill -TERM "$SERVE_PID" 2> /dev/null
  wait "$SERVE_PID"
  echo "  serve exit $?: $(grep -E 'listening|POST' "$LOGS/serve.log" | tr '\n' ' ' | cut -c1-400)" >> "$SUMMARY"
fi

# 3. Plans on the GPU against the committed CPU plans (the same arguments as docs/plans/make_plans.sh).
if has plan; then
  mkdir -p "$OUTD/plans"
  TIMEV=""
  [ -x /usr/bin/time ] && TIMEV="/usr/bin/time -v"
  for method in trianglemix minference; do
    case $method in
      trianglemix) args=(--lengths 1024,2048 --samples 2) ;;
      minference) args=(--lengths 2048 --samples 2 --budget 0.3) ;;
    esac
    step "plan_$method" "$(left)" $TIMEV "$TS" plan --method "$method" -m "$MODEL" "${args[@]}" --device cuda \
      --report-lengths 4096,16384,65536 -o "$OUTD/plans/smollm2-$method.json"
    grep -E "Elapsed|Maximum resident" "$LOGS/plan_$method.log" | sed "s/^\s*/  plan $method: /" >> "$SUMMARY"
    [ -f "$OUTD/plans/smollm2-$method.json" ] && python3 - "docs/plans/smollm2-$method.json" \
      "$OUTD/plans/smollm2-$method.json" "$method" >> "$SUMMARY" 2>&1 << 'PY'
import json, sys
cpu, gpu, method = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])), sys.argv[3]
if method == "trianglemix":
    print(f"  plan trianglemix: start layer cpu {cpu['trianglemix']['start_layer']} gpu {gpu['trianglemix']['start_layer']}")
else:
    def head(p, l, h):
        layer = p["layers"][l]
        return json.dumps(layer.get("heads", {}).get(str(h), layer.get("default", p.get("default"))), sort_keys=True)
    pairs = [(l, h) for l in range(cpu["num_layers"]) for h in range(cpu["num_q_heads"])]
    same = sum(head(cpu, l, h) == head(gpu, l, h) for l, h in pairs)
    print(f"  plan minference: {same}/{len(pairs)} heads chose the same pattern on the GPU as the committed CPU plan")
PY
  done
fi

# 4. Needle cases past the context on the GPU (tessera eval: RULER's niah_single, the chat template, greedy).
if has eval; then
for L in $(echo "${LENGTHS:-16384,32768,65536}" | tr ',' ' '); do
  step "eval_$L" "$(left)" "$TS" eval -m "$MODEL" --tasks niah_single -l "$L" --depths "${DEPTHS:-25,50,75}" \
    --attn dense --stream "${METHODS:-ltri,infllm,streamingllm}" "${SIZES[@]}" --answer-tokens 16 --device cuda \
    -o "$OUTD/eval_$L"
  grep -iE "pass|fail|stream:" "$LOGS/eval_$L.log" | tail -n 20 | sed "s/^/  $L: /" >> "$SUMMARY"
done
fi
echo "total $(($(date +%s) - START))s" | tee -a "$SUMMARY"
