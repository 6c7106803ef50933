#!/usr/bin/env bash
# scripts/gpu/stream_host_kv_eval.sh [TESSERA] — the accuracy cost of FP8 evicted blocks (--stream-host-kv fp8) on a
# real model past its context (issue 35): `tessera eval --device cuda --stream ltri,infllm` with the evicted KV in
# host memory as bf16, then as FP8 (E4M3, a scale per token and kv head), on the same needle cases and the KJV
# perplexity, one table. SmolLM2-135M (8K context) at 16K and 32K by default (the sizes of run.sh's `real` phase).
# Models in $TESSERA_MODELS (default build/models, where run.sh's parts are joined); results under ${OUT:-.}/hostkv.
#   device: . scripts/gpu/lib.sh; lib_init; deps_env; models; bash scripts/gpu/stream_host_kv_eval.sh build/cuda/src/tessera
# Another streaming flag compared the same way: FLAG (default --stream-host-kv), VALUES (default "bf16 fp8"; the first
# is the reference the answers are compared with), POLICIES (default ltri,infllm), EXTRA (more flags), NAME (the
# results folder, default hostkv). E.g. Ltri's early layers with SmolLM2's retrieval heads:
#   FLAG=--stream-early-layers VALUES="score votes" POLICIES=ltri NAME=early \
#   EXTRA="--stream-retrieval-heads docs/streaming/smollm2-retrieval-heads.txt" bash scripts/gpu/stream_host_kv_eval.sh T
# FLAG (and EXTRA) may set the sizes below (e.g. --stream-chunk, --stream-top-k): their defaults are then left out.
set -uo pipefail
T=${1:-build/cuda/src/tessera}
M=${TESSERA_MODELS:-build/models}/${MODEL:-smollm2-135m-instruct-q4_1.gguf}
O=${OUT:-.}/${NAME:-hostkv}
FLAG=${FLAG:---stream-host-kv}
VALUES=${VALUES:-bf16 fp8}
LENGTHS=${LENGTHS:-16384,32768}
mkdir -p "$O"
all=(--stream-sinks 64 --stream-local 1024 --stream-block 64 --stream-top-k 8 --stream-chunk 256 --stream-last-chunk 64)
sizes=()  # the sizes above less FLAG's own and EXTRA's (FLAG=--stream-chunk VALUES="256 512": the CLI takes each flag once)
for ((i = 0; i < ${#all[@]}; i += 2)); do
  case " $FLAG ${EXTRA:-} " in *" ${all[i]} "*) ;; *) sizes+=("${all[i]}" "${all[i + 1]}") ;; esac
done
for kv in $VALUES; do
  echo "== $FLAG $kv"
  # shellcheck disable=SC2086
  /usr/bin/time -f "%e s wall, %M KB peak RSS" "$T" eval -m "$M" --device cuda --tasks "${TASKS:-niah_single}" \
    --lengths "$LENGTHS" --depths "${DEPTHS:-10,50,90}" --attn dense --stream "${POLICIES:-ltri,infllm}" "${sizes[@]}" \
    $FLAG "$kv" ${EXTRA:-} --answer-tokens 16 --perplexity "${PPL:-16384}" -o "$O/$kv" > "$O/$kv.log" 2>&1
  echo "rc $? $(tail -1 "$O/$kv.log")"
done
python3 - "$O" "$FLAG" $VALUES <<'PY' | tee "$O/summary.md"
import json, os, sys
root, flag, values = sys.argv[1], sys.argv[2], sys.argv[3:]
ref = values[0]
print(f"| {flag} | policy | cases passed | answers equal to {ref}'s | perplexity by length |")
print("|---|---|---:|---:|---|")
res = {}
for kv in values:
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
        same = sum(1 for k, c in res[kv].items() if k[0] == p and k in res.get(ref, {}) and c.get("output") == res[ref][k].get("output"))
        print(f"| {kv} | {p} | {ok}/{len(cases)} | {same}/{len(cases)} | {', '.join(ppl.get(p, []))} |")
PY
