#!/bin/sh
# The streaming evaluation of docs/streaming.md (SmolLM2-135M, CPU).
M=$HOME/.cache/tessera/models/smollm2-135m-instruct-q4_1.gguf
T=tessera
E=${OUT:-eval-out}
SIZES="--stream-sinks 64 --stream-local 1024 --stream-block 64 --stream-top-k 8 --stream-chunk 256 --stream-last-chunk 64"
$T eval -m $M --tasks none --lengths 2048 --depths 30,70 --retrieval-heads-out $E/smollm2-retrieval-heads.txt --device cpu -o $E/heads
$T eval -m $M --tasks niah_single --lengths 4096 --depths 25,75 --attn dense --stream ltri,infllm,streamingllm $SIZES --answer-tokens 16 --device cpu -o $E/native
$T eval -m $M --tasks niah_single --lengths 16384,32768 --depths 50 --attn dense --stream ltri,infllm,streamingllm $SIZES --answer-tokens 16 --device cpu -o $E/beyond
$T eval -m $M --tasks niah_single --lengths 16384,32768 --depths 50 --attn dense --stream ltri $SIZES --stream-retrieval-heads $E/smollm2-retrieval-heads.txt --answer-tokens 16 --device cpu -o $E/beyond-heads
