#!/usr/bin/env bash
# Builds the model-file fuzzer with clang (libFuzzer + AddressSanitizer + UBSan) and runs it.
#
#   tests/fuzz/run_fuzz.sh [SECONDS] [JOBS]      default: 300 seconds, 2 jobs
#
# Work files go to $FUZZ_WORK (default /tmp/tessera-fuzz): the binary, the growing corpus (seeded from
# tests/data/model_files) and crash-*/leak-*/timeout-* artifacts. A finding is a bug: fix it, then copy the input
# to tests/data/model_files/fuzz/ as gguf-<what>.bin or safetensors-<what>.bin, where model_files_test checks
# that it is now rejected with a tessera::Error.
set -euo pipefail
cd "$(dirname "$0")/../.."
SECONDS_TO_RUN="${1:-300}"
JOBS="${2:-2}"
WORK="${FUZZ_WORK:-/tmp/tessera-fuzz}"
CXX="${CXX_FUZZ:-clang++}"
mkdir -p "$WORK/corpus" "$WORK/artifacts"

"$CXX" -std=c++20 -g -O1 -march=x86-64-v3 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
  -fno-omit-frame-pointer -Isrc \
  src/core/dtype.cpp src/model/mapped_file.cpp src/model/model_file.cpp src/model/gguf.cpp \
  src/model/safetensors.cpp src/model/quant.cpp tests/fuzz/fuzz_model_file.cpp -o "$WORK/fuzz_model_file"

# Seeds: the committed fixtures, previous findings, and two tiny hand-made files.
cp tests/data/model_files/reference.gguf "$WORK/corpus/" 2>/dev/null || true
cp tests/data/model_files/hf_tiny/*.safetensors "$WORK/corpus/" 2>/dev/null || true
cp tests/data/model_files/fuzz/* "$WORK/corpus/" 2>/dev/null || true
python3 - "$WORK/corpus" <<'PY'
import struct, sys, os
d = sys.argv[1]
def s(x): return struct.pack("<Q", len(x)) + x
kv = s(b"general.architecture") + struct.pack("<I", 8) + s(b"llama")
kv += s(b"tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2) + s(b"a") + s(b"b")
ti = s(b"w") + struct.pack("<I", 2) + struct.pack("<qq", 32, 2) + struct.pack("<IQ", 8, 0)  # Q8_0 [2, 32]
head = b"GGUF" + struct.pack("<IQQ", 3, 1, 2) + kv + ti
head += b"\0" * (-len(head) % 32)
open(os.path.join(d, "seed.gguf"), "wb").write(head + bytes(range(68)))
h = b'{"w":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]}}'
open(os.path.join(d, "seed.safetensors"), "wb").write(struct.pack("<Q", len(h)) + h + bytes(8))
PY

echo "run_fuzz: fuzzing for ${SECONDS_TO_RUN}s with ${JOBS} jobs; corpus in $WORK/corpus" >&2
cd "$WORK"  # libFuzzer writes its per-job logs (fuzz-N.log) to the working directory
"$WORK/fuzz_model_file" "$WORK/corpus" -artifact_prefix="$WORK/artifacts/" -max_total_time="$SECONDS_TO_RUN" \
  -max_len=65536 -rss_limit_mb=2048 -malloc_limit_mb=1024 -timeout=10 -jobs="$JOBS" -workers="$JOBS" \
  -print_final_stats=1 2>&1 | tail -n 40
grep -l "ERROR" "$WORK"/fuzz-*.log 2>/dev/null || true
ls "$WORK/artifacts"
