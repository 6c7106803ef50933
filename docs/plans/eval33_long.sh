#!/usr/bin/env bash
# Issue 33: the long-target MoA plan (make_plans_33_long.sh) against the uniform MoA window of its density, exactly as
# README.md's tables of issue 33 (eval33-fisher-smollm2): niah_single / niah_multikey at 2K / 4K, depths 25 / 75,
# seed 0 (none used by the plan), perplexity of the KJV haystack at 2K / 4K, executed density by plan --method measure.
#   bash docs/plans/eval33_long.sh [TESSERA]        (default: build/ci/src/tessera)
#   PLAN=docs/plans/smollm2-moa-long-nosink-2k-4k.json OUT=docs/plans/eval33-long-nosink-smollm2 FLOOR=0 bash ...
#   PLAN=a.json PLANS="b.json;c.json" OUT=... FLOOR=0 bash ...   (several plans of one density beside one window)
set -euo pipefail
cd "$(dirname "$0")/../.."
T=${1:-build/ci/src/tessera}
M=${TESSERA_MODELS:-$HOME/.cache/tessera/models}/smollm2-135m-instruct-q4_1.gguf
PLAN=${PLAN:-docs/plans/smollm2-moa-long-2k-4k.json}
O=${OUT:-docs/plans/eval33-long-smollm2}
# The uniform window of the plan's density at 2,048 (the report's calibration_noise, uniform_window_for).
U=$(python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print([n for n in r['calibration_noise'] if n['length']==2048][0]['uniform_spec'])" "${PLAN%.json}.report.json")
# PLANS (optional): more plan files, ';'-separated, evaluated in the same runs beside PLAN and the window.
P="$PLAN;${PLANS:+$PLANS;}$U"
mkdir -p "$O"
echo "policies: $P" | tee "$O/policies.txt"
nice -n 5 "$T" plan -m "$M" --method measure --attn "$P" --lengths 2048,4096 -o "$O/density.json" > "$O/density.txt" 2> "$O/density.log"
nice -n 5 "$T" eval -m "$M" --kv-type f32 --tasks none --perplexity 2048,4096 --attn "$P" --device cpu -o "$O/ppl" > "$O/ppl.log" 2>&1
nice -n 5 "$T" eval -m "$M" --kv-type f32 --tasks niah_single,niah_multikey -l 2048,4096 --depths 25,75 --attn "$P" \
  --device cpu -o "$O" > "$O/eval.log" 2>&1
[ "${FLOOR:-1}" = 1 ] || exit 0
# The diagnostic: the plan with its sink-only heads (at 2K) given moa_window(0, 1/8), beside the uniform windows of
# its density (beta 0.3, from the measured betas 0.3 / 0.33 / 0.36) and of the plan's own 4K density (the report's
# uniform_spec at 4096).
F=${PLAN%.json}-floor.json
python3 docs/plans/moa_floor_33.py "$PLAN" "$F"
U4=$(python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print([n for n in r['calibration_noise'] if n['length']==4096][0]['uniform_spec'])" "${PLAN%.json}.report.json")
mkdir -p "$O/floor"
nice -n 5 "$T" plan -m "$M" --method measure --attn "$F;$U4;moa:alpha=0,beta=0.3,sink=64;moa:alpha=0,beta=0.33,sink=64;moa:alpha=0,beta=0.36,sink=64" \
  --lengths 2048,4096 -o "$O/floor/density.json" > "$O/floor/density.txt" 2> "$O/floor/density.log"
P="$F;moa:alpha=0,beta=0.3,sink=64;$U4"
nice -n 5 "$T" eval -m "$M" --kv-type f32 --tasks none --perplexity 2048,4096 --attn "$P" --device cpu -o "$O/floor/ppl" > "$O/floor/ppl.log" 2>&1
nice -n 5 "$T" eval -m "$M" --kv-type f32 --tasks niah_single,niah_multikey -l 2048,4096 --depths 25,75 --attn "$P" \
  --device cpu -o "$O/floor" > "$O/floor/eval.log" 2>&1
