#!/usr/bin/env bash
# Issue 33, MoA with MoA's calibration recipe (docs/plans/README.md, "MoA with long targets"): long targets (the dense
# model's own 64-token summary of a 2K / 4K document), text the evaluation does not read (licence texts:
# make_calib_33.py wrote calib-licences-2k-4k.jsonl), 4 items per length, profiled at 2K and 4K, the Fisher loss.
# CPU; the commands as run, with what each printed in *.txt and the time -v output in *.log.
#   bash docs/plans/make_plans_33_long.sh [TESSERA]        (default: build/ci/src/tessera)
set -euo pipefail
cd "$(dirname "$0")/../.."
T=${1:-build/ci/src/tessera}
M=${TESSERA_MODELS:-$HOME/.cache/tessera/models}/smollm2-135m-instruct-q4_1.gguf
run() {  # name, arguments
  local name=$1
  shift
  /usr/bin/time -v nice -n 5 "$T" plan -m "$M" "$@" --report-lengths 2048,4096,8192 -o "docs/plans/$name.json" \
    > "docs/plans/$name.txt" 2> "docs/plans/$name.log"
  grep -E "Maximum resident|Elapsed" "docs/plans/$name.log" || true
}
# python3 docs/plans/make_calib_33.py "$T" "$M" > docs/plans/calib-licences-2k-4k.jsonl   (committed)
# The floor inside the optimiser (--moa-no-sink-only: no head reduced to the sink), saving the gradient profile
# (55 MB, not committed) so other options re-plan from it without the reverse-mode passes:
#   NOSINK=1 PROFILE=build/h3-rel/smollm2-long-2k-4k.moaprofile bash docs/plans/make_plans_33_long.sh [TESSERA]
# The per-head cap (--moa-head-cap C: no head may lose more than C of its influence mass), planned from that profile:
#   CAP=C PROFILE=build/h3-rel/smollm2-long-2k-4k.moaprofile bash docs/plans/make_plans_33_long.sh [TESSERA]
# Targets at every row (docs/plans/README.md, "Targets at every row"): the documents as the target, profiled at 2K,
# the floor; then (TEXT_CAP=C) the per-head cap planned from that profile.
#   python3 docs/plans/make_calib_33_text.py < docs/plans/calib-licences-2k-4k.jsonl > docs/plans/calib-licences-2k-text.jsonl
#   TEXT=1 PROFILE=build/h3-rel/prof/smollm2-text-2k.moaprofile bash docs/plans/make_plans_33_long.sh [TESSERA]
#   TEXT_CAP=0.1 PROFILE=build/h3-rel/prof/smollm2-text-2k.moaprofile bash docs/plans/make_plans_33_long.sh [TESSERA]
# Every row at 2K and 4K (docs/plans/README.md, "Every row at 2K and 4K, picked at 4K"): the eight licence items as
# every-row targets (make_calib_33_text.py 8), profiled at 2,048 and 4,096 and saved (TEXT24=1); then planned from
# that profile with the pick at 2,048 (VAL=2048) or 4,096 (VAL=4096), and optionally the per-head cap (TEXT24_CAP=C).
# BOTH=1: the same items with the document and the dense model's own summary as one target (make_calib_33_both.py).
#   TEXT24=1 PROFILE=build/h3/prof/smollm2-text-2k-4k.moaprofile bash docs/plans/make_plans_33_long.sh [TESSERA]
#   VAL=2048 PROFILE=build/h3/prof/smollm2-text-2k-4k.moaprofile bash docs/plans/make_plans_33_long.sh [TESSERA]
#   VAL=4096 PROFILE=build/h3/prof/smollm2-text-2k-4k.moaprofile bash docs/plans/make_plans_33_long.sh [TESSERA]
#   VAL=4096 TEXT24_CAP=0.1 PROFILE=build/h3/prof/smollm2-text-2k-4k.moaprofile bash docs/plans/make_plans_33_long.sh [TESSERA]
#   BOTH=1 PROFILE=build/h3/prof/smollm2-both-2k-4k.moaprofile bash docs/plans/make_plans_33_long.sh [TESSERA]
#   BOTH_CAP=0.1 PROFILE=build/h3/prof/smollm2-both-2k-4k.moaprofile bash docs/plans/make_plans_33_long.sh [TESSERA]
t24_args=(--method moa --lengths 2048,4096 --budget 0.5 --validation-cases 2 --moa-loss fisher --moa-no-sink-only)
if [ "${TEXT24:-0}" = 1 ]; then  # the profile (its first run aborted in CBC before the fix; the plan: VAL=2048)
  run smollm2-moa-text-nosink-2k-4k "${t24_args[@]}" --calib docs/plans/calib-licences-2k-4k-text.jsonl \
    --validation-length 2048 --moa-profile-out "$PROFILE"
  exit 0
fi
if [ -n "${VAL:-}" ]; then
  name=smollm2-moa-text-nosink${TEXT24_CAP:+-cap$TEXT24_CAP}-2k-4k
  [ "$VAL" = 2048 ] || name=$name-val4k
  run "$name" "${t24_args[@]}" --calib docs/plans/calib-licences-2k-4k-text.jsonl --validation-length "$VAL" \
    ${TEXT24_CAP:+--moa-head-cap "$TEXT24_CAP"} --moa-profile-in "$PROFILE"
  exit 0
fi
# Second session (docs/plans/README.md, "... (issue 33, 2026-11-30, second session)"): the text + summary profile
# picked by validation at 2K and 4K together (the geometric mean of the texts' perplexities, held-out answers at
# both), VTEXTS held-out texts per length; BUDGET (default 0.5) for the plan a hair above the window's density.
#   VAL24=1 VTEXTS=2 PROFILE=build/h3/prof/smollm2-both-2k-4k.moaprofile bash docs/plans/make_plans_33_long.sh [TESSERA]
if [ "${VAL24:-0}" = 1 ]; then
  b=${BUDGET:-0.5}
  name=smollm2-moa-both-nosink-2k-4k-val24x${VTEXTS:-1}
  [ "$b" = 0.5 ] || name=$name-b$b
  run "$name" "${t24_args[@]/0.5/$b}" --calib docs/plans/calib-licences-2k-4k-both.jsonl --validation-length 2048,4096 \
    --validation-texts "${VTEXTS:-1}" --moa-profile-in "$PROFILE"
  exit 0
fi
if [ -n "${BOTH_CAP:-}" ]; then
  run "smollm2-moa-both-nosink-cap$BOTH_CAP-2k-4k-val4k" "${t24_args[@]}" --calib docs/plans/calib-licences-2k-4k-both.jsonl \
    --validation-length 4096 --moa-head-cap "$BOTH_CAP" --moa-profile-in "$PROFILE"
  exit 0
fi
if [ "${BOTH:-0}" = 1 ]; then
  run smollm2-moa-both-nosink-2k-4k-val4k "${t24_args[@]}" --calib docs/plans/calib-licences-2k-4k-both.jsonl \
    --validation-length 4096 ${PROFILE:+--moa-profile-out "$PROFILE"}
  exit 0
fi
text_args=(--method moa --calib docs/plans/calib-licences-2k-text.jsonl --lengths 2048 --budget 0.5
  --validation-length 2048 --validation-cases 2 --moa-loss fisher --moa-no-sink-only)
if [ "${TEXT:-0}" = 1 ]; then
  run smollm2-moa-text-nosink-2k "${text_args[@]}" ${PROFILE:+--moa-profile-out "$PROFILE"}
  exit 0
fi
if [ -n "${TEXT_CAP:-}" ]; then
  run "smollm2-moa-text-nosink-cap$TEXT_CAP-2k" "${text_args[@]}" --moa-head-cap "$TEXT_CAP" --moa-profile-in "$PROFILE"
  exit 0
fi
if [ -n "${CAP:-}" ]; then
  run "smollm2-moa-long-nosink-cap$CAP-2k-4k" --method moa --calib docs/plans/calib-licences-2k-4k.jsonl \
    --lengths 2048,4096 --answer-tokens 64 --budget 0.5 --validation-length 2048 --validation-cases 2 --moa-loss fisher \
    --moa-no-sink-only --moa-head-cap "$CAP" --moa-profile-in "$PROFILE"
  exit 0
fi
if [ "${NOSINK:-0}" = 1 ]; then
  run smollm2-moa-long-nosink-2k-4k --method moa --calib docs/plans/calib-licences-2k-4k.jsonl --lengths 2048,4096 \
    --answer-tokens 64 --budget 0.5 --validation-length 2048 --validation-cases 2 --moa-loss fisher --moa-no-sink-only \
    ${PROFILE:+--moa-profile-out "$PROFILE"}
  exit 0
fi
run smollm2-moa-long-2k-4k --method moa --calib docs/plans/calib-licences-2k-4k.jsonl --lengths 2048,4096 \
  --answer-tokens 64 --budget 0.5 --validation-length 2048 --validation-cases 2 --moa-loss fisher
