#!/usr/bin/env bash
# scripts/gpu/gemma_gpu.sh — the real Gemma-3-270M (32K native context; 5 sliding-window layers of 512 per global
# layer, QK-norm, local / global RoPE bases) streaming on one GPU machine, in phases (PHASES, default eval,trace, run
# in that order):
#   eval   needle cases past the context on the GPU (tessera eval: RULER's niah_single, greedy; a base model, so no
#          chat template) at LENGTHS for ltri / infllm / streamingllm, with docs/streaming/run.sh's sizes for Gemma
#          (--stream-index-ratio 20 as its gemma-64k run). The dense row is skipped past the context (eval's rule);
#   trace  streaming memory's retrieved blocks on the GPU path against the CPU path's on one needle prompt
#          (`tessera run --stream-trace`, TRACE_METHODS at TRACE_LENGTH tokens: the CPU does 16K on the device's 16
#          cores quickly), the answers and the last logits (relative L2, argmax). Only the global layers (every
#          sixth) retrieve: the sliding-window layers' records are empty on both.
#
# The model (253 MB) does not fit one call's carry (64 MiB with the ~12 MB tree), so it travels in five parts of
# ~51 MB (build/gemma-p0 .. build/gemma-p4, each with the whole file's sha256), joined on the device once all are
# there. Here, first:
#   bash scripts/gpu/gemma_gpu.sh prepare   the parts, and build/gemma-bin/tessera: a stripped copy of TESSERA_BIN
#                                           (default build/cuda-ci/src/tessera, built here: never built there; 18 MB)
#                                           with build/gemma-bin/lib: the libraries it links that the device lacks
#                                           (COIN-OR CBC, ~7 MB) and bible.data (the KJV haystack, 1.7 MB: the
#                                           device image lacks it; installed there as /usr/lib/bible.data);
#                                           build/gpu-debs + build/gemma-bin: ~46 MB
# Then six calls to one warm machine (carried paths stay on it between calls; no kind named):
#   1. carry ["build/gpu-debs", "build/gemma-bin"]:  bash scripts/gpu/gemma_gpu.sh   (deps, the binary's check)
#   2. carry ["build/gemma-p0"]:                     bash scripts/gpu/gemma_gpu.sh   (a part: stored, nothing run)
#   3..5. the same with build/gemma-p1, build/gemma-p2, build/gemma-p3
#   6. carry ["build/gemma-p4"]:                     bash scripts/gpu/gemma_gpu.sh   (joins, checks the sha256, runs)
# If the machine went cold in between (a fresh one has none of the earlier parts), the script says which parts it
# holds; start again at call 1. With no build/gemma-bin, the script builds tessera from build/sr-src (see
# scripts/gpu/smollm2_gpu.sh) or this checkout (minutes: avoid).
# Environment: LENGTHS (65536,131072), DEPTHS (50; 25,50,75 if time allows), METHODS (ltri,infllm,streamingllm),
# TRACE_LENGTH (16384; 0 skips the trace), TRACE_METHODS (ltri,infllm,streamingllm), BUDGET_S (560).
# Output (at most 8 files come back from $OUT): $OUT/summary.txt and $OUT/gemma-gpu.tgz (summary, logs, the traces,
# the eval reports; made from build/gemma-out/gemma-gpu on exit).
set -u
cd "$(dirname "$0")/../.." || exit 1
ROOT=$PWD
MAX_PART=55000000  # bytes: a part, the tree and nothing else fit one call's carry

if [ "${1:-}" = prepare ]; then
  PARTS=${PARTS:-5}  # (6 if the tree grows past ~13 MB: then build/gemma-p5 too, one more call)
  MODEL=${MODEL:-$HOME/.cache/tessera/models/gemma-3-270m-q4_k_m.gguf}
  [ -f "$MODEL" ] || { echo "no model at $MODEL" >&2; exit 1; }
  SUM=$(sha256sum "$MODEL" | cut -d' ' -f1)
  TMP=$ROOT/build/gemma-split
  rm -rf "$TMP" "$ROOT"/build/gemma-p[0-9]
  mkdir -p "$TMP"
  split -n "$PARTS" -d -a 2 "$MODEL" "$TMP/gemma." || exit 1
  for i in $(seq 0 $((PARTS - 1))); do
    d=$ROOT/build/gemma-p$i
    mkdir -p "$d"
    mv "$TMP/gemma.0$i" "$d/"
    echo "$SUM" > "$d/sha256"
    echo "$PARTS" > "$d/parts"
    size=$(stat -c %s "$d/gemma.0$i")
    [ "$size" -le "$MAX_PART" ] || { echo "part $i is $size bytes, over $MAX_PART" >&2; exit 1; }
    echo "build/gemma-p$i: $size bytes"
  done
  rmdir "$TMP"
  # The parts must join to the model (what the device checks).
  [ "$(cat "$ROOT"/build/gemma-p*/gemma.0* | sha256sum | cut -d' ' -f1)" = "$SUM" ] || { echo "parts do not join" >&2; exit 1; }
  echo "sha256 $SUM"
  BIN=${TESSERA_BIN:-$ROOT/build/cuda-ci/src/tessera}
  if [ -x "$BIN" ]; then
    mkdir -p "$ROOT/build/gemma-bin"
    cp "$BIN" "$ROOT/build/gemma-bin/tessera"
    strip "$ROOT/build/gemma-bin/tessera" 2> /dev/null
    # The shared libraries it links that neither the device's image nor build/gpu-debs has: COIN-OR's CBC (MoA's
    # optimiser in `tessera plan`, linked when this machine has coinor-libcbc-dev) and its libbz2. (liblapack.so.3,
    # which CBC needs, is OpenBLAS's: in build/gpu-debs.)
    rm -rf "$ROOT/build/gemma-bin/lib"
    mkdir -p "$ROOT/build/gemma-bin/lib"
    ldd "$ROOT/build/gemma-bin/tessera" | awk '$3 ~ /^\// {print $1, $3}' | while read -r so path; do
      case $so in
        libCbc* | libCgl* | libOsi* | libClp* | libCoinUtils* | libbz2*) cp -L "$path" "$ROOT/build/gemma-bin/lib/$so" ;;
      esac
    done
    # The KJV haystack (bible-kjv-text's /usr/lib/bible.data, 1.7 MB): the device image lacks it.
    [ -f /usr/lib/bible.data ] && cp /usr/lib/bible.data "$ROOT/build/gemma-bin/bible.data"
    echo "build/gemma-bin/lib: $(ls "$ROOT/build/gemma-bin/lib" | tr '\n' ' ')"
    echo "build/gemma-bin/tessera: $(stat -c %s "$ROOT/build/gemma-bin/tessera") bytes (from $BIN); with build/gpu-debs:" \
      "$(du -cb "$ROOT/build/gemma-bin" "$ROOT/build/gpu-debs" 2> /dev/null | tail -1 | cut -f1) bytes besides the tree"
  else
    echo "no tessera binary at $BIN (TESSERA_BIN=...): build it first (the lead's build/cuda-ci), or the device builds one"
  fi
  exit 0
fi

OUTD=$ROOT/build/gemma-out/gemma-gpu
WORK=$OUTD/traces
LOGS=$OUTD/logs
mkdir -p "$OUTD" "$LOGS" "$WORK"
SUMMARY=$OUTD/summary.txt
touch "$SUMMARY"
pack() {
  [ -n "${OUT:-}" ] || return 0
  cp "$SUMMARY" "$OUT/summary.txt"
  tar czf "$OUT/gemma-gpu.tgz" -C "$ROOT/build/gemma-out" gemma-gpu
}
trap pack EXIT
START=$(date +%s)
BUDGET=${BUDGET_S:-560}
export PATH=$PATH:/usr/local/cuda/bin
STEP_TAIL=20
. "$ROOT/scripts/gpu/step.sh"  # step NAME MAX_SECONDS command...

if [ -d build/gpu-debs ] && [ ! -f build/gpu-sysroot/deps.env ]; then step deps 90 bash scripts/gpu/deps.sh unpack; fi
TESSERA_DEPS_CMAKE_ARGS=""
[ -f build/gpu-sysroot/deps.env ] && . build/gpu-sysroot/deps.env

# The binary: TS, the carried build/gemma-bin/tessera, else a build here.
TS=${TS:-}
if [ -z "$TS" ] && [ -x build/gemma-bin/tessera ]; then
  TS=$ROOT/build/gemma-bin/tessera
  export LD_LIBRARY_PATH="$ROOT/build/gemma-bin/lib:$ROOT/build/gpu-sysroot/usr/lib/x86_64-linux-gnu/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
# eval's and run's default haystack is /usr/lib/bible.data, which the device image lacks: the carried copy (root there).
if [ ! -f /usr/lib/bible.data ] && [ -f build/gemma-bin/bible.data ]; then
  cp build/gemma-bin/bible.data /usr/lib/bible.data || echo "cannot install build/gemma-bin/bible.data as /usr/lib/bible.data"
fi
if [ -z "$TS" ]; then
  BUILD_DIR=$ROOT/build/sr-cuda
  SRC=$ROOT
  [ -f build/sr-src/CMakeLists.txt ] && SRC=$ROOT/build/sr-src
  if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
    step configure 120 bash -c "cd '$SRC' && cmake --preset cuda -B '$BUILD_DIR' $TESSERA_DEPS_CMAKE_ARGS" || exit 1
  fi
  step build 400 cmake --build "$BUILD_DIR" -j "${JOBS:-$(nproc)}" --target tessera || exit 1
  TS=$BUILD_DIR/src/tessera
fi
if ! "$TS" --help > /dev/null 2>&1; then
  echo "tessera does not start: $("$TS" --help 2>&1 | head -3)" | tee -a "$SUMMARY"
  exit 1
fi

MODEL=$ROOT/build/models/gemma-3-270m-q4_k_m.gguf
if [ ! -f "$MODEL" ]; then
  PARTS=$(cat build/gemma-p[0-9]/parts 2> /dev/null | head -1)
  PARTS=${PARTS:-5}
  have=""
  for i in $(seq 0 $((PARTS - 1))); do [ -f "build/gemma-p$i/gemma.0$i" ] && have="$have p$i"; done
  if [ "$have" = "$(for i in $(seq 0 $((PARTS - 1))); do printf ' p%d' "$i"; done)" ]; then
    mkdir -p build/models
    cat build/gemma-p[0-9]/gemma.0[0-9] > "$MODEL"
    if [ "$(sha256sum "$MODEL" | cut -d' ' -f1)" != "$(cat build/gemma-p0/sha256)" ]; then
      echo "model parts do not join to the recorded sha256" | tee -a "$SUMMARY"
      rm -f "$MODEL"
      exit 1
    fi
    echo "model joined from $PARTS parts (sha256 checked)" | tee -a "$SUMMARY"
  else
    echo "model not assembled yet: parts held:${have:- none} (of p0..p$((PARTS - 1)))" | tee -a "$SUMMARY"
    exit 0
  fi
fi
nvidia-smi -L | tee -a "$SUMMARY"

# docs/streaming/run.sh's sizes for Gemma (equal GPU memory for the three methods).
SIZES=(--stream-sinks 64 --stream-local 1024 --stream-block 64 --stream-top-k 8 --stream-chunk 256 --stream-last-chunk 64
  --stream-index-ratio 20)
left() { echo $((BUDGET - ($(date +%s) - START) - 10)); }
PHASES=${PHASES:-eval,trace}
has() { case ",$PHASES," in *,$1,*) return 0 ;; esac; return 1; }

# 1. Needle cases past the 32K context on the GPU (first: the measurement this script is for).
if has eval; then
  for L in $(echo "${LENGTHS:-65536,131072}" | tr ',' ' '); do
    step "eval_$L" "$(left)" "$TS" eval -m "$MODEL" --tasks niah_single -l "$L" --depths "${DEPTHS:-50}" \
      --attn dense --stream "${METHODS:-ltri,infllm,streamingllm}" "${SIZES[@]}" --answer-tokens 16 --device cuda \
      -o "$OUTD/eval_$L"
    grep -iE "pass|fail|stream:" "$LOGS/eval_$L.log" | tail -n 20 | sed "s/^/  $L: /" >> "$SUMMARY"
  done
fi
# 2. The GPU path against the CPU path on one real prompt: the blocks each layer retrieved after every chunk (the
# sliding-window layers retrieve none: only the global layers' records have blocks).
TRACE_LENGTH=${TRACE_LENGTH:-16384}
if has trace && [ "$TRACE_LENGTH" -gt 0 ]; then
  for m in $(echo "${TRACE_METHODS:-ltri,infllm,streamingllm}" | tr ',' ' '); do
    for dev in cuda cpu; do
      step "trace_${m}_$dev" "$(left)" "$TS" run -m "$MODEL" --device "$dev" --needle "$TRACE_LENGTH" -n 16 \
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
layers = sorted({int(k[2]) for k in retr})
print(f"  {m} trace: {len(keys)} (step, layer) records on both ({len(cpu)} cpu, {len(gpu)} gpu); {len(retr)} with "
      f"retrieval (layers {layers}); identical block sets {same}/{len(retr)}; mean Jaccard "
      f"{sum(jac) / max(1, len(jac)):.4f}; first difference {first}")
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

echo "total $(($(date +%s) - START))s" | tee -a "$SUMMARY"
