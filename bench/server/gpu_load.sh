#!/usr/bin/env bash
# tessera serve on the GPU: 1/8/32 clients sending 32K-token prompts, dense against sparse prefill (the load
# bench/server/load.py puts on the server; each request generates --max-tokens 32).
#
#   bench/server/gpu_load.sh MODEL [TESSERA_BIN]      (TESSERA_BIN default build/gpu/src/tessera)
#   env: POLICIES ("dense vs trianglemix"), CLIENTS (1,8,32), REQUESTS (2 per client), PROMPT_WORDS (25000, about
#        32K tokens of the filler text with Llama-3 / Qwen tokenizers; the script prints the real count)
#
# Today's GPU engine serves one sequence (--parallel 1), so concurrent clients queue: the figures show what the
# batched engine (issue 17) has to improve. Not run by the session that wrote it (no GPU there); docs/PERF.md
# says so.
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL=$1
TESSERA=${2:-build/gpu/src/tessera}
PROMPT_WORDS=${PROMPT_WORDS:-25000}
pid=""
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null' EXIT
for policy in ${POLICIES:-dense vs trianglemix}; do
  "$TESSERA" serve -m "$MODEL" --model-name bench --port 18183 --device cuda --attn "$policy" --queue 64 --quiet \
    --timeout 3600 > /tmp/tessera_gpu_serve.log 2>&1 &
  pid=$!
  for _ in $(seq 1200); do curl -sf http://127.0.0.1:18183/health >/dev/null 2>&1 && break; sleep 0.5; done
  prompt_tokens=$(curl -s http://127.0.0.1:18183/v1/completions -H 'Content-Type: application/json' -d "$(python3 -c "
import json, sys; sys.path.insert(0, 'bench/server'); import load
print(json.dumps({'model': 'bench', 'prompt': load.prompt_text(1, $PROMPT_WORDS), 'max_tokens': 1}))")" |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["usage"]["prompt_tokens"])')
  echo "policy $policy: prompts of $prompt_tokens tokens"
  python3 bench/server/load.py --url http://127.0.0.1:18183 --model bench --clients "${CLIENTS:-1,8,32}" \
    --requests "${REQUESTS:-2}" --prompt-words "$PROMPT_WORDS" --max-tokens 32 --label "tessera $policy"
  kill "$pid"; wait "$pid" || true; pid=""
done
