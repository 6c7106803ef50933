# shellcheck shell=bash disable=SC2086
# scripts/gpu/phases_multi.sh — several GPUs (tensor parallelism, docs/multi-gpu.md) and the server probe (phases of
# run.sh). Kinds nvidia-h200-x2 / -x4; NCCL from the image's nvidia-nccl wheel (lib.sh nccl_root).

# tp_bench_run NAME ARGS...: tp_bench into $WORK/NAME, its CSV kept as $CSV/tp_NAME.csv.
tp_bench_run() {
  local name=$1
  shift
  STEP_TAIL=12 step "tp_$name" "$(left)" "$(bin tp_bench)" --out "$WORK/tp_$name" --max-seconds $(($(left) - 20)) "$@"
  cp "$WORK/tp_$name/tp_bench.csv" "$CSV/tp_$name.csv" 2> /dev/null
  cp "$WORK/tp_$name/head_profile.json" "$LOGS/head_profile_$name.json" 2> /dev/null
  return 0
}

# Tensor parallelism; MInference's Llama-3-8B-262K config and MoA's plan come in build/tp-data (`run.sh tp-data` here).
#   tp_gpu_test first (TP on N GPUs against the single-GPU engine; a sparse policy under three placements), then
#   TP_STEPS (default: placements):
#   placements  tp_bench --gpus N (every GPU; TP_GPUS) at TP_LENGTHS (131072,262144) under uniform / greedy / genetic
#               placement (costs profiled on the GPU first), and tp_bench --gpus 1 at each length (the baseline)
#   overlap     4 GPUs at 128K, uniform, the all-reduces on the compute stream (--no-overlap) beside the default
#   scaling     tp_bench at 128K on 1 and 2 GPUs (GPUs 0,1), beside the placements' N-GPU rows
#   big         MoA's plan at 128K / 512K and a 1M-token prompt in 128K chunks (4 GPUs)
#   model       the real SmolLM2 (build/models): `tessera run` greedy on one GPU, --gpus 2, --gpus 4 and --gpus 4 as two
#               hosts over NCCL's socket transport; logits compared
phase_tp() {
  need tp_gpu_test tp_bench tessera || return 1
  local gpus=${TP_GPUS:-$(nvidia-smi -L | wc -l)} minf=$ROOT/build/tp-data/Llama_3_8B_Instruct_262k_kv_out_v32_fit_o_best_pattern.json
  local moa=$ROOT/build/tp-data/Llama-3-8B-Instruct-262k_moa_alpha_beta.json steps=${TP_STEPS:-placements} L
  [ "$gpus" -ge 2 ] || { say "tp: needs 2 or more GPUs ($gpus here)"; return 1; }
  [ -f "$minf" ] || { say "tp: no $minf (run.sh tp-data here, carry build/tp-data)"; return 1; }
  STEP_TAIL=6 step tp_test 150 "$(bin tp_gpu_test)"
  if has_step "$steps" placements; then
    for L in ${TP_LENGTHS:-131072 262144}; do
      tp_bench_run "${gpus}gpu_$L" --gpus "$gpus" --policy "$minf" --lengths "$L" --costs profile \
        --placements "${TP_PLACEMENTS:-uniform,greedy,genetic}"
      tp_bench_run "1gpu_$L" --gpus 1 --policy "$minf" --lengths "$L" --costs flops
    done
  fi
  has_step "$steps" overlap && tp_bench_run nooverlap --gpus "$gpus" --policy "$minf" --lengths 131072 \
    --placements uniform --costs flops --no-overlap --tag no-overlap
  if has_step "$steps" scaling; then
    tp_bench_run base1 --gpus 1 --policy "$minf" --lengths 131072 --costs flops --tag 1gpu
    CUDA_VISIBLE_DEVICES=0,1 tp_bench_run base2 --gpus 2 --policy "$minf" --lengths 131072 --tag 2gpu
  fi
  if has_step "$steps" big; then
    [ -f "$moa" ] && tp_bench_run moa --gpus "$gpus" --policy "$moa" --lengths 131072,524288 --placements uniform,genetic --tag moa
    tp_bench_run 1m --gpus "$gpus" --policy "$minf" --lengths 1048576 --chunk 131072 --placements genetic,uniform \
      --costs flops --tag 1m
  fi
  has_step "$steps" model && tp_model
  return 0
}

tp_model() {
  models
  local m=$ROOT/build/models/smollm2-135m-instruct-q4_1.gguf TS attn tag r pids=() rc=0
  [ -f "$m" ] || { say "tp model: no $m"; return 0; }
  TS=$(bin tessera)
  python3 -c "
lines = [f'Room {i} of the archive keeps the code {(i * 7919) % 100000:05d}.' for i in range(1, 301)]
open('$WORK/prompt.txt', 'w').write('\n'.join(lines) + '\n\nWhat code does room 137 of the archive keep? Answer with the code.')"
  local run=("$TS" run -m "$m" -f "$WORK/prompt.txt" --chat -n 24)
  for attn in dense ashape:sink=64,local=1024; do
    tag=${attn%%:*}
    STEP_TAIL=3 step "model_1gpu_$tag" 90 "${run[@]}" --attn "$attn" --device cuda --logits-out "$WORK/l1_$tag.f32"
    STEP_TAIL=3 step "model_2gpu_$tag" 90 "${run[@]}" --attn "$attn" --gpus 2 --logits-out "$WORK/l2_$tag.f32"
    [ "$(nvidia-smi -L | wc -l)" -ge 4 ] && STEP_TAIL=3 step "model_4gpu_$tag" 90 "${run[@]}" --attn "$attn" --gpus 4 \
      --logits-out "$WORK/l4_$tag.f32"
  done
  if [ "$(nvidia-smi -L | wc -l)" -ge 4 ]; then  # two "hosts" of two GPUs: the ranks talk through NCCL's sockets
    for r in 0 1 2 3; do
      CUDA_VISIBLE_DEVICES=$([ $r -lt 2 ] && echo 0,1 || echo 2,3) RANK=$r LOCAL_RANK=$((r % 2)) WORLD_SIZE=4 \
        MASTER_ADDR=127.0.0.1 MASTER_PORT=29611 NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 \
        timeout -k 5 120 "${run[@]}" --attn dense --gpus 4 --logits-out "$WORK/l4h_dense.f32" > "$LOGS/model_twohost_$r.log" 2>&1 &
      pids+=($!)
    done
    for r in "${pids[@]}"; do wait "$r" || rc=1; done
    say "model_twohost_dense $([ $rc = 0 ] && echo ok || echo FAILED)"
  fi
  python3 - "$WORK" << 'PY' | tee -a "$SUMMARY"
import os, sys, numpy as np
w = sys.argv[1]
for tag in ["dense", "ashape"]:
    p = os.path.join(w, f"l1_{tag}.f32")
    if not os.path.exists(p):
        continue
    ref = np.fromfile(p, dtype=np.float32)
    for name in ["l2", "l4", "l4h"]:
        q = os.path.join(w, f"{name}_{tag}.f32")
        if os.path.exists(q):
            x = np.fromfile(q, dtype=np.float32)
            print(f"  {tag} {name}: logits rel L2 {np.linalg.norm(x - ref) / np.linalg.norm(ref):.2e} against one GPU, "
                  f"argmax equal {int(x.argmax()) == int(ref.argmax())}")
PY
}

# The server under the probe of scripts/gpu/serve_probe.py (completions, a chat, a per-request policy, a client that
# leaves mid-stream and a request after it), greedy: `serve --device cuda` and, on 2 or more GPUs, `serve --gpus 2`,
# their answers compared. SERVE_MODEL: a file under build/models (default SmolLM2).
phase_serve() {
  need tessera || return 1
  models
  local m=$ROOT/build/models/${SERVE_MODEL:-smollm2-135m-instruct-q4_1.gguf} TS
  [ -f "$m" ] || { say "serve: no $m (carry it: run.sh parts)"; return 1; }
  TS=$(bin tessera)
  serve_run() {  # serve_run TAG PORT ARGS...
    local tag=$1 port=$2 pid t0
    shift 2
    "$TS" serve -m "$m" --port "$port" "$@" > "$LOGS/serve_$tag.log" 2>&1 &
    pid=$!
    t0=$(date +%s)
    until grep -q "listening on" "$LOGS/serve_$tag.log" || [ $(($(date +%s) - t0)) -gt 90 ]; do sleep 0.5; done
    STEP_TAIL=4 step "probe_$tag" 150 python3 "$ROOT/scripts/gpu/serve_probe.py" "$port" "$WORK/serve_$tag.json"
    kill -TERM "$pid" 2> /dev/null
    wait "$pid"
    say "serve_$tag: exit $? after SIGTERM"
  }
  serve_run 1gpu 8301 --device cuda
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    serve_run 2gpu 8302 --gpus 2
    python3 "$ROOT/scripts/gpu/serve_probe.py" --compare "$WORK/serve_1gpu.json" "$WORK/serve_2gpu.json" | tee -a "$SUMMARY"
  fi
  return 0
}

# The prefix cache on a multi-turn workload (issue 34): bench/server/prefix_turns.py against `serve --device cuda
# --parallel PREFIX_CLIENTS` with the prefix cache and with --no-prefix-cache: each client a document of PREFIX_TOKENS
# (28000) tokens and 4 questions on it, greedy answers of PREFIX_MAX_TOKENS (32); first-turn against later-turn TTFT,
# the answers of both runs compared, the KV held (/metrics) against PREFIX_KV (8G). PREFIX_MODEL: a file under
# build/models (default Gemma-3-270M, carried in parts: run.sh parts ~/.cache/tessera/models/gemma-3-270m-q4_k_m.gguf).
# PREFIX_API: completions (default: Gemma-3-270M's GGUF is a base model without a chat template, so each client's
# conversation is one growing text) or chat.
# OpenAI's client: the image's python3 if it has it, else wheels carried in build/py-wheels (made here with
#   python3 -m pip download openai==3.51.0 -d build/py-wheels --only-binary=:all: --platform manylinux2014_x86_64 \
#     --python-version 3.X   (once per Python the image may have: 3.10, 3.11, 3.12)
# ), installed into build/gpu-run/pyenv without the network.
# itl: issue 34's latency bar (bench/server/itl_load.sh): 32 clients with mixed prompt lengths against `serve
# --parallel 32` on SmolLM2-135M, the clients' ITL beside the server's own (steps, scheduler), per VARIANTS.
#   bash scripts/gpu/run.sh itl       (carry ["build/gpu-debs"] and, on calls before, SmolLM2's parts)
phase_itl() {
  need tessera || return 1
  models
  local m=$ROOT/build/models/${ITL_MODEL:-smollm2-135m-instruct-q4_1.gguf}
  [ -f "$m" ] || { say "itl: no $m (carry it: run.sh parts)"; return 1; }
  STEP_TAIL=40 step itl "$(left)" bash "$ROOT/bench/server/itl_load.sh" "$m" "$(bin tessera)" "$CSV/itl"
}

phase_prefix() {
  need tessera || return 1
  models
  local m=$ROOT/build/models/${PREFIX_MODEL:-gemma-3-270m-q4_k_m.gguf} py=python3
  [ -f "$m" ] || { say "prefix: no $m (carry it: run.sh parts)"; return 1; }
  if ! python3 -c "import openai" 2> /dev/null; then
    [ -d "$ROOT/build/py-wheels" ] || { say "prefix: python3 has no openai and build/py-wheels was not carried"; return 1; }
    step prefix_pyenv 120 bash -c "python3 -m venv '$WORK/pyenv' && '$WORK/pyenv/bin/pip' install -q --no-index \
      --find-links '$ROOT/build/py-wheels' openai==3.51.0" || return 1
    py=$WORK/pyenv/bin/python
  fi
  STEP_TAIL=14 step prefix_turns "$(left)" "$py" "$ROOT/bench/server/prefix_turns.py" --tessera "$(bin tessera)" \
    --model "$m" --device cuda --doc-tokens "${PREFIX_TOKENS:-28000}" --clients "${PREFIX_CLIENTS:-4}" --questions 4 \
    --max-tokens "${PREFIX_MAX_TOKENS:-32}" --kv-budget "${PREFIX_KV:-8G}" --api "${PREFIX_API:-completions}" --json-out "$CSV/prefix_turns.json" \
    --md-out "$LOGS/prefix_turns.md"
}
