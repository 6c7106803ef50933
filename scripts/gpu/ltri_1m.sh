#!/usr/bin/env bash
# ltri_1m.sh — Ltri at 1M tokens on one GPU (issue 20), one device call on a 2-GPU kind (256 GiB of host memory: the
# evicted blocks of 1M tokens are ~137 GB pinned; only GPU 0 is used). In order, each step only while time is left
# (DEADLINE_S after the start; a step gets the time left minus a margin):
#   1. stream_decide_test (the fused Ltri scoring and the cuBLAS path against the CPU's scores) and stream_gpu_test,
#      once with each scoring (TESSERA_LTRI_SCORING=fused, then gemm);
#   2. cmpheads: the two scorings (CMP_METHODS: "ltri-gemm", the cuBLAS bf16 GEMMs and the dots buffer, and
#      "ltri-fused", the fused kernel, over the same bf16 mirror) at CMP_SEQ (131072) in one stream_bench run, with
#      the retrieval heads of HEADS_FILE (below);
#   3. cmp: the same without retrieval heads (every head voting over an index of every kv head);
#   4. ltri at 1,048,576 with retrieval heads (HEADS_FILE: Ltri-LLM's Appendix C list for Llama-3-8B, a stand-in on
#      random weights; docs/streaming/gpu-1m-ltri/ltri-llm-retrieval-heads.txt);
#   5. ltri at 1,048,576 without retrieval heads (every head votes, every kv head indexed), if time is left.
# Steps 4-5 are skipped when step 1 fails (ALWAYS=1 runs them anyway). H4's one-GPU call (the scoring comparison
# only; 128 GiB of host memory is enough at 128K):
#   STEPS=tests,cmpheads,cmp DEADLINE_S=150 HOST_BUDGET=100e9 BUILD_DIR=build/h4-cuda BINS=build/h4-bins.tar.xz \
#     bash scripts/gpu/ltri_1m.sh                carry ["build/gpu-debs", "build/h4-bins.tar.xz"]
#
#   binaries built here (ninja -C build/h2-cuda stream_bench stream_gpu_test stream_decide_test), then one device call:
#     BUILD_DIR=build/h2-cuda bash scripts/gpu/ltri_1m.sh     kind nvidia-h200-x2, carry ["build/gpu-debs",
#       "build/h2-cuda/bench/gpu/stream_bench", "build/h2-cuda/tests/gpu/stream_gpu_test",
#       "build/h2-cuda/tests/gpu/stream_decide_test"]
#
# Writes <= 8 files to $OUT/ltri/ (a device call brings back 8 at most): tests.log, machine.txt, {cmpheads,cmp,cmp-*,heads1m,all1m}.log
# (stream_1m.sh's logs), rows.csv (their CSVs' rows), host_mem.txt (their host memory samples, per TAG); prints each row.
# BINS: a tar of BUILD_DIR's bench/gpu/stream_bench and tests/gpu/* unpacked into BUILD_DIR first (the carried tree's
# 64 MiB: three 13 MB binaries and the debs are over it, their tar.xz is 7 MB).
# Env: BUILD_DIR, DEADLINE_S (430), CMP_SEQ (131072), CMP_METHODS (ltri-gemm,ltri-fused), SEQ (1048576), HEADS_FILE,
# CHUNK (512: the paper's), DECODE (8), HOST_BUDGET (230e9), STEPS (tests,cmpheads,cmp,heads,all), TEST_SCORINGS
# (stream_gpu_test's runs: "fused gemm"), SEP_SCORINGS (steps sep / sepheads, below), CMP_SCORING
# (TESSERA_LTRI_SCORING for the bench runs: the scoring of a METHODS row without -gemm / -fused, e.g. gemm-serial,
# d5eedf9's name for the gemm path with sim_kernel; such a row must come first in CMP_METHODS, before a suffixed row's
# setenv/unsetenv). H5's call at d5eedf9 (gemm's sim over the
# heads vs gemm-serial's, the previous sim kernel, same run; reverted since: no TTFT gain in that run, whose second
# rows ran after the first row's engine in the same process):
#   STEPS=tests,cmpheads,cmp TEST_SCORINGS=gemm CMP_METHODS=ltri,ltri-gemm CMP_SCORING=gemm-serial DEADLINE_S=120 \
#     HOST_BUDGET=100e9 BUILD_DIR=build/h5-cuda BINS=build/h5-bins.tar.xz bash scripts/gpu/ltri_1m.sh
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
export BUILD_DIR=${BUILD_DIR:-$ROOT/build/cuda}
OUTROOT=${OUT:-$ROOT/build/stream-out}
mkdir -p "$OUTROOT/ltri"
if [ -n "${BINS:-}" ]; then mkdir -p "$BUILD_DIR" && tar -C "$BUILD_DIR" -xJf "$BINS"; fi
STREAM_OUT=$(mktemp -d)  # stream_1m.sh's own files ($STREAM_OUT/stream/), gathered into $OUTROOT/ltri
bash "$ROOT/scripts/gpu/deps.sh" unpack > /dev/null 2>&1
. "$ROOT/build/gpu-sysroot/deps.env"
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
START=$(date +%s)
DEADLINE_S=${DEADLINE_S:-430}
STEPS=${STEPS:-tests,cmpheads,cmp,heads,all}
HEADS_FILE=${HEADS_FILE:-$ROOT/docs/streaming/gpu-1m-ltri/ltri-llm-retrieval-heads.txt}
left() { echo $((DEADLINE_S - ($(date +%s) - START))); }
has() { [[ ",$STEPS," == *",$1,"* ]]; }
ok=1
if has tests; then
  # stream_gpu_test once per scoring (the engine's decisions equal the CPU's with either: TESSERA_LTRI_SCORING).
  runs="stream_decide_test"
  for sc in ${TEST_SCORINGS:-fused gemm}; do runs="$runs stream_gpu_test:$sc"; done
  for run in $runs; do
    t=${run%%:*}
    scoring=${run#*:}
    [ "$scoring" = "$run" ] && scoring=
    echo "=== $t ${scoring:+(TESSERA_LTRI_SCORING=$scoring)}" >> "$OUTROOT/ltri/tests.log"
    if [ -n "$scoring" ]; then
      TESSERA_LTRI_SCORING=$scoring timeout 120 "$BUILD_DIR/tests/gpu/$t" > "$STREAM_OUT/$t.log" 2>&1
    else
      timeout 120 "$BUILD_DIR/tests/gpu/$t" > "$STREAM_OUT/$t.log" 2>&1
    fi
    rc=$?
    cat "$STREAM_OUT/$t.log" >> "$OUTROOT/ltri/tests.log"
    [ "$rc" = 0 ] || ok=0
    echo "ltri_1m: $t ${scoring:+($scoring) }exit $rc ($(grep -E '^\[  (PASSED|FAILED) ' "$STREAM_OUT/$t.log" | tr '\n' ' '))"
    grep -E "FAILED|Failure|error" "$STREAM_OUT/$t.log" | head -20
  done
fi
run1m() {  # TAG SEQS METHODS EXTRA
  local budget=$(($(left) - 5))
  if [ "$budget" -lt 60 ]; then echo "ltri_1m: $1 skipped ($budget s left)"; return; fi
  env ${CMP_SCORING:+TESSERA_LTRI_SCORING=$CMP_SCORING} OUT=$STREAM_OUT TAG=$1 SEQS=$2 METHODS=$3 LTRI_MAX=1048576 DENSE=0 CHUNK=${CHUNK:-512} DECODE=${DECODE:-8} \
    HOST_BUDGET=${HOST_BUDGET:-230e9} TIME_S=$budget EXTRA="${4:-}" bash "$ROOT/scripts/gpu/stream_1m.sh" | tail -4
  local d=$STREAM_OUT/stream
  cp "$d/$1.log" "$OUTROOT/ltri/$1.log"
  if [ -f "$OUTROOT/ltri/rows.csv" ]; then tail -n +2 "$d/$1.csv" >> "$OUTROOT/ltri/rows.csv"; else cp "$d/$1.csv" "$OUTROOT/ltri/rows.csv"; fi
  { echo "=== $1"; cat "$d/$1.host_mem.txt"; } >> "$OUTROOT/ltri/host_mem.txt"
  cp "$d/gpu.txt" "$OUTROOT/ltri/machine.txt"
}
CMP_METHODS=${CMP_METHODS:-ltri-gemm,ltri-fused}
has cmpheads && run1m cmpheads "${CMP_SEQ:-131072}" "$CMP_METHODS" "--retrieval-heads $HEADS_FILE"
has cmp && run1m cmp "${CMP_SEQ:-131072}" "$CMP_METHODS"
# sep / sepheads: one stream_bench process per scoring of SEP_SCORINGS (a row each, METHODS=ltri with
# TESSERA_LTRI_SCORING set): no row runs after another's engine in the same process.
for sc in ${SEP_SCORINGS:-}; do
  has sep && CMP_SCORING=$sc run1m "cmp-$sc" "${CMP_SEQ:-131072}" ltri
  has sepheads && CMP_SCORING=$sc run1m "cmpheads-$sc" "${CMP_SEQ:-131072}" ltri "--retrieval-heads $HEADS_FILE"
done
if [ "$ok" = 1 ] || [ "${ALWAYS:-0}" = 1 ]; then
  has heads && run1m heads1m "${SEQ:-1048576}" ltri "--retrieval-heads $HEADS_FILE"
  has all && run1m all1m "${SEQ:-1048576}" ltri
else
  echo "ltri_1m: a test failed: the 1M rows skipped"
fi
[ -f "$OUTROOT/ltri/machine.txt" ] || { nvidia-smi; free -g; } > "$OUTROOT/ltri/machine.txt" 2>&1
echo "ltri_1m: done after $(($(date +%s) - START)) s"
exit 0
