#!/usr/bin/env bash
# tessera serve against llama.cpp's server (PyPI llama-cpp-python[server]) on the CPU: the same GGUF, the same
# workload (bench/server/load.py: streamed greedy completions, 1/4/16 closed-loop clients), one after the other.
#
#   bench/server/compare_cpu.sh [TESSERA_BIN] [LLAMA_PYTHON]
#     TESSERA_BIN   default build/ci/src/tessera
#     LLAMA_PYTHON  a python with llama-cpp-python[server] installed (default build/bench-venv/bin/python; make
#                   it with: python3 -m venv build/bench-venv && build/bench-venv/bin/pip install
#                   'llama-cpp-python[server]==0.3.36' -- it compiles llama.cpp, about an hour on 2 cores)
#   env: CLIENTS (1,4,16), REQUESTS (4 per client), MAX_TOKENS (32), PROMPT_WORDS (64), THREADS (nproc),
#        SERVERS ("tessera llama": which to run)
#
# Both servers get all cores (llama.cpp: n_threads; tessera: its thread pool) and answer one request at a time
# (llama-cpp-python's server serializes requests; tessera with --parallel 1), then tessera with --parallel 2.
# llama-cpp-python runs with --interrupt_requests False: by default a new request cuts the answer being streamed
# short, which would make its answers shorter than the workload asks.
set -euo pipefail
cd "$(dirname "$0")/../.."
TESSERA=${1:-build/ci/src/tessera}
LLAMA_PY=${2:-build/bench-venv/bin/python}
MODEL=${TESSERA_MODELS:-$HOME/.cache/tessera/models}/smollm2-135m-instruct-q4_1.gguf
CLIENTS=${CLIENTS:-1,4,16}
THREADS=${THREADS:-$(nproc)}
LOAD=(python3 bench/server/load.py --model smollm2 --clients "$CLIENTS" --requests "${REQUESTS:-4}"
      --max-tokens "${MAX_TOKENS:-32}" --prompt-words "${PROMPT_WORDS:-64}")
LOG=$(mktemp -d)
pid=""
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$LOG"' EXIT

wait_up() {  # wait_up PORT
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$1/v1/models" >/dev/null 2>&1 && return 0
    sleep 0.5
  done
  echo "server on port $1 did not come up" >&2
  cat "$LOG"/*.log >&2
  exit 1
}

echo "machine: $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)); model $MODEL"
SERVERS=${SERVERS:-tessera llama}
echo "| server | clients | requests | tokens/req | tok/s | req/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
for parallel in 1 2; do
  [[ " $SERVERS " == *" tessera "* ]] || break
  TESSERA_NUM_THREADS=$THREADS "$TESSERA" serve -m "$MODEL" --model-name smollm2 --port 18181 --device cpu \
    --parallel "$parallel" --queue 64 --quiet > "$LOG/tessera.log" 2>&1 &
  pid=$!
  wait_up 18181
  "${LOAD[@]}" --url http://127.0.0.1:18181 --label "tessera --parallel $parallel" | tail -n +3
  kill "$pid"; wait "$pid" || true; pid=""
done

[[ " $SERVERS " == *" llama "* ]] || exit 0
"$LLAMA_PY" -m llama_cpp.server --model "$MODEL" --model_alias smollm2 --host 127.0.0.1 --port 18182 \
  --n_threads "$THREADS" --n_threads_batch "$THREADS" --n_ctx 8192 --interrupt_requests False > "$LOG/llama.log" 2>&1 &
pid=$!
wait_up 18182
"${LOAD[@]}" --url http://127.0.0.1:18182 --label "llama-cpp-python $("$LLAMA_PY" -c 'import llama_cpp; print(llama_cpp.__version__)')" | tail -n +3
kill "$pid"; wait "$pid" || true; pid=""
