#!/usr/bin/env bash
# Builds the libFuzzer harnesses (tests/fuzz, `cmake --preset fuzz`: clang, ASan + UBSan) and runs each one for a
# bounded time from seeds made of tests/data, then prints one summary line per fuzzer (executions, coverage,
# corpus, findings). Exits non-zero if any fuzzer finds something: a crash, a sanitizer report, an exception other
# than tessera::Error, a leak, a timeout, an allocation over -malloc_limit_mb, or a fuzzer that does not run.
#
#   scripts/fuzz.sh                          CI: build, then every fuzzer for 10 s, one at a time
#   scripts/fuzz.sh --seconds 600 --jobs 8   the long run (idle hours; a 16-core machine): 8 fuzzers at once
#   scripts/fuzz.sh --bin DIR ...            run prebuilt fuzzers from DIR (build/fuzz/fuzzers of another machine:
#                                            they link libstdc++ and PCRE2 statically and need no clang)
#
# Options:
#   --seconds N    per fuzzer (default 10)
#   --jobs N       fuzzers run at the same time (default 1); with N above the number of fuzzers, each fuzzer
#                  also forks N / (number of fuzzers) worker processes (libFuzzer -fork)
#   --bin DIR      prebuilt fuzzers; nothing is built
#   --work DIR     corpora, artifacts and logs (default build/fuzz-work); corpora grow from run to run
#   --only NAMES   comma-separated fuzzer names (fuzz_tokenizer_json,fuzz_attn_spec)
#   --nice N       run the fuzzers under `nice -n N` (default 0)
#
# A finding is a bug: its input is in WORK/artifacts/<fuzzer>/ (reproduce: <fuzzer> <input>). Fix it, then keep
# the input under tests/data (model_files/fuzz, tokenizer/fuzz, configs/fuzz) with a GoogleTest that checks the
# exact tessera::Error it now gives (docs/reliability.md, "Fuzzing").
set -euo pipefail
cd "$(dirname "$0")/.."

SECONDS_PER=10
JOBS=1
BIN=""
WORK=build/fuzz-work
ONLY=""
NICE=0
while (($#)); do
  case "$1" in
    --seconds) SECONDS_PER="$2"; shift 2 ;;
    --jobs) JOBS="$2"; shift 2 ;;
    --bin) BIN="$2"; shift 2 ;;
    --work) WORK="$2"; shift 2 ;;
    --only) ONLY="$2"; shift 2 ;;
    --nice) NICE="$2"; shift 2 ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "fuzz.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

start_all=$(date +%s)
if [ -z "$BIN" ]; then
  if ! command -v clang++ > /dev/null; then
    echo "fuzz.sh: clang++ not found (scripts/setup.sh installs clang and libclang-rt-14-dev)" >&2
    exit 2
  fi
  mkdir -p build
  if ! { cmake --preset fuzz && cmake --build --preset fuzz -j "$(nproc)"; } > build/fuzz-build.log 2>&1; then
    echo "fuzz.sh: the fuzz build FAILED (full log in build/fuzz-build.log):" >&2
    grep -E "error|Error|FAILED" build/fuzz-build.log | head -40 >&2
    exit 1
  fi
  BIN=build/fuzz/fuzzers
  echo "fuzz.sh: built $(ls "$BIN" | wc -l) fuzzers in $(( $(date +%s) - start_all )) s (build/fuzz-build.log)"
fi
BIN=$(cd "$BIN" && pwd)

fuzzers=()
for f in "$BIN"/fuzz_*; do
  name=$(basename "$f")
  [ -x "$f" ] || continue
  if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]]; then continue; fi
  fuzzers+=("$name")
done
if ((${#fuzzers[@]} == 0)); then
  echo "fuzz.sh: no fuzzers in $BIN${ONLY:+ named $ONLY}" >&2
  exit 2
fi

mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
rm -rf "$WORK/seeds"
if command -v python3 > /dev/null; then
  python3 tests/fuzz/make_seeds.py "$WORK/seeds" > /dev/null
else
  echo "fuzz.sh: no python3: the fuzzers start from their earlier corpora only, without the tests/data seeds" >&2
fi

FORK=0
if ((JOBS > ${#fuzzers[@]})); then FORK=$((JOBS / ${#fuzzers[@]})); fi

# run_one NAME: one fuzzer for SECONDS_PER seconds; its log is WORK/logs/NAME.log, findings WORK/artifacts/NAME/.
run_one() {
  local name=$1
  local corpus="$WORK/corpus/$name" artifacts="$WORK/artifacts/$name" log="$WORK/logs/$name.log"
  rm -rf "$artifacts"  # findings of an earlier run: this run finds them again if they are still there
  mkdir -p "$corpus" "$artifacts" "$WORK/logs" "$WORK/run/$name"
  local seeds=()
  [ -d "$WORK/seeds/$name" ] && seeds=("$WORK/seeds/$name")
  local fork=()
  ((FORK > 1)) && fork=(-fork="$FORK" -ignore_crashes=0)
  local t0 rc=0
  t0=$(date +%s)
  # The working directory is the fuzzer's own: libFuzzer writes fuzz-N.log files there in -fork mode.
  (cd "$WORK/run/$name" && nice -n "$NICE" "$BIN/$name" "$corpus" "${seeds[@]}" "${fork[@]}" \
    -max_total_time="$SECONDS_PER" -max_len=65536 -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=1024 \
    -artifact_prefix="$artifacts/" -print_final_stats=1) > "$log" 2>&1 || rc=$?
  echo "$rc $(( $(date +%s) - t0 ))" > "$WORK/logs/$name.status"
}

fork_note=""
((FORK > 1)) && fork_note=", -fork=$FORK each"
echo "fuzz.sh: ${#fuzzers[@]} fuzzers, ${SECONDS_PER} s each, $JOBS at a time$fork_note; work in $WORK"
rm -f "$WORK"/logs/*.status
running=0
for name in "${fuzzers[@]}"; do
  run_one "$name" &
  running=$((running + 1))
  if ((running >= JOBS)); then
    wait -n || true
    running=$((running - 1))
  fi
done
wait || true

# One line per fuzzer. Executions: libFuzzer's final stat (or the last status line's #N in -fork mode);
# coverage: the last "cov: N ft: M" (edges and features); corp: inputs in the corpus now.
failed=0
printf '%-22s %12s %8s %8s %7s %8s %6s  %s\n' fuzzer executions cov ft corpus findings secs result
for name in "${fuzzers[@]}"; do
  log="$WORK/logs/$name.log"
  read -r rc secs < "$WORK/logs/$name.status" || { rc=1; secs=0; }
  execs=$(grep -oE 'stat::number_of_executed_units: [0-9]+' "$log" | tail -1 | grep -oE '[0-9]+$' || true)
  [ -n "$execs" ] || execs=$(grep -oE '^#[0-9]+' "$log" | tail -1 | tr -d '#' || true)
  cov=$(grep -oE 'cov: [0-9]+ ft: [0-9]+' "$log" | tail -1 || true)
  edges=$(echo "$cov" | awk '{print $2}')
  features=$(echo "$cov" | awk '{print $4}')
  corpus=$(find "$WORK/corpus/$name" -type f | wc -l)
  findings=$(find "$WORK/artifacts/$name" -type f | wc -l)
  result=ok
  if [ "$rc" != 0 ] || [ "$findings" != 0 ] || [ -z "$execs" ]; then
    result="FINDING (exit $rc; log $log; inputs in $WORK/artifacts/$name)"
    failed=1
  fi
  printf '%-22s %12s %8s %8s %7s %8s %6s  %s\n' "$name" "${execs:-?}" "${edges:-?}" "${features:-?}" "$corpus" \
    "$findings" "$secs" "$result"
done
total=$(( $(date +%s) - start_all ))
if ((failed)); then
  echo "fuzz.sh: FINDINGS (see the lines above; the first error of each log follows), ${total} s in all"
  for name in "${fuzzers[@]}"; do
    grep -m3 -E "ERROR: |runtime error|terminate called|what\(\)" "$WORK/logs/$name.log" 2>/dev/null | sed "s/^/  $name: /" || true
  done
  exit 1
fi
echo "fuzz.sh: no findings; ${#fuzzers[@]} fuzzers x ${SECONDS_PER} s, ${total} s in all"
