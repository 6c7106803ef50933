#!/usr/bin/env bash
# Issue 33: the SmolLM2 MInference plan for 2K-8K (query-row choice + held-out repair) beside the presets, as the
# tables of README.md ("The SmolLM2 plans of issue 33 and the presets"): executed density (plan --method measure on a
# held-out prompt), KJV perplexity, niah_single / niah_multikey at depths 25 / 75, seed 0 (no plan used them), at
# 2,048 / 4,096 / 8,192, and the uniform MoA window of the plan's executed density at each length (its beta picked
# from a measured grid, so one window per length).
#   bash docs/plans/eval33_minference.sh [TESSERA]     (default: build/ci/src/tessera)
#   PLAN=... OUT=... bash ...
set -euo pipefail
cd "$(dirname "$0")/../.."
T=${1:-build/ci/src/tessera}
M=${TESSERA_MODELS:-$HOME/.cache/tessera/models}/smollm2-135m-instruct-q4_1.gguf
PLAN=${PLAN:-docs/plans/smollm2-minference-2k-8k.json}
OLD=${OLD:-docs/plans/smollm2-minference-2k-4k.json}
O=${OUT:-docs/plans/eval33-minference-smollm2}
mkdir -p "$O"
# The plan's A-shape candidate as a preset (its static shape at the plan's sizing).
A=$(python3 -c "
import json,re,sys
r=json.load(open(sys.argv[1]))
c=[x['pattern'] for x in r['candidates'] if x['pattern'].startswith('ashape')][0]
s,l=re.findall(r'\d+',c)[:2]; print(f'ashape:sink={s},local={l}')" "${PLAN%.json}.report.json")
BETAS="0.06 0.07 0.08 0.09 0.1 0.12 0.14 0.15 0.16 0.17 0.18 0.2 0.25 0.28 0.3 0.32 0.34 0.36"
W=""; for b in $BETAS; do W="$W;moa:alpha=0,beta=$b,sink=64"; done
P="$PLAN;$OLD;vs_adaptive;trianglemix;ashape:sink=64,local=1024;$A"
echo "policies: $P (+ windows $BETAS)" | tee "$O/policies.txt"
nice -n 5 "$T" plan -m "$M" --method measure --attn "$P$W" --lengths 2048,4096,8192 -o "$O/density.json" \
  > "$O/density.txt" 2> "$O/density.log"
# Per length, the window whose executed density is nearest the plan's.
win() {
  python3 -c "
import json,sys
rows=json.load(open(sys.argv[1]))['rows']; L=int(sys.argv[3])
plan=[r['density'] for r in rows if r['policy']==sys.argv[2] and r['length']==L][0]
w=[r for r in rows if r['policy'].startswith('moa:') and r['length']==L]
print(min(w,key=lambda r:abs(r['density']-plan))['policy'])" "$O/density.json" "$PLAN" "$1"
}
W2=$(win 2048); W4=$(win 4096); W8=$(win 8192)
echo "uniform windows: 2K $W2, 4K $W4, 8K $W8" | tee -a "$O/policies.txt"
P24="$P;$W2;$W4"
P8="$P;$W8"
nice -n 5 "$T" eval -m "$M" --kv-type f32 --tasks none --perplexity 2048,4096 --attn "$P24" --device cpu -o "$O/ppl" \
  > "$O/ppl.log" 2>&1
nice -n 5 "$T" eval -m "$M" --kv-type f32 --tasks niah_single,niah_multikey -l 2048,4096 --depths 25,75 --attn "$P24" \
  --device cpu -o "$O" > "$O/eval.log" 2>&1
mkdir -p "$O/8k"
nice -n 5 "$T" eval -m "$M" --kv-type f32 --tasks none --perplexity 8192 --attn "$P8" --device cpu -o "$O/8k/ppl" \
  > "$O/8k/ppl.log" 2>&1
nice -n 5 "$T" eval -m "$M" --kv-type f32 --tasks niah_single,niah_multikey -l 8192 --depths 25,75 --attn "$P8" \
  --device cpu -o "$O/8k" > "$O/8k/eval.log" 2>&1
