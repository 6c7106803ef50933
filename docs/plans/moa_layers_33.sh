#!/usr/bin/env bash
# Issue 33, second session: a MoA plan repaired layer by layer by its actual masked loss on held-out text
# (moa_layers_33.py; docs/plans/README.md, "... (issue 33, 2026-11-30, second session)").
#   bash docs/plans/moa_layers_33.sh TESSERA KJVDUMP      (KJVDUMP: a program writing kjv sentences [from, from + n))
#   PLAN=... BETA=... OUT=... bash docs/plans/moa_layers_33.sh ...
# The held-out texts: the kjv haystack from sentence 11,919 and from 14,919 (the evaluation reads it from sentence 0,
# the plan's validation texts from 7,919 and 8,919), written as files for eval --haystack file:PATH.
set -euo pipefail
cd "$(dirname "$0")/../.."
T=${1:-build/ci/src/tessera}
DUMP=${2:?a program that writes the kjv haystack sentences FROM..FROM+N to a file: DUMP FROM N FILE}
M=${TESSERA_MODELS:-$HOME/.cache/tessera/models}/smollm2-135m-instruct-q4_1.gguf
PLAN=${PLAN:-docs/plans/smollm2-moa-both-nosink-2k-4k-val4k.json}
BETA=${BETA:-0.246582}
O=${OUT:-docs/plans/layers33-smollm2}
H=${HYBRIDS:-/tmp/layers33-hybrids}   # the 30 hybrids and the held-out texts (regenerated, not committed)
mkdir -p "$O" "$H"
python3 docs/plans/moa_layers_33.py gen "$PLAN" "$BETA" "$H" > /dev/null
P=$(cat "$H/policies.txt")
files=()
for from in 11919 14919; do
  "$DUMP" "$from" 700 "$H/heldout-$from.txt" > /dev/null
  nice -n 5 "$T" eval -m "$M" --kv-type f32 --tasks none --perplexity 2048,4096 --haystack "file:$H/heldout-$from.txt" \
    --attn "$P" --device cpu -o "$O/ppl-$from" > "$O/ppl-$from.log" 2>&1
  files+=("$O/ppl-$from/perplexity.json")
done
python3 docs/plans/moa_layers_33.py fit "$PLAN" "$BETA" "$H" "$O" "${files[@]}"
# The pick among the repaired plans: each on the same held-out texts beside the plan (the window's and dense's
# figures are the runs above); the least summed log perplexity wins (k = 22 here).
R="$PLAN"
for k in 2 4 6 8 12 22; do R="$R;$O/repair_k$k.json"; done
for from in 11919 14919; do
  nice -n 5 "$T" eval -m "$M" --kv-type f32 --tasks none --perplexity 2048,4096 --haystack "file:$H/heldout-$from.txt" \
    --attn "$R" --device cpu -o "$O/pick-$from" > "$O/pick-$from.log" 2>&1
done
# A check on two more held-out texts (from sentences 20,919 and 25,919: used for no choice): plan, repaired, window.
for from in 20919 25919; do
  "$DUMP" "$from" 700 "$H/heldout-$from.txt" > /dev/null
  nice -n 5 "$T" eval -m "$M" --kv-type f32 --tasks none --perplexity 2048,4096 --haystack "file:$H/heldout-$from.txt" \
    --attn "$PLAN;$O/repair_k22.json;moa:alpha=0,beta=$BETA,sink=64" --device cpu -o "$O/check-$from" \
    > "$O/check-$from.log" 2>&1
done
