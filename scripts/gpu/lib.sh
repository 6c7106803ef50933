# shellcheck shell=bash disable=SC2034
# scripts/gpu/lib.sh — what every GPU phase shares; sourced by scripts/gpu/run.sh (never run on its own).
#   ROOT, the repository root (the working directory); WORK=build/gpu-run (logs, CSVs, scratch); OUT (the device
#   call's $OUT, default build/gpu-run/out): summary.txt, logs.tgz and the run's CSVs (a call brings back 8 files)
#   step NAME MAX_S CMD...   CMD (a command or a shell function) into $LOGS/NAME.log, capped at MAX_S and at what is
#                            left of RUN_BUDGET_S (default 540, for a 600 s call); "NAME ok|FAILED rc=N|TIMEOUT|SKIPPED
#                            (Ns)" into summary.txt, then the log's last STEP_TAIL (20) lines; returns CMD's code
#   left                     seconds left of the budget
#   deps                     the carried Debian packages (build/gpu-debs, scripts/gpu/deps.sh) unpacked once, their
#                            CMake arguments (TESSERA_DEPS_CMAKE_ARGS) and LD_LIBRARY_PATH taken into this shell
#   configure DIR [TREE] [ARGS...]  cmake --preset cuda -B DIR from TREE (default SRC: ROOT, or a commit's tree in
#                            build/new-src) with the deps, NCCL where found
#   need TARGET...           cmake --build BUILD_DIR --target TARGET... unless each is built or carried (PREBUILT=1:
#                            never build)
#   bin NAME                 the path of a test, bench or the CLI: carried in build/gpu-bin (`run.sh bins` here), else
#                            built in BUILD_DIR
#   models                   joins the model parts carried under build/parts-* (`run.sh parts MODEL` here) into
#                            build/models, checks their sha256; installs the carried KJV haystack (build/kjv)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT" || exit 1
WORK=$ROOT/build/gpu-run
LOGS=$WORK/logs
CSV=$WORK/csv
OUT=${OUT:-$WORK/out}
BUILD_DIR=${BUILD_DIR:-$ROOT/build/cuda}
case $BUILD_DIR in /*) ;; *) BUILD_DIR=$ROOT/$BUILD_DIR ;; esac
SRC=${SRC:-$ROOT}  # the tree to build: this one, or a commit's (`run.sh new COMMIT` here: SRC=build/new-src)
case $SRC in /*) ;; *) SRC=$ROOT/$SRC ;; esac
JOBS=${JOBS:-$(nproc)}
BUDGET=${RUN_BUDGET_S:-540}
START=${START:-$(date +%s)}
SUMMARY=$OUT/summary.txt
STEP_TAIL=${STEP_TAIL:-20}
export PATH=$PATH:/usr/local/cuda/bin  # compute-sanitizer, cuobjdump, ncu where the image does not put them on PATH
export NCCL_NVLS_ENABLE=0             # no NVLink multicast on shared machines
export PYTHONUNBUFFERED=1
export ROOT SRC WORK LOGS CSV OUT BUILD_DIR JOBS START BUDGET
# Source archives the build downloads (XGrammar's sdist: cmake/xgrammar.cmake), carried in build/downloads: the GPU
# machine reaches no network.
[ -d "$ROOT/build/downloads" ] && export TESSERA_DOWNLOADS=$ROOT/build/downloads

lib_init() {
  mkdir -p "$OUT" "$LOGS" "$CSV"
  : > "$SUMMARY"
}

say() { echo "$*" | tee -a "$SUMMARY"; }
left() { echo $((BUDGET - ($(date +%s) - START))); }

step() {
  local name=$1 max=$2 cap rc t0 status=ok
  shift 2
  cap=$max
  [ "$(left)" -lt "$cap" ] && cap=$(left)
  if [ "$cap" -lt 10 ]; then
    say "$name SKIPPED (budget spent)"
    return 99
  fi
  t0=$(date +%s)
  if declare -F "$1" > /dev/null; then  # a function: in a child bash, so that timeout can stop it
    # (its definition travels too: a phase's helper is defined inside the phase)
    STEP_FN=$(declare -f "$1") timeout -k 10 "$cap" bash -c '. "$ROOT/scripts/gpu/lib.sh"
      for f in "$ROOT"/scripts/gpu/phases_*.sh; do . "$f"; done; eval "$STEP_FN"; deps_env; "$@"' _ "$@" \
      > "$LOGS/$name.log" 2>&1
  else
    timeout -k 10 "$cap" "$@" > "$LOGS/$name.log" 2>&1
  fi
  rc=$?
  [ $rc -eq 124 ] && status="TIMEOUT after ${cap}s"
  [ $rc -ne 0 ] && [ $rc -ne 124 ] && status="FAILED rc=$rc"
  say "$name $status ($(($(date +%s) - t0))s)"
  [ "$STEP_TAIL" -gt 0 ] && tail -n "$STEP_TAIL" "$LOGS/$name.log"
  return $rc
}

# The sources arrive with the sender's modification times: on a machine kept warm between calls an object built by
# the last call can look newer than a changed source. Touched once per call (NO_TOUCH=1: not at all).
touch_sources() {
  [ "${NO_TOUCH:-0}" = 1 ] && return 0
  [ -f "$WORK/.touched.$START" ] && return 0
  find "$@" -type f -exec touch {} + 2> /dev/null
  : > "$WORK/.touched.$START"
}

deps_env() {
  TESSERA_DEPS_CMAKE_ARGS=${TESSERA_DEPS_CMAKE_ARGS:-}
  if [ -d "$ROOT/build/gpu-debs" ] && [ ! -f "$ROOT/build/gpu-sysroot/deps.env" ]; then
    bash "$ROOT/scripts/gpu/deps.sh" unpack > "$LOGS/deps.log" 2>&1 || { tail -20 "$LOGS/deps.log"; return 1; }
  fi
  # shellcheck disable=SC1091
  [ -f "$ROOT/build/gpu-sysroot/deps.env" ] && . "$ROOT/build/gpu-sysroot/deps.env"
  # binaries built here and carried (`run.sh bins`): the libraries they link that the image lacks
  [ -d "$ROOT/build/gpu-bin/lib" ] && LD_LIBRARY_PATH=$ROOT/build/gpu-bin/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export TESSERA_DEPS_CMAKE_ARGS LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}
}

# NCCL for the tensor-parallel engine: the CUDA toolkit's, or the nvidia-nccl wheel of python3 (the image has it).
nccl_root() {
  local c
  for c in "${TESSERA_NCCL_ROOT:-}" /usr/local/cuda \
    "$(python3 -c 'import nvidia.nccl, os; print(list(nvidia.nccl.__path__)[0])' 2> /dev/null || true)"; do
    if [ -n "$c" ] && [ -f "$c/include/nccl.h" ] && ls "$c"/lib/libnccl.so* > /dev/null 2>&1; then
      echo "$c"
      return 0
    fi
  done
  return 1
}

configure() {
  local dir=$1 src=${2:-$ROOT} nccl
  shift 2 2> /dev/null || shift $#
  nccl=$(nccl_root) && set -- "$@" "-DTESSERA_NCCL_ROOT=$nccl"
  # shellcheck disable=SC2086
  (cd "$src" && cmake --preset cuda -B "$dir" -DTESSERA_WERROR="${WERROR:-ON}" $TESSERA_DEPS_CMAKE_ARGS "$@")
}

bin() {
  local f
  for f in "$ROOT/build/gpu-bin/$1" "$BUILD_DIR/tests/gpu/$1" "$BUILD_DIR/tests/gpu/engine_tests/$1" "$BUILD_DIR/bench/gpu/$1" \
    "$BUILD_DIR/src/$1" "$BUILD_DIR/tests/gpu/plan/$1" "$BUILD_DIR/$1"; do
    [ -x "$f" ] && { echo "$f"; return 0; }
  done
  find "$BUILD_DIR" -name "$1" -type f -perm -u+x 2> /dev/null | head -1
}

need() {
  local t missing=()
  for t in "$@"; do [ -n "$(bin "$t")" ] || missing+=("$t"); done
  ((${#missing[@]})) || return 0
  [ "${PREBUILT:-0}" = 1 ] && { say "need: ${missing[*]} not in $BUILD_DIR (PREBUILT=1)"; return 1; }
  touch_sources "$SRC/src" "$SRC/tests" "$SRC/bench"
  [ -f "$BUILD_DIR/CMakeCache.txt" ] || step configure 150 configure "$BUILD_DIR" "$SRC" || return 1
  step "build_$(echo "${missing[*]}" | tr ' ' '+' | cut -c1-60)" 420 cmake --build "$BUILD_DIR" -j "$JOBS" \
    --target "${missing[@]}"
}

models() {
  local d name n have sum i
  mkdir -p "$ROOT/build/models"
  for d in "$ROOT"/build/parts-*/; do
    [ -f "$d/name" ] || continue
    name=$(cat "$d/name")
    n=$(cat "$d/parts")
    [ -f "$ROOT/build/models/$name" ] && continue
    have=$(ls "$ROOT"/build/parts-*/"$name".part* 2> /dev/null | wc -l)
    [ "$have" -lt "$n" ] && { say "models: $name has $have of $n parts so far"; continue; }
    : > "$ROOT/build/models/$name"
    for ((i = 0; i < n; i++)); do cat "$ROOT"/build/parts-*/"$name.part$(printf %02d "$i")" >> "$ROOT/build/models/$name"; done
    sum=$(sha256sum "$ROOT/build/models/$name" | cut -d' ' -f1)
    if [ "$sum" != "$(cat "$d/sha256")" ]; then
      say "models: $name parts do not join to the recorded sha256"
      rm -f "$ROOT/build/models/$name"
    else
      say "models: build/models/$name joined"
    fi
  done
  if [ ! -f /usr/lib/bible.data ] && [ -f "$ROOT/build/kjv/bible.data" ]; then
    cp "$ROOT/build/kjv/bible.data" /usr/lib/bible.data 2> /dev/null || say "models: cannot install /usr/lib/bible.data"
  fi
  export TESSERA_MODELS=$ROOT/build/models TESSERA_MODEL_DIR=$ROOT/build/models
}

gpu_line() {
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu --format=csv,noheader \
    2> /dev/null | head -1
}

# summary.txt, every log and CSV as logs.tgz, and the CSVs themselves when they fit what a call brings back.
lib_finish() {
  local n
  n=$(find "$CSV" -type f | wc -l)
  if [ "$n" -gt 0 ] && [ "$n" -le "${KEEP_CSV:-6}" ]; then cp "$CSV"/* "$OUT/"; fi
  tar -C "$WORK" -czf "$OUT/logs.tgz" logs csv 2> /dev/null
  echo
  echo "==================== scripts/gpu/run.sh: $(($(date +%s) - START)) s, $(git -C "$ROOT" log --oneline -1 2> /dev/null | cut -c1-60) ===================="
  cat "$SUMMARY"
}
