#!/usr/bin/env bash
# scripts/gpu/plan33_gemma.sh [STEP...] — issue 33 on the GPU: Gemma-3-270M plans for 8K-32K (docs/plans/gemma3_gpu.sh's
# steps, one per name, each capped so that one device call holds several), after `run.sh build` built build/cuda's
# tessera and the model's parts were carried (`run.sh parts`). Results under $OUT/plan33 (tarred into one file).
#   mi      MInference: the search on one sample per end of 8K-32K, held-out answers at 16K (a crash prints its stack,
#           named here by addr2line on the unstripped binary)
#   moa     MoA: 4 every-row items per profiled length (8K, 16K), the pick by held-out answers and text at 16K, the
#           layer repair
#   tmix    TriangleMix: the gradient probe's split at 8K
#   moatasks MoA for MODEL: a --calib file with synthetic retrieval tasks beside it (MOA_CALIB, MOA_LENGTHS, MOA_VAL;
#           MOA_TASKS tasks per length, default 4; MOA_SEEDS "7 11 13" (one plan each) or MOA_SEED; MOA_VCASES held-out
#           tasks per validation length; MOA_NO_REPAIR non-empty: without --moa-layer-repair)
#   tmixsel TriangleMix: the split by held-out answers and validation text (--trianglemix-select), MODEL's
#   eval    density, the accuracy harness and KJV perplexity at 8K/16K/32K: the plans beside the presets of the same
#           cost (vs_adaptive, trianglemix, ashape, the uniform MoA window of the MoA plan's density) and dense
#   Vars: T (the CLI, default build/cuda/src/tessera); MI_CAP, MOA_CAP, DENSITY_CAP, EVAL_CAP (seconds: 200, 480, 120, 480);
#   MI_BUDGET, MOA_BUDGET (--budget, default 0.3, 0.5; MI_BUDGETS / MOA_BUDGETS: several, one plan each, "-bB" names); MI_VAL, MI_CASES (mi's held-out lengths and cases per length:
#   16384, 4), MI_REPAIR (non-empty: --minference-repair on those), MI_NAME (its plan's name); DEPTHS, SAMPLES (eval's cases: 25,75 and 1); PLAN_FILES (more
#   plans for eval: paths in the tree, space-separated); MODEL (under build/models, default Gemma-3-270M's GGUF), LENGTHS
#   (eval's, default 8192,16384,32768), EVAL_NAME (its folder), UNI_FROM (the MoA report naming the uniform window); PRESETS (eval's presets
#   beside the plans, ';'-separated; default vs_adaptive;trianglemix;ashape:sink=64,local=2048, and the MoA report's
#   uniform window); PLANS (eval's plan files under $OUT/plan33 without .json; default the three above).
set -uo pipefail
. "$(dirname "$0")/lib.sh"
lib_init
deps_env > /dev/null 2>&1 || true
models > /dev/null
T=${T:-$ROOT/build/cuda/src/tessera}
MODEL=${MODEL:-gemma-3-270m-q4_k_m.gguf}
MNAME=${MODEL%%-*}  # gemma, smollm2
M=$ROOT/build/models/$MODEL
O=$OUT/plan33
mkdir -p "$O"
L=${LENGTHS:-8192,16384,32768}
named_stack() {  # the crash report's "binary(+0xOFFSET)" frames through addr2line
  grep -o '(+0x[0-9a-f]*)' "$1" | tr -d '()+' | while read -r off; do addr2line -f -C -e "$T" "$off" | head -1; done
}
run_step() {  # NAME CAP_S CMD...
  local name=$1 cap=$2 t0 rc
  shift 2
  t0=$(date +%s)
  timeout "$cap" "$@" > "$O/$name.txt" 2> "$O/$name.err"
  rc=$?
  say "$name rc $rc ($(($(date +%s) - t0)) s): $(tail -1 "$O/$name.err")"
  if grep -q 'fatal signal' "$O/$name.err"; then named_stack "$O/$name.err" > "$O/$name.stack"; head -30 "$O/$name.stack"; fi
  return $rc
}
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(mi moa tmix eval)
for s in "${steps[@]}"; do
  case $s in
    mi)
      # MI_BUDGETS "0.35 0.45": one plan per budget, named ${MI_NAME}-bBUDGET (the mi step's log likewise)
      for b in ${MI_BUDGETS:-${MI_BUDGET:-0.3}}; do
      sfx=${MI_BUDGETS:+-b$b}
      run_step "mi$sfx" "${MI_CAP:-200}" "$T" plan --method minference -m "$M" --device cuda --lengths 8192,32768 --samples 1 --budget "$b" \
        --validation-length "${MI_VAL:-16384}" --validation-cases "${MI_CASES:-4}" ${MI_REPAIR:+--minference-repair} \
        --report-lengths $L -o "$O/${MI_NAME:-gemma3-minference-8k-32k}$sfx.json" ||
        [ ! -f "$O/mi$sfx.stack" ] ||  # crashed: the 32K sample with candidates sized for it (no shorter sample)
        run_step "mi32$sfx" 120 "$T" plan --method minference -m "$M" --device cuda --lengths 32768 --samples 1 --budget "$b" \
          --validation-cases 0 -o "$O/mi32$sfx.json"
      done ;;
    moa) # MoA's recipe as it beat the uniform window on SmolLM2 (docs/plans/README.md): targets at every row (KJV
         # passages the evaluation does not read, make_calib_33_gemma.py), the Fisher loss, no sink-only rules, the
         # pick by held-out answers and text at 16K, the layer repair; the window layers left to the model (c5060a0).
         run_step moa "${MOA_CAP:-480}" "$T" plan --method moa -m "$M" --device cuda --lengths 8192,16384 \
          --calib "$ROOT/docs/plans/calib-kjv-gemma3-8k-16k-text.jsonl" --budget "${MOA_BUDGET:-0.5}" \
          --validation-length 16384 --validation-cases 4 --moa-loss fisher --moa-no-sink-only --moa-layer-repair \
          --report-lengths $L -o "$O/gemma3-moa-8k-16k.json" ;;
    tmix) run_step tmix 150 "$T" plan --method trianglemix -m "$M" --device cuda --lengths 8192 --samples 4 \
          --validation-length 16384 --validation-cases 4 --report-lengths $L -o "$O/gemma3-trianglemix.json" ;;
    moatasks) # MoA for MODEL on a calibration file (MOA_CALIB, a path in the tree) with synthetic retrieval tasks
         # beside it (--calib-tasks: MOA_TASKS per length, seeds MOA_SEEDS or MOA_SEED (default 7): not the evaluation's
         # seed 0), profiled at MOA_LENGTHS, picked (and repaired unless MOA_NO_REPAIR) at MOA_VAL with MOA_VCASES
         # held-out tasks per length (default 4); one plan per seed, $MNAME-moa-tasks-seedN.json
         # MOA_BUDGETS "0.6 0.7": one plan per seed and budget, $MNAME-moa-tasks-seedN-bBUDGET.json
         for seed in ${MOA_SEEDS:-${MOA_SEED:-7}}; do
          for b in ${MOA_BUDGETS:-${MOA_BUDGET:-0.5}}; do
           sfx=${MOA_BUDGETS:+-b$b}
           run_step "moatasks-$MNAME-seed$seed$sfx" "${MOA_CAP:-330}" "$T" plan --method moa -m "$M" --device cuda \
            --lengths "$MOA_LENGTHS" --calib "$ROOT/$MOA_CALIB" --calib-tasks --samples "${MOA_TASKS:-4}" --seed "$seed" \
            --budget "$b" --validation-length "$MOA_VAL" --validation-cases "${MOA_VCASES:-4}" \
            --moa-loss fisher --moa-no-sink-only $([ -n "${MOA_NO_REPAIR:-}" ] || echo --moa-layer-repair) \
            --report-lengths $L -o "$O/$MNAME-moa-tasks-seed$seed$sfx.json"
          done
         done ;;
    tmixsel) # TriangleMix's split by held-out answers and validation perplexity (--trianglemix-select), for MODEL:
         # TMIX_LENGTHS (calibration, default 8192), TMIX_VAL (validation lengths, default 16384), TMIX_TOL (0.02)
         run_step "tmixsel-$MNAME" 300 "$T" plan --method trianglemix -m "$M" --device cuda \
          --lengths "${TMIX_LENGTHS:-8192}" --samples 4 --validation-length "${TMIX_VAL:-16384}" --validation-cases 4 \
          --trianglemix-select "${TMIX_TOL:-0.02}" --report-lengths $L -o "$O/$MNAME-trianglemix-select.json" ;;
    eval)
      P=""
      for f in ${PLANS:-gemma3-minference-8k-32k gemma3-moa-8k-16k gemma3-trianglemix}; do
        [ -f "$O/$f.json" ] && P="$P$O/$f.json;"
      done
      for f in ${PLAN_FILES:-}; do P="$P$ROOT/$f;"; done  # committed plans (paths in the tree)
      UNI=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['calibration_noise'][-1]['uniform_spec'])" \
        "$O/${UNI_FROM:-gemma3-moa-8k-16k}.report.json" 2> /dev/null)
      Q="${PRESETS:-vs_adaptive;trianglemix;ashape:sink=64,local=2048}${UNI:+;$UNI}"
      run_step density "${DENSITY_CAP:-120}" "$T" plan --method measure -m "$M" --lengths $L --attn "$P$Q" -o "$O/eval33-gemma3-density.json"
      run_step eval "${EVAL_CAP:-480}" "$T" eval -m "$M" --device cuda --tasks niah_single,niah_multikey,variable_tracking -l $L \
        --depths "${DEPTHS:-25,75}" --samples "${SAMPLES:-1}" --attn "$P$Q" --perplexity $L -o "$O/${EVAL_NAME:-eval33-gemma3}" ;;
    *) say "unknown step $s" ;;
  esac
done
tar -czf "$OUT/plan33.tgz" -C "$OUT" plan33 && rm -rf "$O"
