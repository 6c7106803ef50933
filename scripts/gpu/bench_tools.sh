# scripts/gpu/bench_tools.sh — sourced by the Nsight Compute scripts (kernel_times, variant_cycles, prefill_limits,
# profile_prefill), from the repository root: find_bench_tools WHO [LOG] sets BENCH (the built attention_gpu_bench)
# and NCU (Nsight Compute), or prints "WHO: need attention_gpu_bench (built) and ncu" (and the tail of LOG, e.g. the
# build's log) and exits 1.
find_bench_tools() {
  BENCH=$(find build -name attention_gpu_bench -type f -perm -u+x | head -1)
  NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  if [ -z "$BENCH" ] || [ -z "$NCU" ]; then
    echo "$1: need attention_gpu_bench (built) and ncu (bench: '${BENCH}', ncu: '${NCU}')"
    [ -n "${2:-}" ] && [ -s "$2" ] && tail -30 "$2"
    exit 1
  fi
}
