#!/usr/bin/env bash
# scripts/gpu/stream_host_kv_eval.sh [TESSERA] — the accuracy cost of FP8 evicted blocks (--stream-host-kv fp8) on a
# real model past its context (issue 35): `tessera eval --device cuda --stream ltri,infllm` with the evicted KV in
# host memory as bf16, then as FP8 (E4M3, a scale per token and kv head), on the same needle cases and the KJV
# perplexity, one table. SmolLM2-135M (8K context) at 16K and 32K by default (the sizes of run.sh's `real` phase).
# Models in $TESSERA_MODELS (default build/models, where run.sh's parts are joined); results under ${OUT:-.}/hostkv.
#   device: . scripts/gpu/lib.sh; lib_init; deps_env; models; bash scripts/gpu/stream_host_kv_eval.sh build/cuda/src/tessera
set -uo pipefail
T=${1:-build/cuda/src/tessera}
M=${TESSERA_MODELS:-build/models}/${MODEL:-smollm2-135m-instruct-q4_1.gguf}
O=${OUT:-.}/hostkv
LENGTHS=${LENGTHS:-16384,32768}
mkdir -p "$O"
sizes=(--stream-sinks 64 --stream-local 1024 --stream-block 64 --stream-top-k 8 --stream-chunk 256 --stream-last-chunk 64)
for kv in bf16 fp8; do
  echo "== host kv $kv"
  /usr/bin/time -f "%e s wall, %M KB peak RSS" "$T" eval -m "$M" --device cuda --tasks "${TASKS:-niah_single}" \
    --lengths "$LENGTHS" --depths "${DEPTHS:-10,50,90}" --attn dense --stream ltri,infllm "${sizes[@]}" \
    --stream-host-kv "$kv" --answer-tokens 16 --perplexity "${PPL:-16384}" -o "$O/$kv" > "$O/$kv.log" 2>&1
  echo "rc $? $(tail -1 "$O/$kv.log")"
done
python3 - "$O" <<'PY' | tee "$O/summary.md"
import json, os, sys
root = sys.argv[1]
print("| host KV | policy | cases passed | answers equal to bf16 blocks' | perplexity by length |")
print("|---|---|---:|---:|---|")
res = {}
for kv in ("bf16", "fp8"):
    d = os.path.join(root, kv)
    if not os.path.exists(os.path.join(d, "results.json")): continue
    res[kv] = {(c["policy"], c["id"]): c for c in json.load(open(os.path.join(d, "results.json")))["results"]}
    ppl = {}
    if os.path.exists(os.path.join(d, "perplexity.json")):
        for e in json.load(open(os.path.join(d, "perplexity.json")))["results"]:
            ppl.setdefault(e["policy"], []).append(f"{e['length']}: {e['perplexity']:.3f}")
    for p in sorted({k[0] for k in res[kv]}):
        cases = [c for k, c in res[kv].items() if k[0] == p]
        ok = sum(bool(c["pass"]) for c in cases)
        same = sum(1 for k, c in res[kv].items() if k[0] == p and k in res.get("bf16", {}) and c.get("output") == res["bf16"][k].get("output"))
        print(f"| {kv} | {p} | {ok}/{len(cases)} | {same}/{len(cases)} | {', '.join(ppl.get(p, []))} |")
PY
