// tessera/core/clock.h — the one wall clock of timings (stats, benchmarks, progress).
#pragma once

#include <chrono>

namespace tessera {

using Clock = std::chrono::steady_clock;

// Seconds from t0 to now.
inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace tessera
