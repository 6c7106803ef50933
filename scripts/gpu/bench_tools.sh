# shellcheck shell=bash disable=SC2034
# scripts/gpu/bench_tools.sh — sourced by the Nsight Compute scripts (kernel_times, prefill_limits, profile_prefill),
# from the repository root: find_bench_tools WHO [LOG] sets BENCH (attention_gpu_bench as scripts/gpu/check.sh
# builds it, build/cuda/bench/gpu) and NCU (Nsight Compute), or prints "WHO: need attention_gpu_bench (built) and
# ncu" (and the tail of LOG, e.g. the build's log) and exits 1.
# HOPPER_KERNEL_REGEX: ncu's --kernel-name for the Hopper prefill kernel; HOPPER_SELF_CHECK_LAUNCHES: how many times
# the kernel's self-check launches it (once per dtype, before the bench's own launches) for --launch-skip.
HOPPER_KERNEL_REGEX="regex:hopper_prefill|sparse_prefill_wgmma"
HOPPER_SELF_CHECK_LAUNCHES=1
find_bench_tools() {
  BENCH=build/cuda/bench/gpu/attention_gpu_bench
  [ -x "$BENCH" ] || BENCH=$(find build -name attention_gpu_bench -type f -perm -u+x | head -1)
  NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  if [ -z "$BENCH" ] || [ -z "$NCU" ]; then
    echo "$1: need attention_gpu_bench (built) and ncu (bench: '${BENCH}', ncu: '${NCU}')"
    [ -n "${2:-}" ] && [ -s "$2" ] && tail -30 "$2"
    exit 1
  fi
}
