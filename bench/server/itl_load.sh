#!/usr/bin/env bash
# bench/server/itl_load.sh MODEL TESSERA_BIN OUT — issue 34's latency bar: under 32 clients with mixed prompt lengths,
# the clients' inter-token latency (ITL) p50 against the engine's decode step, with the server's own view beside it
# (bench/server/server_metrics.py: the ITL as the scheduler emits tokens, the engine's decode-only steps and steps
# carrying a prefill chunk, the scheduler's time around a step), so that a gap is placed in the engine, the scheduler
# or between server and client.
#
# For each scheduler VARIANT (";"-separated `serve` flags; "none" for the defaults) one server (`serve --parallel
# PARALLEL`, greedy, dense): a closed loop of CLIENTS clients (bench/server/load.py: REQUESTS requests each, prompts of
# PROMPT_WORDS words, MIN:MAX log-uniform, MAX_TOKENS out) once per client-process count in PROCS (1: every stream's
# thread in one Python interpreter, as before; 0: spread over half the cores), then (MIXED=1) the open-loop mixed run
# (bench/server/mixed.py). Each run is capped by LOAD_S / MIXED_S seconds (requests not sent after it are reported).
#   env: DEVICE (cuda), PARALLEL (32), KV_BUDGET (8G), VARIANTS ("none;--step-tokens 512"), CLIENTS (32),
#        REQUESTS (3), PROMPT_WORDS (1000:6000), MAX_TOKENS (64), PROCS ("1 0"), LOAD_S (60), MIXED (1),
#        MIXED_RATE (4), MIXED_S (45), PORT (18191)
# Writes OUT/load.json, OUT/mixed.json, OUT/server.json, OUT/summary.md and the servers' logs.
# On the GPU machine: `bash scripts/gpu/run.sh itl` (SmolLM2-135M's parts carried before). Tried here on the CPU with
#   DEVICE=cpu PARALLEL=4 KV_BUDGET=1G CLIENTS=4 REQUESTS=1 PROMPT_WORDS=40:200 MAX_TOKENS=8 LOAD_S=60 MIXED_S=30 \
#     MIXED_RATE=2 bash bench/server/itl_load.sh ~/.cache/tessera/models/smollm2-135m-instruct-q4_1.gguf \
#     build/ci/src/tessera /tmp/itl
set -uo pipefail
[ $# -eq 3 ] || { sed -n 2,22p "$0"; exit 2; }
MODEL=$1
TESSERA=$2
OUT=$3
cd "$(dirname "$0")/../.." || exit 1
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
rm -f "$OUT"/load.json "$OUT"/mixed.json "$OUT"/server.json "$OUT"/summary.md
DEVICE=${DEVICE:-cuda}
PROMPT_WORDS=${PROMPT_WORDS:-1000:6000}
PORT=${PORT:-18191}
URL=http://127.0.0.1:$PORT
PY=${PYTHON:-python3}
# shellcheck source=bench/server/serve_lib.sh
. bench/server/serve_lib.sh  # $pid, stop_server (the EXIT trap)
snap() { "$PY" bench/server/server_metrics.py snap "$URL" "$OUT/$1"; }
IFS=';' read -r -a variants <<< "${VARIANTS:-none;--step-tokens 512}"
n=0
for variant in "${variants[@]}"; do
  n=$((n + 1))
  args=$variant
  [ "$variant" = none ] && args=""
  echo "=== variant $n: ${variant}"
  # shellcheck disable=SC2086
  "$TESSERA" serve -m "$MODEL" --model-name bench --port "$PORT" --device "$DEVICE" --parallel "${PARALLEL:-32}" \
    --kv-budget "${KV_BUDGET:-8G}" --queue 256 --timeout 600 --quiet $args > "$OUT/server-$n.log" 2>&1 &
  pid=$!
  up=0
  for _ in $(seq 240); do
    kill -0 "$pid" 2> /dev/null || break
    "$PY" -c "import urllib.request; urllib.request.urlopen('$URL/health', timeout=2)" 2> /dev/null && { up=1; break; }
    sleep 0.5
  done
  if [ "$up" != 1 ]; then
    echo "server did not come up:"
    tail -20 "$OUT/server-$n.log"
    stop_server
    continue
  fi
  for procs in ${PROCS:-1 0}; do
    label="$variant, client procs ${procs/#0/auto}"
    snap m0.txt
    timeout -k 5 $((${LOAD_S:-60} + 120)) "$PY" bench/server/load.py --url "$URL" --model bench \
      --clients "${CLIENTS:-32}" --requests "${REQUESTS:-3}" --prompt-words "${PROMPT_WORDS:-1000:6000}" \
      --max-tokens "${MAX_TOKENS:-64}" --procs "$procs" --deadline "${LOAD_S:-60}" --timeout 300 \
      --label="$label" --json-out "$OUT/load.json"
    snap m1.txt
    "$PY" bench/server/server_metrics.py report "$OUT/m0.txt" "$OUT/m1.txt" --label "$label (closed loop)" \
      --json-out "$OUT/server.json"
  done
  if [ "${MIXED:-1}" = 1 ]; then
    snap m0.txt
    timeout -k 5 $((${MIXED_S:-45} + 60)) "$PY" bench/server/mixed.py --url "$URL" --model bench --requests 64 \
      --rate "${MIXED_RATE:-4}" --min-words "${PROMPT_WORDS%%:*}" --max-words "${PROMPT_WORDS##*:}" \
      --max-tokens "${MAX_TOKENS:-64}" --deadline $((${MIXED_S:-45} - 20)) --grace 20 --timeout 300 \
      --label="$variant" --json-out "$OUT/mixed.json"
    snap m1.txt
    "$PY" bench/server/server_metrics.py report "$OUT/m0.txt" "$OUT/m1.txt" --label "$variant (mixed, open loop)" \
      --json-out "$OUT/server.json"
  fi
  stop_server
done
"$PY" - "$OUT" << 'EOF2' | tee "$OUT/summary.md"
import json, os, sys
sys.path.insert(0, "bench/server")
import load, mixed, server_metrics as sm
out = sys.argv[1]
rd = lambda f: json.load(open(f"{out}/{f}")) if os.path.exists(f"{out}/{f}") else []
print("\n## Closed loop (bench/server/load.py)\n")
print(load.TABLE_HEAD)
for r in rd("load.json"):
    print(load.table_row(r))
if rd("mixed.json"):
    print("\n## Mixed, open loop (bench/server/mixed.py)\n")
    print(mixed.TABLE_HEAD)
    for r in rd("mixed.json"):
        print(mixed.table_row(r))
print("\n## The server's view of each run (bench/server/server_metrics.py)\n")
print(sm.TABLE_HEAD)
nan = float("nan")
for r in rd("server.json"):
    print(sm.table_row({k: (nan if v is None else v) for k, v in r.items()}))
print("\n## The bar: clients' ITL p50 / the decode-only step p50 (<= 2)\n")
clients = {r["label"] + " (closed loop)": r["itl_p50_s"] for r in rd("load.json")}
clients.update({r["label"] + " (mixed, open loop)": r["itl_p50_s"] for r in rd("mixed.json")})
for r in rd("server.json"):
    c, d = clients.get(r["label"]), r.get("step_decode_p50_s")
    if c and d:
        print(f"- {r['label']}: {c * 1e3:.2f} / {d * 1e3:.2f} ms = {c / d:.2f}x (server-side ITL p50 "
              f"{(r.get('itl_p50_s') or nan) * 1e3:.2f} ms)")
EOF2
