#!/usr/bin/env bash
# Ltri's index with the retrieval heads' kv heads only (--stream-index-heads retrieval, the default with
# --stream-retrieval-heads) against every kv head (all): SmolLM2-135M, 8K needle, CPU. Same answer, same retrieved
# blocks (the traces) and the same logits expected, bit for bit; the index sizes in the run summaries.
#   bash docs/streaming/index-heads/run.sh; LEN=16384 bash docs/streaming/index-heads/run.sh
set -u
cd "$(dirname "$0")/../../.." || exit 1
T=build/stream/src/tessera
M=~/.cache/tessera/models/smollm2-135m-instruct-q4_1.gguf
H=docs/streaming/smollm2-retrieval-heads.txt
E=docs/streaming/index-heads
SIZES="--stream-sinks 64 --stream-local 1024 --stream-block 64 --stream-top-k 8 --stream-chunk 256 --stream-last-chunk 64"
LEN=${LEN:-8192}
for ih in retrieval all; do
  /usr/bin/time -f "wall %e s" $T run -m $M --needle $LEN --chat --stream ltri $SIZES --stream-retrieval-heads $H \
    --stream-index-heads $ih -n 16 --device cpu --stream-trace /tmp/h4-trace-$ih.txt --logits-out /tmp/h4-logits-$ih.bin \
    > $E/run-$LEN-$ih.log 2>&1
done
# InfLLM-style at the same sizes (the baseline's index; every kv head)
/usr/bin/time -f "wall %e s" $T run -m $M --needle $LEN --chat --stream infllm $SIZES -n 16 --device cpu > $E/run-$LEN-infllm.log 2>&1
cmp /tmp/h4-trace-retrieval.txt /tmp/h4-trace-all.txt && echo "traces equal ($(wc -l < /tmp/h4-trace-all.txt) lines)"
cmp /tmp/h4-logits-retrieval.bin /tmp/h4-logits-all.bin && echo "logits equal"
# With a target index ratio too (RATIO=20 LEN=16384): the retrieval heads' index at ratio 20
if [ -n "${RATIO:-}" ]; then
  /usr/bin/time -f "wall %e s" $T run -m $M --needle $LEN --chat --stream ltri $SIZES --stream-retrieval-heads $H \
    --stream-index-ratio $RATIO -n 16 --device cpu > $E/run-$LEN-ratio$RATIO-retrieval.log 2>&1
fi
