#!/usr/bin/env bash
# scripts/gpu/precision_eval.sh [TESSERA] — the accuracy cost of each GPU product precision on the real models
# (issue 35): `tessera eval --device cuda --gemm P` for P in bf16, fp8 (W8A8 E4M3 GEMMs in prefill and decode) and w4
# (4-bit weights in the decode steps of <= 8 rows; prefill stays bf16), and bf16 with FP8 KV blocks (--kv-type fp8), on
# the same cases: needles, multi-key needles
# and variable tracking at three depths, dense and vs_adaptive, and the KJV perplexity at each length.
#   Gemma-3-270M (32K context): 8K, 16K, 32K, bf16 / fp8 / w4
#   SmolLM2-135M (8K context; hidden 576 is not a multiple of w4's 128-element groups): 2K, 4K, 8K, bf16 / fp8
# Models in $TESSERA_MODELS (default build/models, where run.sh's parts are joined); results under ${OUT:-.}/precision.
set -uo pipefail
T=${1:-build/cuda/src/tessera}
M=${TESSERA_MODELS:-build/models}
O=${OUT:-.}/precision
mkdir -p "$O"
one() {  # model lengths gemm [kv-type]
  local name=${1%%-*} dir="$O/$(basename "$1" .gguf)-$3${4:+kv$4}" kv=()
  [ -n "${4:-}" ] && kv=(--kv-type "$4")
  echo "== $name $3 ${4:-} ($2)"
  /usr/bin/time -f "%e s wall, %M KB peak RSS" "$T" eval -m "$M/$1" --device cuda --gemm "$3" "${kv[@]}" \
    --tasks niah_single,niah_multikey,variable_tracking --lengths "$2" --depths 25,50,75 --attn vs_adaptive \
    --perplexity "$2" -o "$dir" > "$dir.log" 2>&1
  echo "rc $? $(tail -1 "$dir.log")"
}
for g in bf16 fp8 w4; do one gemma-3-270m-q4_k_m.gguf 8192,16384,32768 $g; done
one gemma-3-270m-q4_k_m.gguf 8192,16384,32768 bf16 fp8  # FP8 KV blocks (decode; the prefill reads its bf16 staging)
for g in bf16 fp8; do one smollm2-135m-instruct-q4_1.gguf 2048,4096,8192 $g; done
# One table: per model and precision, the cases passed (dense, vs_adaptive) and the perplexity per length.
python3 - "$O" <<'PY' | tee "$O/summary.md"
import json, os, sys, glob
root = sys.argv[1]
print("| model | gemm | policy | cases passed | perplexity by length |")
print("|---|---|---|---:|---|")
for d in sorted(glob.glob(os.path.join(root, "*-*"))):
    if not os.path.isdir(d) or not os.path.exists(os.path.join(d, "results.json")): continue
    by, ppl = {}, {}
    for c in json.load(open(os.path.join(d, "results.json")))["results"]:
        t = by.setdefault(c["policy"], [0, 0]); t[1] += 1; t[0] += bool(c["pass"])
    if os.path.exists(os.path.join(d, "perplexity.json")):
        for e in json.load(open(os.path.join(d, "perplexity.json")))["results"]:
            ppl.setdefault(e["policy"], []).append(f"{e['length']}: {e['perplexity']:.3f}")
    model, gemm = os.path.basename(d).rsplit("-", 1)
    gemm = gemm.replace("kv", " + KV ")
    for p, (ok, n) in by.items():
        print(f"| {model} | {gemm} | {p} | {ok}/{n} | {', '.join(ppl.get(p, []))} |")
PY
