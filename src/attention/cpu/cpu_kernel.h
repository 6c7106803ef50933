// tessera/attention/cpu/cpu_kernel.h — which instruction set the CPU attention executors run.
//
// The executors pick AVX-512 at run time when the CPU has it (AVX-512F/BW/VL/DQ), else the build's baseline
// (AVX2 + FMA on x86-64-v3). Tests and benchmarks may force the baseline to check or time it.
#pragma once

#include <string_view>

namespace tessera::attn {

enum class CpuKernel { Auto, Baseline, Avx512 };

bool cpu_has_avx512();
// Process-wide choice (default Auto). Throws tessera::Error for Avx512 on a CPU without it.
void set_cpu_kernel(CpuKernel kernel);
// The kernel the executors run now (never Auto).
CpuKernel active_cpu_kernel();
std::string_view cpu_kernel_name(CpuKernel kernel);  // "auto", "baseline", "avx512"

}  // namespace tessera::attn
