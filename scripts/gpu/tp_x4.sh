#!/usr/bin/env bash
# scripts/gpu/tp_x4.sh — the tensor-parallel engine on a 4-GPU host (issue 21, docs/multi-gpu.md): scaling 1 -> 2 -> 4
# GPUs, placements at 128K-1M, MoA's plan, the real model on 1/2/4 GPUs, and two "hosts" of 2 GPUs each through
# NCCL's network transport. Phases, chosen by PHASES (default: all that the files present allow), each a few
# minutes, so that one device call can hold one or two of them:
#
#   here, once:  bash scripts/gpu/deps.sh download ; bash scripts/gpu/tp_x4.sh prepare
#                (build/gpu-debs; build/tp-data: MInference's and MoA's Llama-3-8B configs; build/smol-p0, -p1: the
#                SmolLM2 GGUF in two parts of < 53 MB, which travel in two calls to the same warm machine)
#   there:       PHASES=bench4,base bash scripts/gpu/tp_x4.sh   (kind nvidia-h100-x4; carry build/gpu-debs,
#                build/tp-data), then PHASES=... with carry build/smol-p0, then build/smol-p1 (the model joins when
#                both parts are there: build/models/smollm2-135m-instruct-q4_1.gguf)
#
#   build   cmake --preset cuda -B build/x4-cuda; targets tessera tp_gpu_test tp_bench (incremental on a warm host);
#           from build/x4-src when carried (here: rm -rf build/x4-src && mkdir -p build/x4-src &&
#           git archive HEAD | tar -x -C build/x4-src), so that uncommitted edits in the checkout cannot break it
#   bench4  tp_gpu_test; tp_bench --gpus 4, MInference Llama-3-8B-262K config, 128K and 512K, uniform / greedy /
#           genetic (costs profiled on the GPU); 128K uniform with the all-reduces on the compute stream (--no-overlap)
#   base    tp_bench --gpus 1 and --gpus 2 (GPUs 0,1) at 128K: the scaling baselines of the same host
#   model   SmolLM2-135M: `tessera run` greedy, on one GPU (the single-GPU engine), --gpus 2 and --gpus 4 (forked
#           ranks), and --gpus 4 as two hosts of two GPUs (RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR set per process,
#           CUDA_VISIBLE_DEVICES 0,1 and 2,3, NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1: the ranks talk through NCCL's
#           socket transport, as separate hosts do); logits (--logits-out) and answers compared
#   big     MoA's Llama-3-8B plan at 128K and 512K (uniform, genetic) and a 1M-token prompt on 4 GPUs (MInference
#           config, prefill in chunks of 128K)
#   serve   `tessera serve --gpus 2` against `tessera serve --device cuda` (one GPU), greedy answers to the same
#           requests (scripts/gpu/serve_probe.py: completions, chat, a per-request policy, a client that leaves
#           mid-stream), then SIGTERM: every rank must exit. The model: SmolLM2 cut to 2 of its 30 layers with its
#           real tokenizer and chat template (scripts/truncate_gguf.py), xz-compressed in build/tiny-served-xz so
#           that it travels with build/gpu-debs in one call
#   stream1m  issue 20's streaming run (scripts/gpu/stream_1m.sh on GPU 0; X4_TARGETS=stream_bench builds it), SEQS
#           (1048576) beside the dense engine at 128K
# $OUT/x4 receives every tp_bench CSV (tp_<phase>.csv), the model comparison (model.txt), logs (x4.tgz), summary.txt.
set -u
set -o pipefail
cd "$(dirname "$0")/../.." || exit 1
ROOT=$PWD
export NCCL_NVLS_ENABLE=0

if [ "${1:-}" = prepare ]; then
  bash scripts/gpu/tp_check.sh prepare > /dev/null || exit 1  # build/tp-data: MInference's config
  cp ../shared/data/moa-configs/Llama-3-8B-Instruct-262k_moa_alpha_beta.json build/tp-data/
  m=${TESSERA_MODEL:-$HOME/.cache/tessera/models/smollm2-135m-instruct-q4_1.gguf}
  mkdir -p build/smol-p0 build/smol-p1
  half=$(( ($(stat -c %s "$m") + 1) / 2 ))
  head -c "$half" "$m" > build/smol-p0/smol.00
  tail -c +$((half + 1)) "$m" > build/smol-p1/smol.01
  sha256sum "$m" | cut -d' ' -f1 > build/smol-p1/sha256
  du -sh build/tp-data build/smol-p0 build/smol-p1
  exit 0
fi

OUTD=${OUT:-$ROOT/build/x4-out}/x4
WORK=$ROOT/build/x4-work
LOGS=$WORK/logs
BUILD_DIR=$ROOT/build/x4-cuda
mkdir -p "$OUTD" "$LOGS"
SUMMARY=$LOGS/summary.txt
touch "$SUMMARY"
START=$(date +%s)
BUDGET=${X4_BUDGET_S:-570}
export PATH=$PATH:/usr/local/cuda/bin

STEP_TAIL=30
. "$ROOT/scripts/gpu/step.sh"  # step NAME MAX_SECONDS command...

# Build (incremental: a warm host keeps build/x4-cuda between calls).
if [ -d build/gpu-debs ] && [ ! -f build/gpu-sysroot/deps.env ]; then step deps 90 bash scripts/gpu/deps.sh unpack; fi
TESSERA_DEPS_CMAKE_ARGS=""
[ -f build/gpu-sysroot/deps.env ] && . build/gpu-sysroot/deps.env
NCCL_ARGS=""
ROOT_NCCL=$(bash scripts/gpu/nccl.sh locate 2> /dev/null | sed -n 's/^TESSERA_NCCL_ROOT=//p' | head -1)
[ -n "$ROOT_NCCL" ] && NCCL_ARGS="-DTESSERA_NCCL_ROOT=$ROOT_NCCL"
# Sources: build/x4-src when it was carried (`git archive HEAD` made here: the committed tree, whatever else is
# being edited in the working tree), else this checkout.
SRC=$ROOT
[ -f build/x4-src/CMakeLists.txt ] && SRC=$ROOT/build/x4-src
if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
  step configure 120 bash -c "cd '$SRC' && cmake --preset cuda -B '$BUILD_DIR' -DTESSERA_BUILD_BENCH=ON $TESSERA_DEPS_CMAKE_ARGS $NCCL_ARGS" || exit 1
fi
step build 360 cmake --build "$BUILD_DIR" -j "${JOBS:-$(nproc)}" --target tessera tp_gpu_test tp_bench ${X4_TARGETS:-} || exit 1
TP=$BUILD_DIR/bench/gpu/tp_bench
TS=$BUILD_DIR/src/tessera
[ -x "$TS" ] || TS=$(find "$BUILD_DIR" -name tessera -type f -perm -u+x | head -1)
MINF=$ROOT/build/tp-data/Llama_3_8B_Instruct_262k_kv_out_v32_fit_o_best_pattern.json
MOA=$ROOT/build/tp-data/Llama-3-8B-Instruct-262k_moa_alpha_beta.json
nvidia-smi -L | tee -a "$SUMMARY"

# The model joins once both parts have arrived (two calls to the same host).
MODEL=$ROOT/build/models/smollm2-135m-instruct-q4_1.gguf
if [ ! -f "$MODEL" ] && [ -f build/smol-p0/smol.00 ] && [ -f build/smol-p1/smol.01 ]; then
  mkdir -p build/models
  cat build/smol-p0/smol.00 build/smol-p1/smol.01 > "$MODEL"
  if [ "$(sha256sum "$MODEL" | cut -d' ' -f1)" != "$(cat build/smol-p1/sha256)" ]; then
    echo "model parts do not join to the recorded sha256" | tee -a "$SUMMARY"
    rm -f "$MODEL"
  fi
fi

left() { echo $((BUDGET - ($(date +%s) - START) - 10)); }
tpb() {  # tpb NAME ARGS...: tp_bench into $WORK/NAME, its CSV kept as $OUTD/tp_NAME.csv
  local name=$1
  shift
  step "$name" "$(left)" "$TP" --out "$WORK/$name" --max-seconds "$(($(left) - 20))" "$@"
  [ -f "$WORK/$name/tp_bench.csv" ] && cp "$WORK/$name/tp_bench.csv" "$OUTD/tp_$name.csv"
  cp "$WORK/$name/head_profile.json" "$OUTD/head_profile_$name.json" 2> /dev/null
  return 0
}

PHASES=${PHASES:-bench4,base,model,big}
case ",$PHASES," in *,bench4,*)
  step tp_gpu_test 120 "$BUILD_DIR/tests/gpu/tp_gpu_test" --gtest_output="xml:$OUTD/tp_gpu_test.xml"
  tpb bench4 --gpus 4 --policy "$MINF" --lengths 131072,524288 --tag overlap
  tpb bench4_nooverlap --gpus 4 --policy "$MINF" --lengths 131072 --placements uniform --costs flops --no-overlap \
    --tag no-overlap
  ;;
esac
case ",$PHASES," in *,base,*)
  tpb base1 --gpus 1 --policy "$MINF" --lengths 131072 --costs flops --tag 1gpu
  CUDA_VISIBLE_DEVICES=0,1 tpb base2 --gpus 2 --policy "$MINF" --lengths 131072 --tag 2gpu
  ;;
esac
case ",$PHASES," in *,model,*)
  if [ -f "$MODEL" ]; then
    # A long prompt with one fact to find: 300 numbered facts, then the question (about 6K tokens).
    python3 - "$WORK/prompt.txt" << 'EOF'
import sys
lines = [f"Room {i} of the archive keeps the code {(i * 7919) % 100000:05d}." for i in range(1, 301)]
open(sys.argv[1], "w").write("\n".join(lines) + "\n\nWhat code does room 137 of the archive keep? Answer with the code.")
EOF
    RUN=("$TS" run -m "$MODEL" --prompt-file "$WORK/prompt.txt" --chat -n 24)
    for attn in dense ashape:sink=64,local=1024; do
      tag=${attn%%:*}
      step "model_1gpu_$tag" 90 "${RUN[@]}" --attn "$attn" --device cuda --logits-out "$WORK/l1_$tag.f32"
      step "model_2gpu_$tag" 90 "${RUN[@]}" --attn "$attn" --gpus 2 --logits-out "$WORK/l2_$tag.f32"
      step "model_4gpu_$tag" 90 "${RUN[@]}" --attn "$attn" --gpus 4 --logits-out "$WORK/l4_$tag.f32"
    done
    # Two hosts of two GPUs: one process per GPU started by hand with torchrun-style variables, the NCCL id over TCP
    # from rank 0, and no peer-to-peer or shared-memory transport (NCCL's socket transport, as between hosts).
    t0=$(date +%s)
    pids=()
    for r in 0 1 2 3; do
      host=$((r / 2))
      CUDA_VISIBLE_DEVICES=$([ $host = 0 ] && echo 0,1 || echo 2,3) RANK=$r LOCAL_RANK=$((r % 2)) WORLD_SIZE=4 \
        MASTER_ADDR=127.0.0.1 MASTER_PORT=29611 NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_DEBUG=INFO \
        timeout -k 5 120 "${RUN[@]}" --attn dense --gpus 4 --logits-out "$WORK/l4h_dense.f32" \
        > "$LOGS/model_twohost_rank$r.log" 2>&1 &
      pids+=($!)
    done
    rc=0
    for p in "${pids[@]}"; do wait "$p" || rc=1; done
    echo "model_twohost_dense $([ $rc = 0 ] && echo ok || echo FAILED) $(($(date +%s) - t0))s" | tee -a "$SUMMARY"
    grep -v "NCCL INFO" "$LOGS/model_twohost_rank0.log" | tail -5
    grep -h "via NET\|NET/Socket" "$LOGS"/model_twohost_rank*.log | head -3 | tee -a "$SUMMARY"
    python3 - "$WORK" "$LOGS" << 'EOF' | tee "$OUTD/model.txt" | tee -a "$SUMMARY"
import sys, os, re, numpy as np
work, logs = sys.argv[1], sys.argv[2]
def answer(log):  # the generated answer: "answer: ..." (one GPU) or the line before "[..., N GPUs] prefill"
    try: lines = [l for l in open(os.path.join(logs, log)).read().splitlines() if "NCCL" not in l]
    except OSError: return "no log"
    for i, l in enumerate(lines):
        if l.startswith("answer: "): return l[len("answer: "):]
        if re.match(r"\[.*GPUs?\] prefill", l) and i > 0: return lines[i - 1]
    return "no answer"
print("| policy | run | vs one GPU: rel L2 of the logits | max abs | same argmax | top-5 overlap | answer |")
print("|---|---|---:|---:|---|---:|---|")
for tag in ["dense", "ashape"]:
    ref_p = os.path.join(work, f"l1_{tag}.f32")
    if not os.path.exists(ref_p): continue
    ref = np.fromfile(ref_p, dtype=np.float32)
    runs = [("1 GPU (single-GPU engine)", f"l1_{tag}.f32", f"model_1gpu_{tag}.log"),
            ("--gpus 2", f"l2_{tag}.f32", f"model_2gpu_{tag}.log"),
            ("--gpus 4", f"l4_{tag}.f32", f"model_4gpu_{tag}.log")]
    if tag == "dense": runs.append(("--gpus 4 as 2 hosts x 2 (NCCL sockets)", "l4h_dense.f32", "model_twohost_rank0.log"))
    for name, f, log in runs:
        p = os.path.join(work, f)
        if not os.path.exists(p): print(f"| {tag} | {name} | missing | | | | |"); continue
        x = np.fromfile(p, dtype=np.float32)
        rel = float(np.linalg.norm(x - ref) / np.linalg.norm(ref))
        top = len(set(np.argsort(-x)[:5]) & set(np.argsort(-ref)[:5]))
        print(f"| {tag} | {name} | {rel:.2e} | {float(np.max(np.abs(x - ref))):.3f} | {int(x.argmax()) == int(ref.argmax())} | {top}/5 | {answer(log)} |")
EOF
  else
    echo "model SKIPPED (build/models/smollm2-135m-instruct-q4_1.gguf not assembled yet)" | tee -a "$SUMMARY"
  fi
  ;;
esac
case ",$PHASES," in *,big,*)
  tpb moa4 --gpus 4 --policy "$MOA" --lengths 131072,524288 --placements uniform,genetic --tag moa
  tpb m1m --gpus 4 --policy "$MINF" --lengths 1048576 --chunk 131072 --placements genetic,uniform --costs flops --tag 1m
  ;;
esac

case ",$PHASES," in *,serve,*)
  SMALL=$ROOT/build/models/smol2l.gguf
  if [ ! -f "$SMALL" ] && [ -f build/tiny-served-xz/smol2l.gguf.xz ]; then
    mkdir -p build/models
    python3 -c "import lzma,sys; open(sys.argv[2],'wb').write(lzma.open(sys.argv[1]).read())" \
      build/tiny-served-xz/smol2l.gguf.xz "$SMALL"
    [ "$(sha256sum "$SMALL" | cut -d' ' -f1)" = "$(cat build/tiny-served-xz/sha256)" ] || rm -f "$SMALL"
  fi
  serve_run() {  # serve_run TAG PORT ARGS...: start, probe, SIGTERM; answers in $WORK/serve_TAG.json
    local tag=$1 port=$2 pid t0 rc
    shift 2
    "$TS" serve -m "$SMALL" --port "$port" --quiet "$@" > "$LOGS/serve_$tag.log" 2>&1 &
    pid=$!
    t0=$(date +%s)
    until grep -q "listening on" "$LOGS/serve_$tag.log" || [ $(($(date +%s) - t0)) -gt 90 ]; do sleep 0.5; done
    timeout 150 python3 scripts/gpu/serve_probe.py "$port" "$WORK/serve_$tag.json" >> "$LOGS/serve_$tag.log" 2>&1
    rc=$?
    kill -TERM "$pid"
    t0=$(date +%s)
    while kill -0 "$pid" 2> /dev/null && [ $(($(date +%s) - t0)) -lt 30 ]; do sleep 0.5; done
    kill -0 "$pid" 2> /dev/null && { echo "serve_$tag: still running 30 s after SIGTERM" | tee -a "$SUMMARY"; kill -KILL "$pid"; }
    echo "serve_$tag: probe rc $rc; exited $(($(date +%s) - t0)) s after SIGTERM; tessera processes left: $(pgrep -c -f "serve -m $SMALL")" | tee -a "$SUMMARY"
    tail -n 6 "$LOGS/serve_$tag.log"
  }
  if [ -f "$SMALL" ]; then
    serve_run 1gpu 8301 --device cuda
    serve_run 2gpu 8302 --gpus 2
    python3 scripts/gpu/serve_probe.py --compare "$WORK/serve_1gpu.json" "$WORK/serve_2gpu.json" | tee "$OUTD/serve.txt" | tee -a "$SUMMARY"
  else
    echo "serve SKIPPED (no build/tiny-served-xz)" | tee -a "$SUMMARY"
  fi
  ;;
esac
case ",$PHASES," in *,stream1m,*)
  step stream1m "$(left)" env BUILD_DIR="$BUILD_DIR" OUT="$OUTD" SEQS="${SEQS:-1048576}" TIME_S="$(($(left) - 15))" \
    bash scripts/gpu/stream_1m.sh
  cp -r "$OUTD/stream" "$WORK/" 2> /dev/null
  ;;
esac

cp "$SUMMARY" "$OUTD/summary.txt"
tar -czf "$OUTD/x4.tgz" -C "$WORK" logs $(cd "$WORK" && ls -d */ 2> /dev/null | grep -v logs) 2> /dev/null
cat "$SUMMARY"
for f in "$OUTD"/tp_*.csv; do [ -f "$f" ] && { echo "== $f"; cat "$f"; }; done
