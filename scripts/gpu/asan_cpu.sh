#!/usr/bin/env bash
# scripts/gpu/asan_cpu.sh — the CPU test suite under ASan + UBSan (`cmake --preset asan`, what CI's scripts/test.sh
# runs after the Release suite) on the lent machine's many cores, as a quick check before CI: the Debian packages
# the image lacks come from build/gpu-debs (scripts/gpu/deps.sh download, here; carry build/gpu-debs). The real
# models are not on that machine: the tests that need them skip (TESSERA_ALLOW_MISSING_MODELS=1).
#   device call: bash scripts/gpu/asan_cpu.sh      (prints the build time, ctest's summary and the failures)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
JOBS=${JOBS:-16}
bash scripts/gpu/deps.sh unpack > /dev/null || exit 1
. build/gpu-sysroot/deps.env
start=$(date +%s)
# shellcheck disable=SC2086
cmake --preset asan $TESSERA_DEPS_CMAKE_ARGS > build/asan-configure.log 2>&1 || { tail -30 build/asan-configure.log; exit 1; }
grep -E "^-- tessera: (building|.* off:)" build/asan-configure.log
cmake --build build/asan -j "$JOBS" > build/asan-build.log 2>&1 || { grep -E "error|FAILED" build/asan-build.log | head -30; exit 1; }
echo "asan build: $(( $(date +%s) - start )) s with $JOBS jobs"
start=$(date +%s)
TESSERA_ALLOW_MISSING_MODELS=1 ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:allocator_may_return_null=1 \
  UBSAN_OPTIONS=print_stacktrace=1 ctest --test-dir build/asan -LE gpu -j "$JOBS" --timeout 900 --output-on-failure \
  > build/asan-ctest.log 2>&1
rc=$?
echo "asan ctest: $(( $(date +%s) - start )) s"
grep -E "tests passed|tests failed|\*\*\*Failed|\*\*\*Exception|Timeout|Not Run" build/asan-ctest.log | head -40
grep -E "runtime error|ERROR: AddressSanitizer|ERROR: LeakSanitizer|SUMMARY: " build/asan-ctest.log | sort | uniq -c | head -40
[ -n "${OUT:-}" ] && cp build/asan-ctest.log build/asan-build.log "$OUT/" 2>/dev/null
exit $rc
