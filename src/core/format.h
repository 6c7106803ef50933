// tessera/core/format.h — a number as short text, the way printf's "%g" writes it.
#pragma once

#include <cstdio>
#include <string>

namespace tessera {

// 6 significant digits without trailing zeros: "50", "0.25", "1e+06".
inline std::string format_g(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

}  // namespace tessera
