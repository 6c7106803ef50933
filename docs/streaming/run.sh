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
# The index ratio (--stream-index-ratio: each layer's lambda searched; docs/streaming.md "The index size").
$T eval -m $M --tasks niah_single --lengths 16384,32768 --depths 50 --attn dense --stream ltri $SIZES --stream-index-ratio 20 --answer-tokens 16 --device cpu -o $E/beyond-ratio20
$T eval -m $M --tasks niah_single --lengths 16384 --depths 50 --attn dense --stream ltri $SIZES --stream-index-ratio 8 --answer-tokens 16 --device cpu -o $E/beyond-ratio8
$T eval -m $M --tasks niah_single --lengths 16384 --depths 50 --attn dense --stream ltri $SIZES --stream-index-ratio 4 --answer-tokens 16 --device cpu -o $E/beyond-ratio4
$T run -m $M --needle 4096 --chat --stream ltri $SIZES --stream-index-ratio 32 -n 16 --device cpu > $E/ratio32-4k/run.log 2>&1
$T eval -m $M --tasks niah_single --lengths 65536 --depths 50 --attn dense --stream ltri $SIZES --answer-tokens 16 --device cpu -o $E/smollm2-64k
$T eval -m $M --tasks niah_single --lengths 16384,32768 --depths 50 --attn dense --stream ltri $SIZES --stream-index-ratio 20 --stream-retrieval-heads $E/smollm2-retrieval-heads.txt --answer-tokens 16 --device cpu -o $E/beyond-ratio20-heads
# Gemma-3-270M (32K native; base model: no chat template), within and past its context.
G=$HOME/.cache/tessera/models/gemma-3-270m-q4_k_m.gguf
$T eval -m $G --tasks niah_single --lengths 8192 --depths 50 --attn dense --stream ltri,streamingllm $SIZES --answer-tokens 16 --device cpu -o $E/gemma-8k
$T eval -m $G --tasks niah_single --lengths 65536 --depths 50 --attn dense --stream ltri,infllm,streamingllm $SIZES --stream-index-ratio 20 --answer-tokens 16 --device cpu -o $E/gemma-64k
$T eval -m $G --tasks niah_single --lengths 65536 --depths 50 --attn dense --stream ltri $SIZES --answer-tokens 16 --device cpu -o $E/gemma-64k-fixed
