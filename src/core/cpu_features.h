// tessera/core/cpu_features.h — run-time CPU feature checks that the compilers' builtins do not cover alike.
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#endif

namespace tessera {

// F16C (the f16 <-> f32 conversions): CPUID leaf 1, ECX bit 29. clang's __builtin_cpu_supports does not know "f16c"
// (an "invalid cpu feature string" error), gcc's does: one check for both. False off x86.
inline bool cpu_has_f16c() {
#if defined(__x86_64__) || defined(_M_X64)
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) != 0 && (c & (1u << 29)) != 0;
#else
  return false;
#endif
}

}  // namespace tessera
